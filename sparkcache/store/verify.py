"""Full integrity sweep of one store: every manifest decoded, every referenced object
re-hashed, every file under objects/ checked to be a regular file. Read-only."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .index import EntryIndex
from .layout import StoreLayout
from .objects import ObjectError, ObjectStore


@dataclass(frozen=True)
class Problem:
    """One bad file and the entries it breaks."""

    kind: str  # corrupt_manifest | corrupt_object | absent_object | unsafe_file
    path: str
    detail: str
    entries: tuple[str, ...]


@dataclass(frozen=True)
class VerifyReport:
    entries_checked: int
    objects_checked: int
    bytes_checked: int
    orphan_objects: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(layout: StoreLayout) -> VerifyReport:
    index = EntryIndex(layout, os.statvfs(layout.base).f_frsize or 4096)
    index.refresh(force=True)
    objects = ObjectStore(layout)
    problems: list[Problem] = []
    for bad in sorted(index.bad.values(), key=lambda b: b.path):
        problems.append(Problem("corrupt_manifest", bad.path, bad.detail, (bad.entry_id,)))
    users: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for entry in index.entries.values():
        for page in entry.manifest.pages:
            users.setdefault(page.digest, []).append(entry.entry_id)
            sizes[page.digest] = page.size
    checked = bytes_checked = 0
    for digest in sorted(users):
        try:
            objects.read_verified(digest, sizes[digest])
            checked += 1
            bytes_checked += sizes[digest]
        except ObjectError as exc:
            problems.append(Problem(f"{exc.reason}_object", objects.path(digest), exc.detail,
                                    tuple(sorted(set(users[digest])))))
    orphans = 0
    for shard in sorted(os.listdir(layout.objects_dir)):
        shard_path = os.path.join(layout.objects_dir, shard)
        if os.path.islink(shard_path) or not os.path.isdir(shard_path):
            problems.append(Problem("unsafe_file", shard_path, "not a plain shard directory "
                                    "(symlink or file); remove it", ()))
            continue
        for name in sorted(os.listdir(shard_path)):
            path = os.path.join(shard_path, name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                if shard + name not in users:  # referenced ones are already reported
                    problems.append(Problem("unsafe_file", path, "not a regular file (symlink?); "
                                            "the store never follows symlinks: remove it", ()))
            elif shard + name not in users:
                orphans += 1
    return VerifyReport(len(index.entries) + len(index.bad), checked, bytes_checked, orphans,
                        tuple(problems))


__all__ = ["Problem", "VerifyReport", "verify_store"]
