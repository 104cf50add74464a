"""The in-memory view of the manifests on disk: entries, a block-hash index, object refcounts.

Disk is the truth; ``refresh`` brings the view up to date with what this and other
processes published or evicted (it re-lists a manifest directory only when its mtime moved,
or when the mtime is too recent to trust). Byte accounting counts every referenced object
once, however many entries share it, in whole filesystem blocks.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

from .layout import MANIFEST_SUFFIX, StoreLayout, UnsafePathError, allocated, is_entry_id, \
    is_identity_digest, occupied
from .manifests import MAX_MANIFEST_BYTES, Manifest, ManifestError, decode
from .reasons import Reason

_RECENCY = " (last access)"  # the suffix of an unknown recency's key in ``unknown``
_MTIME_TRUST_S = 0.05  # directory mtimes newer than this may hide a change in the same tick


@dataclass
class IndexedEntry:
    manifest: Manifest
    path: str
    inode: int
    manifest_bytes: int
    last_access: float
    unique_pages: tuple = ()  # distinct PageRefs (pages and state), computed once

    def __post_init__(self) -> None:
        if not self.unique_pages:
            self.unique_pages = tuple({p.digest: p for p in self.manifest.objects}.values())

    @property
    def entry_id(self) -> str:
        return self.manifest.entry_id


@dataclass(frozen=True)
class BadManifest:
    entry_id: str
    identity_digest: str
    path: str
    reason: Reason
    detail: str
    inode: int


@dataclass
class _DirMark:
    mtime_ns: int
    names: dict[str, int] = field(default_factory=dict)  # entry id -> inode


class EntryIndex:
    def __init__(self, layout: StoreLayout, alloc_unit: int) -> None:
        self.layout = layout
        self.alloc_unit = alloc_unit
        self.entries: dict[str, IndexedEntry] = {}
        self.bad: dict[str, BadManifest] = {}
        self.blocks: dict[str, dict[str, tuple[int, set[str]]]] = {}
        self.ends: dict[str, dict[str, set[str]]] = {}  # identity -> last block key -> entries
        self.refcount: dict[str, int] = {}
        self.object_size: dict[str, int] = {}  # bytes each referenced object occupies on disk
        self.objects_bytes = 0
        self.manifests_bytes = 0
        # Objects of evicted entries, still on disk until maintenance deletes them: the
        # bytes they occupy.
        self.deferred: dict[str, int] = {}
        # Manifests of entries the collector dropped from the view and is unlinking: path ->
        # inode. A listing that still finds one must not read it back in (its objects would
        # stay referenced, then be left on disk once the file is gone).
        self.unlinking: dict[str, int] = {}
        # Files under manifests/ that are not manifests the store can read (links, FIFOs,
        # files where an identity directory belongs): path -> why. ``verify`` lists them.
        self.strays: dict[str, str] = {}
        # Paths whose state the last attempt could not learn (a listing or a read that failed
        # with EIO, EACCES, ENOMEM...): path -> why. Never taken for "gone" or "corrupt": what
        # was known of them stays, they are read again by every refresh, and while any is
        # here the view is not ``complete`` and nothing is deleted on its word.
        self.unknown: dict[str, str] = {}
        self._marks: dict[str, _DirMark] = {}

    # ------------------------------------------------------------------ accounting

    @property
    def complete(self) -> bool:
        """Whether every listing and manifest read of the last refreshes succeeded: only then
        does the view know every manifest, and may an object's deletion rest on it."""
        return not self.unknown

    @property
    def used_bytes(self) -> int:
        return self.objects_bytes + self.manifests_bytes + self.deferred_bytes()

    def deferred_bytes(self) -> int:
        """Bytes of evicted entries' objects not deleted yet (and not referenced again)."""
        return sum(size for d, size in self.deferred.items() if d not in self.refcount)

    def entry_free_bytes(self, entry: IndexedEntry, dropping: dict[str, int]) -> int:
        """Bytes evicting ``entry`` would free, given refs already dropped in ``dropping``."""
        freed = allocated(entry.manifest_bytes, self.alloc_unit)
        refcount = self.refcount
        for page in entry.unique_pages:
            dropped = dropping.get(page.digest, 0) + 1
            dropping[page.digest] = dropped
            if refcount.get(page.digest, 0) == dropped:
                freed += self.object_size.get(page.digest, 0)
        return freed

    def occupied(self, digest: str) -> int:
        """Bytes the object ``digest`` occupies on disk (allocated blocks, at most its size
        rounded up to whole blocks): 0 when it is missing or not a regular file. What a
        manifest declares is never counted (a bogus 10 TB page costs nothing)."""
        try:
            return occupied(self.layout.lstat(self.layout.object_path(digest)), self.alloc_unit)
        except (OSError, UnsafePathError):
            return 0

    # ------------------------------------------------------------------ mutation

    def add(self, entry: IndexedEntry) -> None:
        if entry.entry_id in self.entries:
            self.remove(entry.entry_id)
        self.bad.pop(entry.entry_id, None)
        m = entry.manifest
        self.entries[m.entry_id] = entry
        self.manifests_bytes += allocated(entry.manifest_bytes, self.alloc_unit)
        for page in entry.unique_pages:
            count = self.refcount.get(page.digest, 0)
            if count == 0 or not self.object_size.get(page.digest):
                # first reference, or one that was missing when an earlier entry named it
                size = self.occupied(page.digest)
                self.objects_bytes += size - self.object_size.get(page.digest, 0)
                self.object_size[page.digest] = size
            self.refcount[page.digest] = count + 1
        self.ends.setdefault(m.identity_digest, {}).setdefault(m.block_keys[-1], set()).add(m.entry_id)
        by_key = self.blocks.setdefault(m.identity_digest, {})
        for pos, key in enumerate(m.block_keys):
            slot = by_key.get(key)
            if slot is None:
                by_key[key] = (pos, {m.entry_id})
            elif slot[0] == pos:
                slot[1].add(m.entry_id)

    def remove(self, entry_id: str) -> list[str]:
        """Drop an entry from the view; returns digests no entry references any more."""
        entry = self.entries.pop(entry_id, None)
        if entry is None:
            return []
        m = entry.manifest
        self.manifests_bytes -= allocated(entry.manifest_bytes, self.alloc_unit)
        freed = []
        for page in entry.unique_pages:
            count = self.refcount.get(page.digest, 0) - 1
            if count <= 0:
                self.refcount.pop(page.digest, None)
                self.objects_bytes -= self.object_size.pop(page.digest, 0)
                freed.append(page.digest)
            else:
                self.refcount[page.digest] = count
        ends = self.ends.get(m.identity_digest, {})
        ending = ends.get(m.block_keys[-1])
        if ending is not None:
            ending.discard(entry_id)
            if not ending:
                del ends[m.block_keys[-1]]
        by_key = self.blocks.get(m.identity_digest, {})
        for key in m.block_keys:
            slot = by_key.get(key)
            if slot is not None:
                slot[1].discard(entry_id)
                if not slot[1]:
                    del by_key[key]
        return freed

    # ------------------------------------------------------------------ queries

    def entries_ending_within(self, identity_digest: str, keys: list[str]) -> list[str]:
        """Entries of this identity whose blocks are a proper prefix of ``keys`` and that hold
        no recurrent state (one that does is a resume point no longer entry holds)."""
        ends = self.ends.get(identity_digest)
        if not ends:
            return []
        out = []
        for pos, key in enumerate(keys[:-1]):
            for entry_id in ends.get(key, ()):
                entry = self.entries.get(entry_id)
                if (entry is not None and entry.manifest.block_count == pos + 1
                        and entry.manifest.state is None):
                    out.append(entry_id)
        return out

    def longest_match(self, identity_digest: str, keys: list[str], *,
                      with_state: bool = False) -> tuple[IndexedEntry | None, int]:
        """The entry holding the longest prefix of ``keys`` and that prefix's length in blocks.
        ``with_state``: only an entry that ends exactly there and holds the recurrent state
        at its end (a hybrid model resumes only where a state was taken)."""
        if with_state:
            return self._longest_with_state(identity_digest, keys)
        by_key = self.blocks.get(identity_digest)
        if not by_key:
            return None, 0
        for k in range(len(keys), 0, -1):
            slot = by_key.get(keys[k - 1])
            if slot is None or slot[0] != k - 1:
                continue
            candidates = sorted((self.entries[e] for e in slot[1] if e in self.entries),
                                key=lambda e: (e.manifest.block_count, e.last_access), reverse=True)
            for entry in candidates:
                if list(entry.manifest.block_keys[:k]) == keys[:k]:
                    return entry, k
        return None, 0

    def _longest_with_state(self, identity_digest: str, keys: list[str]) -> tuple[IndexedEntry | None, int]:
        ends = self.ends.get(identity_digest)
        if not ends:
            return None, 0
        for k in range(len(keys), 0, -1):
            candidates = sorted((self.entries[e] for e in ends.get(keys[k - 1], ()) if e in self.entries),
                                key=lambda e: e.last_access, reverse=True)
            for entry in candidates:
                m = entry.manifest
                if m.state is not None and m.block_count == k and list(m.block_keys) == keys[:k]:
                    return entry, k
        return None, 0

    # ------------------------------------------------------------------ sync with disk

    def refresh(self, force: bool = False) -> None:
        top = self.layout.manifests_dir
        try:
            found = self.layout.scandir_files(top)
            self.strays.clear()  # found again below while they are still there
        except UnsafePathError as exc:  # a link or a file in its place: no manifests are there
            found = []
            self.strays.clear()
            self.strays[top] = f"cannot list manifests: {exc}"
        except OSError as exc:  # not known: nothing is dropped on its word
            self.unknown[top] = f"cannot list manifests (retried): {exc}"
            return
        self.unknown.pop(top, None)
        dirs: dict[str, int] = {}  # identity -> its directory's mtime
        for name, st in found:
            path = os.path.join(self.layout.manifests_dir, name)
            if is_identity_digest(name) and stat.S_ISDIR(st.st_mode):
                dirs[name] = st.st_mtime_ns
                self.strays.pop(path, None)
            else:
                self.strays[path] = ("not an identity directory of manifests (a link, a file "
                                     "or a stray name); the store ignores it: remove it")
        for gone in set(self._marks) - set(dirs):
            for entry_id in list(self._marks.pop(gone).names):
                self.remove(entry_id)
                self.bad.pop(entry_id, None)
            self._forget_unknown_under(self.layout.identity_dir(gone))
        for idd, mtime_ns in dirs.items():
            if force or not self._unchanged(idd, mtime_ns) or self._unknown_under(idd):
                self._refresh_dir(idd, force)

    def _unchanged(self, idd: str, mtime_ns: int) -> bool:
        """Whether the identity directory's mtime (old enough to trust) is the one its last
        listing saw: then nothing was published or removed in it since."""
        mark = self._marks.get(idd)
        settled = time.time() - mtime_ns / 1e9 > _MTIME_TRUST_S
        return mark is not None and settled and mark.mtime_ns == mtime_ns

    def _refresh_dir(self, idd: str, force: bool) -> None:
        path = self.layout.identity_dir(idd)
        try:
            with self.layout.open_dir(path) as d:
                listing = self._changed_listing(idd, d.fd, force)
        except FileNotFoundError:
            return
        except UnsafePathError as exc:
            self.strays[path] = f"cannot list: {exc}"
            return
        except OSError as exc:  # not known: what the view holds of it stays
            self.unknown[path] = f"cannot list (retried): {exc}"
            return
        self.unknown.pop(path, None)
        if listing is None:
            return
        mark = self._marks[idd]
        seen: dict[str, int] = {}
        for name, inode in listing:
            if not name.endswith(MANIFEST_SUFFIX):
                continue  # temp files never live here; anything else is ignored
            entry_id = name[: -len(MANIFEST_SUFFIX)]
            if is_entry_id(entry_id):
                seen[entry_id] = inode
        for entry_id in set(mark.names) - set(seen):
            self.remove(entry_id)
            self.bad.pop(entry_id, None)
            self.unknown.pop(self.layout.manifest_path(idd, entry_id), None)
        for entry_id in [p for p in self.unknown if p.startswith(path + os.sep)]:
            if os.path.basename(entry_id)[: -len(MANIFEST_SUFFIX)] not in seen:
                del self.unknown[entry_id]  # listed, and no longer there
        for entry_id, inode in seen.items():
            known = self.entries.get(entry_id)
            if (known is not None and known.inode == inode
                    and self.layout.manifest_path(idd, entry_id) not in self.unknown):
                continue
            if self.unlinking and self.unlinking.get(self.layout.manifest_path(idd, entry_id)) == inode:
                continue
            bad = self.bad.get(entry_id)
            if bad is not None and bad.inode == inode:
                continue
            self.load(idd, entry_id)
        mark.names = {e: i for e, i in seen.items() if e in self.entries or e in self.bad
                      or self.layout.manifest_path(idd, e) in self.unknown}

    def _changed_listing(self, idd: str, fd: int, force: bool) -> list[tuple[str, int]] | None:
        """(name, inode) of the identity directory open at ``fd``; None when its mtime says
        nothing changed since the last listing (and the mtime is old enough to trust)."""
        st = os.fstat(fd)
        if not force and self._unchanged(idd, st.st_mtime_ns):
            return None
        mark = self._marks.get(idd)
        settled = time.time() - st.st_mtime_ns / 1e9 > _MTIME_TRUST_S
        if mark is None:
            mark = self._marks[idd] = _DirMark(st.st_mtime_ns)
        # Record the mtime seen *before* listing: a change during the listing moves it again.
        mark.mtime_ns = st.st_mtime_ns if settled else -1
        with os.scandir(fd) as it:  # inodes from the directory itself, no stat per file
            return [(e.name, e.inode()) for e in it]

    def load(self, idd: str, entry_id: str) -> IndexedEntry | None:
        """(Re)read one manifest file into the view. One the store knows to be bad is
        recorded in ``self.bad`` (a link, a FIFO, a directory, an oversized file, or a body
        that does not decode); one that could not be read (EIO, EACCES, ...) is ``unknown``:
        what the view held of it stays, and the next refresh reads it again. Never raises."""
        path = self.layout.manifest_path(idd, entry_id)
        try:
            fd = self.layout.open_file(path, os.O_RDONLY)
        except FileNotFoundError:
            self.remove(entry_id)
            self.unknown.pop(path, None)
            return None
        except UnsafePathError as exc:
            self._mark_bad(entry_id, idd, path, Reason.CORRUPT, str(exc),
                           _lstat_inode(self.layout, path))
            return None
        except OSError as exc:
            self._mark_unknown(idd, entry_id, path, f"cannot open: {exc}")
            return None
        try:
            st = os.fstat(fd)
            if st.st_size > MAX_MANIFEST_BYTES:
                self._mark_bad(entry_id, idd, path, Reason.CORRUPT, f"{st.st_size} bytes, more than "
                               f"a manifest can hold ({MAX_MANIFEST_BYTES})", st.st_ino)
                return None
            data = _read_all(fd, st.st_size)
        except OSError as exc:
            self._mark_unknown(idd, entry_id, path, f"cannot read: {exc}")
            return None
        finally:
            os.close(fd)
        self.unknown.pop(path, None)
        try:
            manifest = decode(data, expected_entry_id=entry_id, expected_identity_digest=idd)
        except ManifestError as exc:
            self._mark_bad(entry_id, idd, path, Reason.CORRUPT, f"{exc.reason}: {exc.detail}", st.st_ino)
            return None
        entry = IndexedEntry(manifest, path, st.st_ino, len(data), st.st_mtime)
        self.add(entry)
        mark = self._marks.setdefault(idd, _DirMark(-1))
        mark.names[entry_id] = st.st_ino
        return entry

    def _mark_unknown(self, idd: str, entry_id: str, path: str, detail: str) -> None:
        self.unknown[path] = f"{detail} (retried by every refresh; nothing it names is deleted meanwhile)"
        self._marks.setdefault(idd, _DirMark(-1)).names.setdefault(entry_id, -1)

    def _unknown_under(self, idd: str) -> bool:
        prefix = self.layout.identity_dir(idd)
        return any(p == prefix or p.startswith(prefix + os.sep) for p in self.unknown)

    def _forget_unknown_under(self, prefix: str) -> None:
        for p in [p for p in self.unknown if p == prefix or p.startswith(prefix + os.sep)]:
            del self.unknown[p]

    def _mark_bad(self, entry_id: str, idd: str, path: str, reason: Reason, detail: str,
                  inode: int) -> None:
        self.remove(entry_id)
        self.bad[entry_id] = BadManifest(entry_id, idd, path, reason, detail, inode)
        self._marks.setdefault(idd, _DirMark(-1)).names[entry_id] = inode

    def refresh_recency(self) -> None:
        """Re-read last-access times (manifest mtimes), which other processes may have
        touched. One that cannot be read makes the view incomplete (an eviction must not
        rest on an old time) until it is read again."""
        for entry in self.entries.values():
            try:
                entry.last_access = self.layout.lstat(entry.path).st_mtime
                self.unknown.pop(entry.path + _RECENCY, None)
            except (FileNotFoundError, UnsafePathError):
                pass  # gone or replaced: the next listing says so
            except OSError as exc:
                self.unknown[entry.path + _RECENCY] = f"cannot read its last access: {exc}"


def _read_all(fd: int, size: int) -> bytes:
    chunks, got = [], 0
    while got <= size:  # one read past the size sees a file that grew meanwhile
        chunk = os.read(fd, size + 1 - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _lstat_inode(layout: StoreLayout, path: str) -> int:
    try:
        return layout.lstat(path).st_ino
    except (OSError, UnsafePathError):
        return -1
