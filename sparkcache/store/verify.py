"""Full integrity sweep of one store: every manifest read whole and checked against its
header's checksum (and decoded, unless the store's snapshot holds the body that checksum
names), every referenced object re-hashed (its BLAKE3 against its name, its XXH3-128 against
what each manifest records), every file under objects/ checked to be a regular file. Read-only.
The objects are reached through the local object backend (``objects.LocalBackend``: its
``check_all`` and ``survey``), never by their files."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .backend import ObjectError
from .index import EntryIndex
from .layout import StoreLayout, UnsafePathError, file_kind
from .objects import LocalBackend
from .pins import PIN_SUFFIX, read_pin


@dataclass(frozen=True)
class Problem:
    """One bad file and the entries it breaks."""

    kind: str  # corrupt_manifest | {corrupt,absent,io_error}_object | unsafe_file | corrupt_pin | unreadable
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


def verify_store(layout: StoreLayout, objects: LocalBackend | None = None) -> VerifyReport:
    """The sweep of the store at ``layout``, its objects through ``objects`` (by default the
    local backend on its filesystem)."""
    unit = os.statvfs(layout.base).f_frsize or 4096
    objects = objects or LocalBackend(layout, unit)
    index = EntryIndex(layout, unit, objects=objects, whole_bodies=True)  # every byte of every manifest checked
    index.refresh(full=True)
    problems: list[Problem] = []
    for bad in sorted(index.bad.values(), key=lambda b: b.path):
        problems.append(Problem("corrupt_manifest", bad.path, bad.detail, (bad.entry_id,)))
    for path, detail in sorted(index.strays.items()):
        problems.append(Problem("unsafe_file", path, detail, ()))
    for path, detail in sorted(index.unknown.items()):
        problems.append(Problem("unreadable", path, f"{detail}: the store deletes nothing while it "
                                "cannot read it; check the disk and the file's permissions", ()))
    users: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    recorded: dict[str, list[tuple[str, str, str]]] = {}  # digest -> (checksum, manifest, entry) recorded
    for entry in index.entries.values():
        for page in entry.manifest.objects:
            users.setdefault(page.digest, []).append(entry.entry_id)
            sizes[page.digest] = page.size
            if page.checksum is not None:
                recorded.setdefault(page.digest, []).append((page.checksum, entry.path, entry.entry_id))
    checked = bytes_checked = 0
    for digest, actual in objects.check_all(sizes):
        if isinstance(actual, ObjectError):
            problems.append(Problem(f"{actual.reason}_object", objects.path(digest), actual.detail,
                                    tuple(sorted(set(users[digest])))))
            continue
        checked += 1
        bytes_checked += sizes[digest]
        for checksum, path, entry_id in recorded.get(digest, ()):
            if checksum != actual:
                problems.append(Problem(
                    "corrupt_manifest", path, f"records XXH3-128 {checksum} for object {digest}, "
                    f"whose bytes hash to {actual}: a restore refuses the entry; delete the "
                    "manifest (the next publication writes it anew)", (entry_id,)))
    survey = objects.survey(set(users))
    problems += [Problem("unsafe_file", path, detail, ()) for path, detail in survey.unsafe]
    _check_small_files(layout, problems)
    return VerifyReport(len(index.entries) + len(index.bad), checked, bytes_checked, survey.orphans,
                        tuple(problems))


def _check_small_files(layout: StoreLayout, problems: list[Problem]) -> None:
    """Staging, pins and the lock: anything but a regular file (a directory where a file
    belongs, a link, a FIFO) and pins that do not hold an expiry."""
    for name, kind in _listing(layout, layout.staging_dir, problems):
        if kind != "file":
            problems.append(Problem("unsafe_file", os.path.join(layout.staging_dir, name),
                                    f"a {kind} in staging, where the store writes only regular "
                                    "files: remove it", ()))
    for name, kind in _listing(layout, layout.pins_dir, problems):
        path = os.path.join(layout.pins_dir, name)
        if kind != "file":
            problems.append(Problem("unsafe_file", path, f"a {kind} where pins are regular "
                                    "files: remove it", ()))
        elif name.endswith(PIN_SUFFIX):
            try:
                pin = read_pin(layout, name)
            except OSError as exc:
                problems.append(Problem("unreadable", path, f"cannot be read ({exc}); maintenance "
                                        "keeps its entry until it can: check the disk", ()))
                continue
            if pin is None:
                problems.append(Problem("corrupt_pin", path, "does not hold a lease; it protects "
                                        "nothing and maintenance removes it", ()))
    for name, kind in _listing(layout, layout.locks_dir, problems):
        if kind != "file":
            problems.append(Problem("unsafe_file", os.path.join(layout.locks_dir, name),
                                    f"a {kind} where the lock file belongs: remove it", ()))


def _listing(layout: StoreLayout, path: str, problems: list[Problem]) -> list[tuple[str, str]]:
    """(name, kind) of a store directory's entries, sorted; an unlistable directory (a link
    or a file in its place, an I/O error) is a problem and lists as empty."""
    try:
        found = layout.scandir_files(path)
    except (OSError, UnsafePathError) as exc:
        problems.append(Problem("unsafe_file", path, f"cannot be listed safely: {exc}", ()))
        return []
    return sorted((name, file_kind(st.st_mode)) for name, st in found)


__all__ = ["Problem", "VerifyReport", "verify_store"]
