"""Run upstream vLLM 0.32.0's own tests against the pristine and the transformed tree.

The sdist's ``tests/`` (with its ``pyproject.toml``) is copied to a scratch
directory so that its ``vllm/`` never shadows the installed package (the
sdist's copy cannot detect the CPU). Each tree runs in its own pytest
process; the outcome of every test id is read from JUnit XML and the two
sets are compared.

    python -m tests.upstream            # the CI subset, both trees
    python -m tests.upstream --full     # all of tests/v1/core and tests/v1/kv_connector/unit
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import REPO, build_transformed_tree, tree_env  # noqa: E402

SDIST_ROOT = REPO / ".cache" / "sdist" / "vllm-0.32.0"

# Scheduler, prefix caching, hybrid/Mamba and connector lifecycle (DESIGN.md).
CI_SUBSET = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py",
)
FULL = ("tests/v1/core", "tests/v1/kv_connector/unit")

# Upstream's scheduler helpers name facebook/opt-125m; its config.json (architecture numbers only,
# no weights, no tokenizer) is written into an offline Hugging Face cache so ModelConfig resolves.
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "activation_function": "relu",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}


@dataclass(frozen=True)
class UpstreamRun:
    tree: str
    outcomes: dict[str, str]  # test id -> passed / failed / error / skipped

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    def summary(self) -> str:
        return ", ".join(f"{self.count(o)} {o}" for o in ("passed", "failed", "error", "skipped"))


def scratch_copy(sdist_root: Path, dest: Path) -> Path:
    """dest gets the sdist's tests/, pyproject.toml and examples/, but never its vllm/."""
    if not (sdist_root / "tests").is_dir():
        raise FileNotFoundError(f"{sdist_root}/tests not found: run `python -m transforms fetch --dest {sdist_root.parent}`")
    shutil.copytree(sdist_root / "tests", dest / "tests")
    shutil.copy2(sdist_root / "pyproject.toml", dest / "pyproject.toml")
    if (sdist_root / "examples").is_dir():
        shutil.copytree(sdist_root / "examples", dest / "examples")
    offline_hf_home(dest / "hf-home")
    return dest


def offline_hf_home(dest: Path) -> Path:
    """An HF_HOME whose hub cache holds facebook/opt-125m's config.json and nothing else."""
    repo = dest / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    (repo / "snapshots" / revision).mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    return dest


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "error" in kinds:
            outcome = "error"
        elif "failure" in kinds:
            outcome = "failed"
        elif "skipped" in kinds:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A test that passed but errored in teardown is recorded twice; keep the worst.
        if outcomes.get(test_id) not in ("error", "failed"):
            outcomes[test_id] = outcome
    return outcomes


def run_tree(label: str, tree: Path | None, scratch: Path, paths: tuple[str, ...], timeout: int) -> UpstreamRun:
    junit = scratch / f"junit-{label}.xml"
    env = tree_env(tree)
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(REPO), str(scratch))
    env["HF_HOME"] = str(scratch / "hf-home")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    # Modules that import a missing accelerator library fail to collect on both trees; run the rest.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={junit}", *paths]
    print(f"upstream[{label}]: {' '.join(paths)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    if not junit.exists():
        raise RuntimeError(f"upstream tests on {label} produced no report (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    run = UpstreamRun(label, _outcomes(junit))
    print(f"upstream[{label}]: {run.summary()}", file=sys.stderr, flush=True)
    return run


def compare(pristine: UpstreamRun, transformed: UpstreamRun) -> list[str]:
    """Test ids whose outcome differs between the trees (including ids present on one side only)."""
    ids = set(pristine.outcomes) | set(transformed.outcomes)
    return sorted(i for i in ids if pristine.outcomes.get(i) != transformed.outcomes.get(i))


def run_both(paths: tuple[str, ...], work: Path, timeout: int = 3600) -> tuple[UpstreamRun, UpstreamRun]:
    """Both trees at once (one pytest process each: two cores, half the wall time)."""
    from concurrent.futures import ThreadPoolExecutor

    scratch = scratch_copy(SDIST_ROOT, work / "scratch")
    tree = build_transformed_tree(work / "transformed")
    with ThreadPoolExecutor(max_workers=2) as pool:
        pristine = pool.submit(run_tree, "pristine", None, scratch, paths, timeout)
        transformed = pool.submit(run_tree, "transformed", tree, scratch, paths, timeout)
        return pristine.result(), transformed.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all of tests/v1/core and tests/v1/kv_connector/unit (slow)")
    parser.add_argument("--out", type=Path, help="write both runs' outcomes as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sparkcache-upstream-") as tmp:
        pristine, transformed = run_both(FULL if args.full else CI_SUBSET, Path(tmp), timeout=4 * 3600)
    differ = compare(pristine, transformed)
    if args.out:
        args.out.write_text(json.dumps({"pristine": pristine.outcomes, "transformed": transformed.outcomes, "differ": differ}, indent=1))
    print(f"pristine: {pristine.summary()}\ntransformed: {transformed.summary()}\ndiffering outcomes: {len(differ)}")
    for test_id in differ:
        print(f"  {test_id}: {pristine.outcomes.get(test_id)} -> {transformed.outcomes.get(test_id)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
