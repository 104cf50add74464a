"""Run upstream vLLM 0.32.0's own tests against the pristine and the transformed tree.

Each tree runs in its own pytest process (contracts/upstream.py); the outcome of every test id
is read from JUnit XML and the two sets are compared.

    python -m tests.upstream                 # the CI subset, both trees
    python -m tests.upstream --full          # all of tests/v1/core and tests/v1/kv_connector/unit
    python -m tests.upstream --full --record # also write contracts/expected/upstream-outcomes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transforms.trees import REPO, build_transformed_tree, tree_env  # noqa: E402
from contracts.upstream import CI_SUBSET, EXPECTED, FULL, UpstreamRun, compare, run_pytest, scratch_copy  # noqa: E402,F401

SDIST_ROOT = REPO / ".cache" / "sdist" / "vllm-0.32.0"


def run_tree(label: str, paths: tuple[str, ...], work: Path, timeout: int = 3600) -> UpstreamRun:
    """Upstream's tests under paths on one tree: "pristine" (the installed vLLM) or "transformed"."""
    scratch = work / "scratch"
    if not scratch.exists():
        scratch_copy(SDIST_ROOT, scratch)
    tree = build_transformed_tree(work / "transformed") if label == "transformed" else None
    return run_pytest(label, scratch, paths, tree_env(tree), timeout)


def run_both(paths: tuple[str, ...], work: Path, timeout: int = 3600) -> tuple[UpstreamRun, UpstreamRun]:
    """Both trees at once (one pytest process each: two cores, half the wall time)."""
    from concurrent.futures import ThreadPoolExecutor

    scratch_copy(SDIST_ROOT, work / "scratch")
    with ThreadPoolExecutor(max_workers=2) as pool:
        pristine = pool.submit(run_tree, "pristine", paths, work, timeout)
        transformed = pool.submit(run_tree, "transformed", paths, work, timeout)
        return pristine.result(), transformed.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all of tests/v1/core and tests/v1/kv_connector/unit (slow)")
    parser.add_argument("--out", type=Path, help="write both runs' outcomes as JSON here")
    parser.add_argument("--record", action="store_true",
                        help=f"write the transformed tree's outcomes (and the pristine one's where they differ) to "
                             f"{EXPECTED.relative_to(REPO)}, what the image contracts compare against")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sparkcache-upstream-") as tmp:
        pristine, transformed = run_both(FULL if args.full else CI_SUBSET, Path(tmp), timeout=4 * 3600)
    differ = compare(pristine.outcomes, transformed.outcomes)
    record = {"paths": list(FULL if args.full else CI_SUBSET), "transformed": transformed.outcomes,
              "pristine_where_different": {i: pristine.outcomes.get(i) for i in differ}}
    if args.out:
        args.out.write_text(json.dumps({**record, "pristine": pristine.outcomes}, indent=0, sort_keys=True) + "\n")
    if args.record:
        EXPECTED.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    print(f"pristine: {pristine.summary()}\ntransformed: {transformed.summary()}\ndiffering outcomes: {len(differ)}")
    for test_id in differ:
        print(f"  {test_id}: {pristine.outcomes.get(test_id)} -> {transformed.outcomes.get(test_id)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
