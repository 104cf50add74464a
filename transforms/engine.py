"""The transform engine: lock, preimage/postimage hashes, apply / check / diff.

The lock (``vllm-0.32.0.lock.json`` beside this file) records the sdist the
tree comes from and, for every target file, its preimage and postimage
sha256 and the transforms that touch it, in their fixed order. Nothing is
written unless every target verifies: a tree is transformed whole or not at
all.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from transforms import Transform, all_transforms
from transforms.edits import Edit, EditError, apply_file

LOCK_PATH = Path(__file__).with_name("vllm-0.32.0.lock.json")

FileState = Literal["preimage", "postimage", "drifted", "missing"]


class TransformError(Exception):
    """The tree cannot be transformed as the lock requires; the message says why and what to do."""


@dataclass(frozen=True)
class LockedFile:
    path: str
    preimage_sha256: str
    postimage_sha256: str
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    vllm_version: str
    sdist: dict
    transform_order: tuple[str, ...]
    files: tuple[LockedFile, ...]

    @property
    def sha256(self) -> str:
        return sha256_bytes(LOCK_PATH.read_bytes())


@dataclass(frozen=True)
class FileStatus:
    path: str
    state: FileState
    expected: str  # the hash the lock expects for this state's comparison
    found: str | None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_lock(path: Path = LOCK_PATH) -> Lock:
    raw = json.loads(path.read_text())
    return Lock(
        vllm_version=raw["vllm_version"],
        sdist=raw["sdist"],
        transform_order=tuple(raw["transform_order"]),
        files=tuple(
            LockedFile(f["path"], f["preimage_sha256"], f["postimage_sha256"], tuple(f["transforms"]))
            for f in raw["files"]
        ),
    )


def _transforms_in_lock_order(lock: Lock) -> list[Transform]:
    by_id = {t.id: t for t in all_transforms()}
    code_order = tuple(by_id)
    if code_order != lock.transform_order:
        raise TransformError(
            f"{LOCK_PATH}: transform_order {list(lock.transform_order)} does not match the code's "
            f"{list(code_order)}; regenerate the lock with `python -m transforms lock --tree PRISTINE_TREE`"
        )
    return [by_id[i] for i in lock.transform_order]


def _groups(relpath: str, transforms: Iterable[Transform]) -> list[tuple[str, tuple[Edit, ...]]]:
    return [(f"{relpath} [{t.id}]", t.edits[relpath]) for t in transforms if t.edits.get(relpath)]


def _transform_checked(relpath: str, source: str, transforms: list[Transform]) -> str:
    """Every transform's edits for relpath, in order, in one parse; refused unless a second pass would change nothing."""
    try:
        return apply_file(source, _groups(relpath, transforms))
    except EditError as exc:
        raise TransformError(str(exc)) from None


def file_statuses(tree: Path, lock: Lock) -> list[FileStatus]:
    statuses = []
    for f in lock.files:
        target = tree / f.path
        if not target.is_file():
            statuses.append(FileStatus(f.path, "missing", f.preimage_sha256, None))
            continue
        found = sha256_bytes(target.read_bytes())
        if found == f.postimage_sha256:
            state: FileState = "postimage"
        elif found == f.preimage_sha256:
            state = "preimage"
        else:
            state = "drifted"
        statuses.append(FileStatus(f.path, state, f.postimage_sha256, found))
    return statuses


def _describe_drift(s: FileStatus, lock: Lock) -> str:
    locked = next(f for f in lock.files if f.path == s.path)
    if s.state == "missing":
        return f"{s.path}: missing (expected preimage {locked.preimage_sha256})"
    return (
        f"{s.path}: sha256 {s.found} is neither the preimage {locked.preimage_sha256} "
        f"nor the postimage {locked.postimage_sha256} (not vLLM {lock.vllm_version}, or edited by hand)"
    )


def _write_atomic(path: Path, data: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class ApplyResult:
    changed: tuple[str, ...]
    already: tuple[str, ...]
    manifest: dict


def plan(tree: Path, lock: Lock | None = None) -> dict[str, tuple[str, str]]:
    """Verify every preimage and compute every postimage; {relpath: (before, after)}.

    Files already at their postimage are returned with before == after.
    Raises TransformError naming every drifted file.
    """
    lock = lock or load_lock()
    transforms = _transforms_in_lock_order(lock)
    statuses = file_statuses(tree, lock)
    bad = [s for s in statuses if s.state in ("drifted", "missing")]
    if bad:
        raise TransformError("refusing to transform " + str(tree) + ":\n  " + "\n  ".join(_describe_drift(s, lock) for s in bad))
    result = {}
    for s, f in zip(statuses, lock.files):
        before = (tree / f.path).read_text()
        if s.state == "postimage":
            result[f.path] = (before, before)
            continue
        after = _transform_checked(f.path, before, transforms)
        got = sha256_bytes(after.encode())
        if got != f.postimage_sha256:
            raise TransformError(
                f"{f.path}: transformed sha256 {got} does not match the lock's postimage {f.postimage_sha256}; "
                "if the transform changed on purpose, regenerate the lock with `python -m transforms lock --tree PRISTINE_TREE`"
            )
        result[f.path] = (before, after)
    return result


def apply(tree: Path, manifest_path: Path | None = None) -> ApplyResult:
    lock = load_lock()
    planned = plan(tree, lock)
    changed, already = [], []
    for relpath, (before, after) in planned.items():
        if before == after:
            already.append(relpath)
        else:
            _write_atomic(tree / relpath, after)
            changed.append(relpath)
    manifest = build_manifest(lock)
    if manifest_path is not None:
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return ApplyResult(tuple(changed), tuple(already), manifest)


def build_manifest(lock: Lock) -> dict:
    return {
        "vllm_version": lock.vllm_version,
        "lock_sha256": lock.sha256,
        "transform_order": list(lock.transform_order),
        "files": [
            {"file": f.path, "pre": f.preimage_sha256, "post": f.postimage_sha256, "transforms": list(f.transforms)}
            for f in lock.files
        ],
    }


def diff(tree: Path) -> str:
    out = []
    for relpath, (before, after) in plan(tree).items():
        out.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{relpath}", f"b/{relpath}"
            )
        )
    return "".join(out)


def write_lock(pristine_tree: Path, sdist: dict, vllm_version: str) -> Lock:
    """Maintainers' command: record pre/post hashes from a pristine tree."""
    transforms = list(all_transforms())
    targets = sorted({p for t in transforms for p in t.edits})
    files = []
    for relpath in targets:
        before = (pristine_tree / relpath).read_text()
        after = _transform_checked(relpath, before, transforms)
        files.append(
            {
                "path": relpath,
                "preimage_sha256": sha256_bytes(before.encode()),
                "postimage_sha256": sha256_bytes(after.encode()),
                "transforms": [t.id for t in transforms if relpath in t.edits],
            }
        )
    raw = {
        "vllm_version": vllm_version,
        "sdist": sdist,
        "transform_order": [t.id for t in transforms],
        "files": files,
    }
    LOCK_PATH.write_text(json.dumps(raw, indent=2) + "\n")
    return load_lock()
