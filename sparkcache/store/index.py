"""The in-memory view of the manifests on disk: entries, a block-key index, object refcounts,
recency and the tensor-parallel units of the entries.

Disk is the truth. Opening a store lists every manifest (``refresh(full=True)``); from then on
``refresh`` reads the journal (``journal.py``): one ``fstat`` when nothing changed, and for
each new record the one manifest it names, so a lookup costs the same with 100 or 100,000
entries. A record that asks for it (``r``: a publisher died mid-way) makes the next
``complete`` refresh list every manifest again. Byte accounting counts every referenced
object once, however many entries share it, in whole filesystem blocks.

What a refresh could not learn (a listing, a manifest, the journal or a last access that
failed with EIO, EACCES, ENOMEM...) is ``unknown``: what the view held of it stays, it is
read again by the next refreshes, and while anything is unknown the view is not ``complete``
and nothing is deleted on its word (``collector.py``). Only a file the store knows to be bad
(a link, a FIFO, a directory, an oversized file, a body that does not decode, a manifest that
declares more than the store's cap allows: ``ManifestLimits``) is ``bad``.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import heapq
import itertools
import os
import stat
import time
from dataclasses import dataclass, field

from .backend import ObjectBackend
from .identity import Identity
from .journal import Journal, JournalError, Op, Record
from .layout import MANIFEST_SUFFIX, StoreLayout, UnsafePathError, allocated, close_quietly, \
    is_entry_id, is_identity_digest, open_regular_at
from .manifests import (HEADER_BYTES, MAX_MANIFEST_BYTES, Manifest, ManifestError, body_matches,
                        decode, header_checksum)
from .reasons import Reason
from .snapshot import Snapshot, read as read_snapshot
from .strides import STRIDE, deepest_indexed, indexed_positions

_RECENCY = " (last access)"  # the suffix of an unknown recency's key in ``unknown``
# A manifest may declare at most this many blocks (4M tokens at 16 per block; the in-memory
# index costs a few hundred bytes per block key, in every process that opens the store).
MAX_ENTRY_KEYS = 1 << 18
_RETRIES_PER_LOOKUP = 4  # unreadable manifests (and unlistable directories) a lookup retries
RECENCY_SWEEP = 256  # last accesses a complete refresh re-reads from disk, round-robin


@dataclass(frozen=True)
class ManifestLimits:
    """What one manifest may declare, from the store's cap: an entry larger than the store,
    or of more objects than the store can hold, was not written by a writer of this store."""

    max_bytes: int  # its objects' declared bytes (pages and state)
    max_objects: int  # each occupies at least one allocation unit
    max_keys: int = MAX_ENTRY_KEYS

    @classmethod
    def for_store(cls, max_bytes: int, alloc_unit: int) -> "ManifestLimits":
        return cls(max_bytes, max(1, max_bytes // max(1, alloc_unit)))

    def refusal(self, m: Manifest) -> str | None:
        """Why ``m`` declares more than this store can hold, or None."""
        return self.refusal_of(len(m.objects), sum(p.size for p in m.objects), m.block_count)

    def refusal_of(self, objects: int, declared_bytes: int, blocks: int) -> str | None:
        """Why an entry of ``objects`` objects of ``declared_bytes`` bytes in all, holding
        ``blocks`` blocks, is more than this store can hold, or None."""
        if declared_bytes > self.max_bytes:
            return (f"an entry of {declared_bytes} bytes is larger than the store's cap "
                    f"({self.max_bytes}, SPARKCACHE_MAX_BYTES)")
        if objects > self.max_objects:
            return f"{objects} objects are more than the store's cap can hold ({self.max_objects})"
        if blocks > self.max_keys:
            return f"{blocks} blocks are more than an entry may hold ({self.max_keys})"
        return None


@dataclass(eq=False)
class IndexedEntry:
    manifest: Manifest
    path: str
    inode: int
    manifest_bytes: int
    last_access: float
    unique_pages: tuple = ()  # distinct PageRefs (pages and state), computed once
    unit_key: tuple = ()  # the shards of one entry that tensor-parallel ranks publish share it
    lru_seq: int = 0  # its current item in the recency heap
    checksum: str = ""  # its manifest's header checksum (what a snapshot records)

    def __post_init__(self) -> None:
        if not self.unique_pages:
            objects = self.manifest.objects
            self.unique_pages = objects if len(objects) == 1 else \
                tuple({p.digest: p for p in objects}.values())

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
    names: dict[str, int] = field(default_factory=dict)  # entry id -> inode, as last listed


class EntryIndex:
    def __init__(self, layout: StoreLayout, alloc_unit: int,
                 limits: ManifestLimits | None = None, *, objects: ObjectBackend,
                 whole_bodies: bool = False) -> None:
        """``objects``: the backend asked what bytes each referenced object occupies (its batch
        ``exists``). ``whole_bodies`` (``verify``): with a snapshot, every manifest is still read whole
        and its body checked against its header's checksum (any damaged byte is found; only
        the decoding of a body the snapshot decoded is saved)."""
        self.layout = layout
        self.alloc_unit = alloc_unit
        self.objects = objects
        self.limits = limits
        self.whole_bodies = whole_bodies
        self.journal = Journal(layout)
        self.entries: dict[str, IndexedEntry] = {}
        self.bad: dict[str, BadManifest] = {}
        # identity -> block key -> (its position, the entry holding it, or a set of several), for
        # the keys at the positions ``indexed_positions`` names (the first, then every STRIDE-th)
        self.blocks: dict[str, dict[str, tuple[int, str | set[str]]]] = {}
        self.ends: dict[str, dict[str, set[str]]] = {}  # identity -> last block key -> entries
        self.units: dict[tuple, set[str]] = {}  # unit key -> its shards' entry ids
        self.refcount: dict[str, int] = {}
        self.object_size: dict[str, int] = {}  # bytes each referenced object occupies on disk
        self.objects_bytes = 0
        self.manifests_bytes = 0
        # Objects of evicted entries, still on disk until maintenance deletes them: the
        # bytes they occupy.
        self.deferred: dict[str, int] = {}
        # Manifests of entries the collector dropped from the view and is unlinking: path ->
        # inode. A listing or record that still finds one must not read it back in (its
        # objects would stay referenced, then be left on disk once the file is gone).
        self.unlinking: dict[str, int] = {}
        # Files under manifests/ that are not manifests the store can read (links, FIFOs,
        # files where an identity directory belongs): path -> why. ``verify`` lists them.
        self.strays: dict[str, str] = {}
        # Paths whose state the last attempt could not learn: path -> why (see the module
        # docstring). Never taken for "gone" or "corrupt".
        self.unknown: dict[str, str] = {}
        self._marks: dict[str, _DirMark] = {}
        self._ever_listed = False  # a full listing was made (opening the store)
        self._listed = False  # it succeeded, the journal was read since, and no record asked for another
        self._lru: list[tuple[float, int, str]] = []  # (last access, seq, entry id), lazily pruned
        self._seq = itertools.count(1)
        self._recency_cursor: list[str] = []  # entries whose last access the next sweeps re-read
        self._recency_changed: set[str] = set()  # last accesses read from disk since taken
        self._pending: collections.deque[Record] = collections.deque()  # read, not applied yet
        self.touched: set[str] = set()  # entries this process touched since the last records
        self._rank0: dict[str, str] = {}  # identity digest -> its digest at tp_rank 0
        # During a full listing: the objects whose bytes the backend is asked at its end, in
        # one batch (each shard's directory opened once), and the store's snapshot, if it has
        # one (``snapshot.py``), which says them for most.
        self._unsized: set[str] | None = None
        self._snapshot: Snapshot | None = None

    @property
    def complete(self) -> bool:
        """Whether the view knows every manifest: a full listing and every journal record since
        were read, and nothing is unknown. Only then may an object's deletion rest on it."""
        return self._listed and not self.unknown and not self._pending

    # ------------------------------------------------------------------ accounting

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

    def _count_sizes(self, digests: list[str]) -> None:
        """Count the bytes the objects ``digests`` occupy on the backend (``ObjectStat``'s
        ``stored_bytes``: on disk, allocated blocks, at most the size rounded up to whole
        blocks), 0 for one missing or not a regular file: from the snapshot when it says, else
        from the backend (during a full listing, at its end). What a manifest declares is never
        counted (a bogus 10 TB page costs nothing)."""
        ask = []
        for digest in digests:
            known = self._snapshot.sizes.get(digest) if self._snapshot is not None else None
            if known:
                self._set_size(digest, known)
            elif self._unsized is not None:
                self._unsized.add(digest)
            else:
                ask.append(digest)
        if ask:
            self._ask_sizes(ask)

    def _ask_sizes(self, digests: list[str]) -> None:
        """``_count_sizes`` from the backend's batch ``exists``; when it fails, each object is
        asked alone, and one that cannot be learned counts 0."""
        try:
            held = self.objects.exists(digests)
        except (OSError, UnsafePathError):
            held = {}
            for digest in digests:
                try:
                    held.update(self.objects.exists((digest,)))
                except (OSError, UnsafePathError):
                    continue
        for digest in digests:
            if digest in self.refcount:  # still referenced (an entry may have left meanwhile)
                found = held.get(digest)
                self._set_size(digest, found.stored_bytes if found is not None else 0)

    def _set_size(self, digest: str, size: int) -> None:
        self.objects_bytes += size - self.object_size.get(digest, 0)
        self.object_size[digest] = size

    # ------------------------------------------------------------------ mutation

    def add(self, entry: IndexedEntry) -> None:
        m = entry.manifest
        eid = m.entry_id
        if eid in self.entries:
            self.remove(eid)
        self.bad.pop(eid, None)
        self.entries[eid] = entry
        self.manifests_bytes += allocated(entry.manifest_bytes, self.alloc_unit)
        refcount, sizes = self.refcount, self.object_size
        unsized = []
        for page in entry.unique_pages:
            digest = page.digest
            count = refcount.get(digest, 0)
            if count == 0 or not sizes.get(digest):
                # first reference, or one that was missing when an earlier entry named it
                unsized.append(digest)
            refcount[digest] = count + 1
        if unsized:
            self._count_sizes(unsized)
        idd = m.identity_digest
        keys = m.block_keys
        self.ends.setdefault(idd, {}).setdefault(keys[-1], set()).add(eid)
        by_key = self.blocks.get(idd)
        if by_key is None:
            by_key = self.blocks[idd] = {}
        get = by_key.get
        for pos in indexed_positions(len(keys)):
            key = keys[pos]
            slot = get(key)
            if slot is None:
                by_key[key] = (pos, eid)
            elif slot[0] == pos:
                holders = slot[1]
                if holders.__class__ is str:
                    if holders != eid:
                        by_key[key] = (pos, {holders, eid})
                else:
                    holders.add(eid)
        unit_key = entry.unit_key = self._unit_key(m, idd)
        unit = self.units.get(unit_key)
        if unit is None:
            self.units[unit_key] = {eid}
        else:
            unit.add(eid)
        self.set_access(entry, entry.last_access)
        self._recency_changed.add(eid)

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
        idd = m.identity_digest
        ends = self.ends.get(idd, {})
        ending = ends.get(m.block_keys[-1])
        if ending is not None:
            ending.discard(entry_id)
            if not ending:
                del ends[m.block_keys[-1]]
        by_key = self.blocks.get(idd, {})
        for pos in indexed_positions(len(m.block_keys)):
            key = m.block_keys[pos]
            slot = by_key.get(key)
            if slot is None:
                continue
            holders = slot[1]
            if isinstance(holders, str):
                if holders == entry_id:
                    del by_key[key]
            else:
                holders.discard(entry_id)
                if len(holders) == 1:
                    by_key[key] = (slot[0], next(iter(holders)))
                elif not holders:
                    del by_key[key]
        unit = self.units.get(entry.unit_key)
        if unit is not None:
            unit.discard(entry_id)
            if not unit:
                del self.units[entry.unit_key]
        self._recency_changed.discard(entry_id)
        return freed

    def _unit_key(self, m: Manifest, idd: str) -> tuple:
        # idd: m's identity digest (cached per identity), cheaper to hash than the identity
        rank0 = self._rank0.get(idd)
        if rank0 is None:
            rank0 = self._rank0[idd] = dataclasses.replace(m.identity, tp_rank=0).digest()
        return rank0, m.block_keys[-1], len(m.block_keys)

    # ------------------------------------------------------------------ recency

    def set_access(self, entry: IndexedEntry, when: float) -> None:
        """Record ``entry``'s last access (from disk, or this process's own touch)."""
        entry.last_access = when
        entry.lru_seq = next(self._seq)
        if self._unsized is not None:  # during a full listing: heapified once at its end
            self._lru.append((when, entry.lru_seq, entry.entry_id))
            return
        heapq.heappush(self._lru, (when, entry.lru_seq, entry.entry_id))
        if len(self._lru) > 2 * len(self.entries) + 4096:  # prune the stale items
            self._lru = [(e.last_access, e.lru_seq, e.entry_id) for e in self.entries.values()]
            heapq.heapify(self._lru)

    def oldest(self, n: int) -> list[IndexedEntry]:
        """Up to ``n`` entries, least recently used first (O(n log entries))."""
        taken, out = [], []
        lru, entries = self._lru, self.entries
        while lru and len(out) < n:
            item = heapq.heappop(lru)
            entry = entries.get(item[2])
            if entry is not None and entry.lru_seq == item[1]:
                taken.append(item)
                out.append(entry)
        for item in taken:
            heapq.heappush(lru, item)
        return out

    def take_recency_changes(self) -> list[IndexedEntry]:
        """Entries whose last access was read from disk since the last call."""
        changed, self._recency_changed = self._recency_changed, set()
        return [self.entries[e] for e in changed if e in self.entries]

    def _read_access(self, entry: IndexedEntry) -> None:
        try:
            st = self.layout.lstat(entry.path)
        except (FileNotFoundError, UnsafePathError):
            return  # gone or replaced: the journal or the next listing says so
        except OSError as exc:
            self.unknown[entry.path + _RECENCY] = f"cannot read its last access: {exc}"
            return
        self.unknown.pop(entry.path + _RECENCY, None)
        if st.st_ino == entry.inode and st.st_mtime != entry.last_access:
            self.set_access(entry, st.st_mtime)
            self._recency_changed.add(entry.entry_id)

    def refresh_recency(self, limit: int = RECENCY_SWEEP) -> None:
        """Re-read up to ``limit`` last accesses (manifest mtimes) from disk, round-robin over
        the entries, and every one that could not be read before. Accesses by the store's own
        lookups arrive through the journal; this catches a time set any other way."""
        for key in [k for k in self.unknown if k.endswith(_RECENCY)]:
            name = os.path.basename(key[: -len(_RECENCY)])
            entry = self.entries.get(name[: -len(MANIFEST_SUFFIX)])
            if entry is None:
                del self.unknown[key]
            else:
                self._read_access(entry)
        if len(self.entries) <= limit:
            for entry in list(self.entries.values()):
                self._read_access(entry)
            return
        done: set[str] = set()
        while len(done) < limit:
            if not self._recency_cursor:
                self._recency_cursor = list(self.entries)
            entry_id = self._recency_cursor.pop()
            entry = self.entries.get(entry_id)
            if entry is not None and entry_id not in done:
                done.add(entry_id)
                self._read_access(entry)

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

    def unit_of(self, entry: IndexedEntry) -> list[IndexedEntry]:
        """Every entry of ``entry``'s unit (the shards tensor-parallel ranks published of the
        same blocks, identities differing only in ``tp_rank``), itself included."""
        return [self.entries[e] for e in self.units.get(entry.unit_key, ()) if e in self.entries]

    def longest_match(self, identity_digest: str, keys: list[str], *,
                      with_state: bool = False) -> tuple[IndexedEntry | None, int]:
        """The entry holding the longest prefix of ``keys`` and that prefix's length in blocks.
        ``with_state``: only an entry that ends exactly there and holds the recurrent state
        at its end (a hybrid model resumes only where a state was taken). Block keys are
        chained (a key names its whole prefix): the deepest indexed key of ``keys`` that is
        stored is found by bisection, then the entries holding it are compared key by key
        for at most ``STRIDE`` more blocks."""
        by_key = self.blocks.get(identity_digest)
        if not by_key or not keys:
            return None, 0
        wanted = tuple(keys)
        if with_state:
            depth = self._depth(by_key, wanted)[1]
            ends = self.ends.get(identity_digest, {})
            for k in range(depth, 0, -1):
                for entry in self._by_recency(ends.get(keys[k - 1], ())):
                    m = entry.manifest
                    if m.state is not None and m.block_count == k and m.block_keys == wanted[:k]:
                        return entry, k
            return None, 0
        return self._depth(by_key, wanted)

    def _depth(self, by_key: dict, wanted: tuple) -> tuple[IndexedEntry | None, int]:
        """The entry holding the longest prefix of ``wanted`` and its length (the longest and
        then most recently used entry among equals)."""
        pos = _deepest_indexed(by_key, wanted)
        if pos < 0:
            return None, 0
        holders = by_key[wanted[pos]][1]
        ids = (holders,) if holders.__class__ is str else holders
        best, depth = None, 0
        limit = min(len(wanted), pos + 1 + STRIDE)
        for entry in sorted((self.entries[e] for e in ids if e in self.entries),
                            key=lambda e: (e.manifest.block_count, e.last_access), reverse=True):
            stored = entry.manifest.block_keys
            if stored[: pos + 1] != wanted[: pos + 1]:
                continue  # another prefix reached the same key (keys that are not chained)
            k = pos + 1
            end = min(limit, len(stored))
            while k < end and stored[k] == wanted[k]:
                k += 1
            if k > depth:
                best, depth = entry, k
        return best, depth

    def _by_recency(self, ids) -> list[IndexedEntry]:
        return sorted((self.entries[e] for e in ids if e in self.entries),
                      key=lambda e: e.last_access, reverse=True)

    # ------------------------------------------------------------------ sync with disk

    def refresh(self, *, full: bool = False, complete: bool = False,
                budget_s: float | None = None) -> None:
        """Bring the view up to date. Default: the journal's new records, and another try of
        a few manifests that could not be read; with ``budget_s`` (a lookup's, on vLLM's
        scheduler thread) only the records that fit in that time, at least one (the rest wait
        for the next refresh: an eviction's batch of records is spread over a few lookups).
        ``complete`` (a maintenance pass, before it deletes anything): list everything again
        when a record asked for it, a listing failed or the journal could not be read, and
        try every unknown manifest again. ``full``: list every manifest (opening a store)."""
        if full or not self._ever_listed:
            self._list_all()
        else:
            try:
                records = self.journal.poll()
                self.unknown.pop(self.journal.path, None)
            except JournalError as exc:
                self.unknown[self.journal.path] = f"cannot read the journal (retried): {exc}"
                self._listed = False  # what it said is lost: list again once it reads
                records = []
            self._pending.extend(records)
            self.touched.clear()  # our own accesses' records are among those read by now
            deadline = None if budget_s is None or complete else time.perf_counter() + budget_s
            while self._pending:  # at least one record, however late this thread runs
                self._apply(self._pending.popleft())
                if deadline is not None and time.perf_counter() >= deadline:
                    break
            if complete and not self._listed:
                self._list_all()
            elif self.unknown:
                self._retry_listings()  # a process running no pass sees them too, once readable
        retry = [p for p in self.unknown if p.endswith(MANIFEST_SUFFIX)]
        for path in retry if complete else retry[:_RETRIES_PER_LOOKUP]:
            idd, name = path.split(os.sep)[-2:]
            self.load(idd, name[: -len(MANIFEST_SUFFIX)])

    def _retry_listings(self) -> None:
        """List again what could not be listed: the manifests directory (all of it), or the
        identity directories that failed (each alone; the view stays not ``complete`` until a
        pass's complete refresh lists everything)."""
        top = self.layout.manifests_dir
        if top in self.unknown:
            try:  # probed first: a failing listing must not cost the journal's records
                self.layout.scandir_files(top)
            except (OSError, UnsafePathError):
                return
            self._list_all()  # the whole view, once it lists again (seconds for a large store)
            return
        for path in [p for p in self.unknown if os.path.dirname(p) == top][:_RETRIES_PER_LOOKUP]:
            self._list_dir(os.path.basename(path))

    def _apply(self, record: Record) -> None:
        if record.op is Op.RESCAN:
            self._listed = False
            return
        if not (is_identity_digest(record.identity_digest) and is_entry_id(record.entry_id)):
            return
        if record.op is Op.PUBLISHED:
            self.load(record.identity_digest, record.entry_id)
        elif record.op is Op.REMOVED:
            self.forget_name(record.identity_digest, record.entry_id)
        elif record.op is Op.ACCESSED:
            entry = self.entries.get(record.entry_id)
            if entry is not None and record.entry_id not in self.touched:
                self._read_access(entry)  # another process's access: its time is the mtime

    def rescan_wanted(self) -> None:
        """The next complete refresh lists every manifest again."""
        self._listed = False

    def forget_name(self, idd: str, entry_id: str) -> None:
        """The manifest ``idd/entry_id`` is gone: out of the view, whatever was known of it."""
        self.remove(entry_id)
        self.bad.pop(entry_id, None)
        self.unknown.pop(self.layout.manifest_path(idd, entry_id), None)
        mark = self._marks.get(idd)
        if mark is not None:
            mark.names.pop(entry_id, None)

    def _list_all(self) -> None:
        """List every identity directory and read each manifest not known with its inode. What
        the journal holds from here on is read by the next refreshes."""
        self._ever_listed = True
        self._listed = False
        self._pending.clear()  # older than the listing, which says what they said
        try:
            self.journal.end()
            self.unknown.pop(self.journal.path, None)
        except JournalError as exc:
            self.unknown[self.journal.path] = f"cannot read the journal (retried): {exc}"
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
        dirs: list[str] = []
        for name, st in found:
            path = os.path.join(top, name)
            if is_identity_digest(name) and stat.S_ISDIR(st.st_mode):
                dirs.append(name)
            else:
                self.strays[path] = ("not an identity directory of manifests (a link, a file "
                                     "or a stray name); the store ignores it: remove it")
        for gone in set(self._marks) - set(dirs):
            for entry_id in list(self._marks.pop(gone).names):
                self.remove(entry_id)
                self.bad.pop(entry_id, None)
            self._forget_unknown_under(self.layout.identity_dir(gone))
        self._unsized = set()
        collecting = gc.isenabled()
        gc.disable()  # the view's (and the snapshot's) many small objects would trigger
        try:          # collections that find nothing
            self._snapshot = read_snapshot(self.layout)
            for idd in dirs:
                self._list_dir(idd)
            unsized, self._unsized = self._unsized, None
            self._ask_sizes(list(unsized))
        finally:
            if collecting:
                gc.enable()
            self._unsized = None
            heapq.heapify(self._lru)
            self._snapshot = None
        self._listed = not any(not p.endswith((MANIFEST_SUFFIX, _RECENCY)) for p in self.unknown)

    def _list_dir(self, idd: str) -> None:
        path = self.layout.identity_dir(idd)
        try:
            with self.layout.open_dir(path) as d:
                with os.scandir(d.fd) as it:  # inodes from the directory itself, no stat per file
                    listing = [(e.name, e.inode()) for e in it]
                self.unknown.pop(path, None)
                self._read_listing(idd, path, listing, d.fd)
        except FileNotFoundError:
            return
        except UnsafePathError as exc:
            self.strays[path] = f"cannot list: {exc}"
        except OSError as exc:  # not known: what the view holds of it stays
            self.unknown[path] = f"cannot list (retried): {exc}"

    def _read_listing(self, idd: str, path: str, listing: list[tuple[str, int]], dir_fd: int) -> None:
        mark = self._marks.setdefault(idd, _DirMark())
        prefix = path + os.sep
        seen: dict[str, int] = {}
        for name, inode in listing:
            if not name.endswith(MANIFEST_SUFFIX):
                continue  # temp files never live here; anything else is ignored
            entry_id = name[: -len(MANIFEST_SUFFIX)]
            if is_entry_id(entry_id):
                seen[entry_id] = inode
        for entry_id in set(mark.names) - set(seen):
            self.forget_name(idd, entry_id)
        for unknown in [p for p in self.unknown if p.startswith(path + os.sep)]:
            if os.path.basename(unknown)[: -len(MANIFEST_SUFFIX)] not in seen:
                del self.unknown[unknown]  # listed, and no longer there
        for entry_id, inode in seen.items():
            known = self.entries.get(entry_id)
            if known is not None and known.inode == inode:
                continue
            bad = self.bad.get(entry_id)
            if bad is not None and bad.inode == inode:
                continue
            if self._snapshot is None or not self._load_from_snapshot(idd, entry_id, dir_fd, prefix):
                self.load(idd, entry_id, dir_fd=dir_fd)
        mark.names = {e: i for e, i in seen.items() if e in self.entries or e in self.bad
                      or self.layout.manifest_path(idd, e) in self.unknown}

    def load(self, idd: str, entry_id: str, *, dir_fd: int | None = None) -> IndexedEntry | None:
        """(Re)read one manifest file into the view (``dir_fd``: its identity directory, open).
        One the store knows to be bad is recorded in ``self.bad`` (a link, a FIFO, a
        directory, an oversized file, a body that does not decode, more than ``limits``
        allow); one that could not be read (EIO, EACCES, ...) is ``unknown``: what the view
        held of it stays, and the next refresh reads it again. Never raises."""
        path = self.layout.manifest_path(idd, entry_id)
        try:
            fd = self._open_manifest(path, entry_id, dir_fd)
        except FileNotFoundError:
            self.forget_name(idd, entry_id)
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
            known = self.entries.get(entry_id)
            if (known is not None and known.inode == st.st_ino) or self.unlinking.get(path) == st.st_ino:
                self.unknown.pop(path, None)
                return known  # the same file: nothing to read
            if st.st_size > MAX_MANIFEST_BYTES:
                self._mark_bad(entry_id, idd, path, Reason.CORRUPT, f"{st.st_size} bytes, more than "
                               f"a manifest can hold ({MAX_MANIFEST_BYTES})", st.st_ino)
                return None
            data = _read_all(fd, st.st_size)
        except OSError as exc:
            self._mark_unknown(idd, entry_id, path, f"cannot read: {exc}")
            return None
        finally:
            close_quietly(fd)  # a read-only descriptor's close says nothing of what was read
        self.unknown.pop(path, None)
        try:
            manifest = decode(data, expected_entry_id=entry_id, expected_identity_digest=idd)
        except ManifestError as exc:
            self._mark_bad(entry_id, idd, path, Reason.CORRUPT, f"{exc.reason}: {exc.detail}", st.st_ino)
            return None
        refusal = self.limits.refusal(manifest) if self.limits is not None else None
        if refusal is not None:
            self._mark_bad(entry_id, idd, path, Reason.CORRUPT, refusal, st.st_ino)
            return None
        entry = IndexedEntry(manifest, path, st.st_ino, len(data), st.st_mtime,
                             checksum=header_checksum(data).decode())
        self.add(entry)
        self._marks.setdefault(idd, _DirMark()).names[entry_id] = st.st_ino
        return entry

    def _load_from_snapshot(self, idd: str, entry_id: str, dir_fd: int, prefix: str) -> bool:
        """Take the entry from the snapshot when its manifest (``prefix`` + its name, in the
        directory open at ``dir_fd``) is a regular file whose header carries the checksum the
        snapshot recorded (one short read instead of reading and decoding it; with
        ``whole_bodies``, read whole and its body hashed too); False: read it (``load`` says
        what it is)."""
        name = entry_id + MANIFEST_SUFFIX
        try:
            fd = os.open(name, _MANIFEST_FLAGS, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                return False
            header = os.pread(fd, st.st_size if self.whole_bodies else HEADER_BYTES, 0)
        except OSError:
            return False
        finally:
            close_quietly(fd)  # a read-only descriptor's close says nothing of what was read
        if self.whole_bodies and not body_matches(header):
            return False  # damaged: decoding it says how
        row = self._snapshot.row(entry_id, header, idd, st.st_size)
        if row is None:
            return False
        m = row.manifest
        if self.limits is not None and self.limits.refusal_of(
                len(m.pages) + (m.state is not None), row.declared_bytes, len(m.block_keys)) is not None:
            return False
        path = prefix + name
        if self.unknown:
            self.unknown.pop(path, None)
        self.add(IndexedEntry(row.manifest, path, st.st_ino, st.st_size, st.st_mtime,
                              checksum=row.checksum))
        self._marks[idd].names[entry_id] = st.st_ino
        return True

    def _open_manifest(self, path: str, entry_id: str, dir_fd: int | None) -> int:
        if dir_fd is None:
            return self.layout.open_file(path, os.O_RDONLY)
        # relative to the identity directory already open: one call, never through a link
        return open_regular_at(dir_fd, entry_id + MANIFEST_SUFFIX, path, os.O_RDONLY)

    def _mark_unknown(self, idd: str, entry_id: str, path: str, detail: str) -> None:
        self.unknown[path] = f"{detail} (retried by every refresh; nothing it names is deleted meanwhile)"
        self._marks.setdefault(idd, _DirMark()).names.setdefault(entry_id, -1)

    def _forget_unknown_under(self, prefix: str) -> None:
        for p in [p for p in self.unknown if p == prefix or p.startswith(prefix + os.sep)]:
            del self.unknown[p]

    def _mark_bad(self, entry_id: str, idd: str, path: str, reason: Reason, detail: str,
                  inode: int) -> None:
        self.remove(entry_id)
        self.unknown.pop(path, None)
        self.bad[entry_id] = BadManifest(entry_id, idd, path, reason, detail, inode)
        self._marks.setdefault(idd, _DirMark()).names[entry_id] = inode


_MANIFEST_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _deepest_indexed(by_key: dict, wanted: tuple) -> int:
    """The largest indexed position p below ``len(wanted)`` whose key ``wanted[p]`` is stored
    at position p, or -1 (``strides.deepest_indexed``)."""
    def stored(p: int) -> bool:
        slot = by_key.get(wanted[p])
        return slot is not None and slot[0] == p

    return deepest_indexed(len(wanted), stored)


def _read_all(fd: int, size: int) -> bytes:
    first = os.read(fd, size + 1)  # one read past the size sees a file that grew meanwhile
    if len(first) >= size:
        return first
    chunks, got = [first], len(first)
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
