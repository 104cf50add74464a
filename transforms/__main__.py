"""python -m transforms {fetch,apply,check,diff,lock}: the source-transform engine.

Exit codes of ``check``: 0 every target at its postimage, 3 every target at
its preimage (not applied yet), 1 anything else (each drifted file named).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transforms import engine
from transforms.engine import TransformError

EXIT_APPLIED, EXIT_DRIFT, EXIT_PRISTINE = 0, 1, 3


def _cmd_fetch(args: argparse.Namespace) -> int:
    from transforms.sdist import fetch

    root = fetch(args.dest, args.archive)
    print(root)
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    result = engine.apply(args.tree, args.manifest)
    for path in result.changed:
        print(f"transformed {path}", file=sys.stderr)
    for path in result.already:
        print(f"already transformed {path}", file=sys.stderr)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    lock = engine.load_lock()
    statuses = engine.file_statuses(args.tree, lock)
    states = {s.state for s in statuses}
    if states == {"postimage"}:
        print(f"{args.tree}: all {len(statuses)} target files transformed")
        return EXIT_APPLIED
    if states == {"preimage"}:
        print(f"{args.tree}: all {len(statuses)} target files pristine (not transformed)")
        return EXIT_PRISTINE
    for s in statuses:
        locked = next(f for f in lock.files if f.path == s.path)
        if s.state in ("drifted", "missing"):
            print(
                f"drift: {s.path}: found {s.found or 'nothing'}, expected preimage {locked.preimage_sha256} "
                f"or postimage {locked.postimage_sha256}",
                file=sys.stderr,
            )
        else:
            print(f"{s.state}: {s.path}", file=sys.stderr)
    print("fix: start again from the pinned sdist (`python -m transforms fetch`) or a fresh vLLM install, then apply", file=sys.stderr)
    return EXIT_DRIFT


def _cmd_diff(args: argparse.Namespace) -> int:
    sys.stdout.write(engine.diff(args.tree))
    return 0


def _cmd_lock(args: argparse.Namespace) -> int:
    old = engine.load_lock()
    lock = engine.write_lock(args.tree, old.sdist, old.vllm_version)
    for f in lock.files:
        print(f"{f.path} pre={f.preimage_sha256[:12]} post={f.postimage_sha256[:12]} {','.join(f.transforms)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m transforms", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download, verify (sha256) and unpack the pinned vLLM sdist")
    p.add_argument("--dest", type=Path, required=True, help="directory to unpack into; prints the unpacked root")
    p.add_argument("--archive", type=Path, help="use this already-downloaded archive (still sha256-checked)")
    p.set_defaults(func=_cmd_fetch)

    tree_help = "root that contains the vllm/ package (an sdist root or a site-packages directory)"
    p = sub.add_parser("apply", help="verify preimages, transform, verify postimages, write files")
    p.add_argument("--tree", type=Path, required=True, help=tree_help)
    p.add_argument("--manifest", type=Path, help="write a JSON manifest (file, pre, post, transforms) here")
    p.set_defaults(func=_cmd_apply)

    p = sub.add_parser("check", help="exit 0 if transformed, 3 if pristine, 1 on drift; writes nothing")
    p.add_argument("--tree", type=Path, required=True, help=tree_help)
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("diff", help="print the unified diff the transforms would make")
    p.add_argument("--tree", type=Path, required=True, help=tree_help)
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("lock", help="maintainers: recompute the lock's pre/post hashes from a pristine tree")
    p.add_argument("--tree", type=Path, required=True, help="a pristine tree (the unpacked sdist)")
    p.set_defaults(func=_cmd_lock)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TransformError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DRIFT


if __name__ == "__main__":
    sys.exit(main())
