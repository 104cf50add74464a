"""The catalog: the manifests on disk and the in-memory view of them.

It owns the manifest files' place (``manifests/<identity>/<entry>.mf``), the view
(``EntryIndex``: entries, the block-hash index, object refcounts, bytes used, the objects of
dropped entries not deleted yet) and recency (a manifest's mtime is its entry's last
access). Writing a manifest is publication's (``publication.py``); deleting one, and the
order that makes a deletion crash-safe, the collector's (``collector.py``).

The catalog takes no lock: ``PageStore`` and the ``Collector`` share one in-process lock
and hold it around every call that changes the view or reads its sums. One exception:
``touch`` (a lookup's recency) runs without it: it writes the manifest's mtime and a journal
record, and returns the time for ``accessed``, which runs under the lock.

Every change other processes must see goes into the journal (``journal.py``): a
publication's manifest (``published``), a removal (``removed``), an access (``touch``).
"""

from __future__ import annotations

import collections

from .backend import ObjectBackend
from .clocks import FUTURE_SLACK_S
from .identity import entry_id_for
from .index import BadManifest, EntryIndex, IndexedEntry, ManifestLimits
from .journal import Op, Record, rescan
from .layout import StoreLayout, UnsafePathError, allocated

_RESTAMP = 256  # manifests stamped in the future that one refresh re-stamps (the rest: later)


class Catalog:
    def __init__(self, layout: StoreLayout, alloc_unit: int, objects: ObjectBackend,
                 limits: ManifestLimits | None = None) -> None:
        self.layout = layout
        self.index = EntryIndex(layout, alloc_unit, limits, objects=objects)
        self._future: dict[str, IndexedEntry] = {}  # last accesses stamped ahead, not yet re-stamped
        # this process's hits, stamped by its AccessRecorder: (entry, time), applied by refresh
        self.stamped: collections.deque[tuple[IndexedEntry, float]] = collections.deque()

    # ------------------------------------------------------------------ sync with disk

    def refresh(self, *, full: bool = False, complete: bool = False,
                budget_s: float | None = None) -> None:
        """Bring the view up to date with this process's recorded hits and the manifests on
        disk (``EntryIndex.refresh``)."""
        while self.stamped:
            self.accessed(*self.stamped.popleft())
        self.index.refresh(full=full, complete=complete, budget_s=budget_s)

    def refresh_recency(self, now: float | None = None) -> None:
        """Re-read some last-access times from disk (``EntryIndex.refresh_recency``). With
        ``now`` (the filesystem's, ``clocks``): a last access stamped in the future counts as
        now, and up to ``_RESTAMP`` of them are re-stamped with the kernel's time, so that they
        age from there (no clock far ahead makes an entry immune to the TTL)."""
        self.index.refresh_recency()
        if now is None:
            return
        ahead = now + FUTURE_SLACK_S
        for entry in self.index.take_recency_changes():
            if entry.last_access > ahead:
                self._future[entry.entry_id] = entry
        restamp = _RESTAMP
        for entry_id, entry in list(self._future.items()):
            if self.index.entries.get(entry_id) is not entry or entry.last_access <= now + FUTURE_SLACK_S:
                del self._future[entry_id]
                continue
            if restamp > 0:
                restamp -= 1
                when = self.touch(entry)
                if when is not None and when <= now + FUTURE_SLACK_S:
                    del self._future[entry_id]
            if entry.last_access > now:
                self.index.set_access(entry, now)

    def published(self, identity_digest: str, entry_id: str) -> None:
        """[shared gc lock] Tell every process about a manifest just renamed into place (a
        journal record; raises ``JournalError``)."""
        self.index.journal.append([Record(Op.PUBLISHED, identity_digest, entry_id)])

    def add_published(self, identity_digest: str, entry_id: str) -> None:
        """Read the manifest a publication just renamed into place into the view."""
        self.index.load(identity_digest, entry_id)

    def removed(self, paths: list[str]) -> None:
        """[exclusive gc lock] Tell every process these manifests were unlinked (best effort:
        one the journal misses stays in other views, where a lookup finds its manifest gone)."""
        records = []
        for path in paths:
            idd, name = path.split("/")[-2:]
            records.append(Record(Op.REMOVED, idd, name.rsplit(".", 1)[0]))
        try:
            self.index.journal.append(records)
        except OSError:
            pass

    def ask_rescan(self) -> None:
        """A publisher died or failed between renaming its manifest and journaling it: every
        process lists the manifests again (this one at its next complete refresh). Raises
        ``OSError`` when the journal cannot take the record: the other processes would not
        know, so the dead intent that says it must stay (``read_live_intents``)."""
        self.index.rescan_wanted()
        self.index.journal.append([rescan()])

    # ------------------------------------------------------------------ manifest files

    def manifest_path(self, identity_digest: str, entry_id: str) -> str:
        return self.layout.manifest_path(identity_digest, entry_id)

    def make_identity_dir(self, identity_digest: str) -> list[str]:
        """Create the identity's manifest directory if needed; returns the directories to
        fsync before a manifest is renamed into it (its parent, when it is new)."""
        if self.layout.make_dir(self.layout.identity_dir(identity_digest)):
            return [self.layout.manifests_dir]
        return []

    def touch(self, entry: IndexedEntry) -> float | None:
        """Record an access (LRU) in the manifest's mtime, visible to every process, stamped
        with the kernel's time (the filesystem's clock, never this process's wall clock:
        ``clocks``), and journal it; returns the time for ``accessed`` (None: not recorded,
        a read-only or full disk keeps the old time)."""
        try:
            when = self.layout.touch(entry.path)
            self.index.journal.append([Record(Op.ACCESSED, entry.manifest.identity_digest,
                                              entry.entry_id)])
            return when
        except (OSError, UnsafePathError):
            return None

    def accessed(self, entry: IndexedEntry, when: float | None) -> None:
        """This process's own access, in its view (``when`` from ``touch``)."""
        if when is not None and self.index.entries.get(entry.entry_id) is entry:
            self.index.set_access(entry, when)
            self.index.touched.add(entry.entry_id)

    def oldest(self, n: int) -> list[IndexedEntry]:
        """Up to ``n`` entries, least recently used first."""
        return self.index.oldest(n)

    def reread(self, entry: IndexedEntry) -> IndexedEntry | None:
        """Read ``entry``'s manifest again (another process replaced it); what the view holds
        under its id afterwards (``entry`` itself when it could not be read)."""
        self.index.load(entry.manifest.identity_digest, entry.entry_id)
        return self.index.entries.get(entry.entry_id)

    def drop_vanished(self, entry: IndexedEntry) -> None:
        """A lookup found ``entry``'s manifest gone (its removal's record was lost): out of
        the view."""
        if self.index.entries.get(entry.entry_id) is entry:
            self.index.forget_name(entry.manifest.identity_digest, entry.entry_id)

    @property
    def limits(self) -> ManifestLimits | None:
        return self.index.limits

    def unit_of(self, entry: IndexedEntry) -> list[IndexedEntry]:
        """The shards of ``entry``'s unit (``EntryIndex.unit_of``)."""
        return self.index.unit_of(entry)

    def oldest_access(self) -> float | None:
        """The least recent last access, or None when there is no entry."""
        found = self.index.oldest(1)
        return found[0].last_access if found else None

    # ------------------------------------------------------------------ queries

    @property
    def alloc_unit(self) -> int:
        return self.index.alloc_unit

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    @property
    def entry_count(self) -> int:
        return len(self.index.entries)

    @property
    def bad_count(self) -> int:
        return len(self.index.bad)

    @property
    def complete(self) -> bool:
        """Whether the last refresh listed and read everything (see ``EntryIndex.unknown``)."""
        return self.index.complete

    def unknown(self) -> dict[str, str]:
        """Paths whose state could not be learned (a listing or read failed): path -> why."""
        return dict(self.index.unknown)

    @property
    def deferred_count(self) -> int:
        return len(self.index.deferred)

    def entry(self, entry_id: str) -> IndexedEntry | None:
        return self.index.entries.get(entry_id)

    def entries(self) -> list[IndexedEntry]:
        return list(self.index.entries.values())

    def bad_manifests(self) -> list[BadManifest]:
        return list(self.index.bad.values())

    def references(self, digest: str) -> int:
        """How many entries reference the object ``digest``."""
        return self.index.refcount.get(digest, 0)

    def longest_match(self, identity_digest: str, keys: list[str], *,
                      with_state: bool = False) -> tuple[IndexedEntry | None, int]:
        return self.index.longest_match(identity_digest, keys, with_state=with_state)

    def entries_ending_within(self, identity_digest: str, keys: list[str]) -> list[str]:
        return self.index.entries_ending_within(identity_digest, keys)

    def refused_deeper(self, identity_digest: str, keys: list[str], depth: int) -> BadManifest | None:
        """The bad manifest of this identity that holds the longest prefix of ``keys`` deeper
        than ``depth`` blocks, if any (a lookup reports why it missed there)."""
        bad = self.index.bad
        if not any(b.identity_digest == identity_digest for b in bad.values()):
            return None
        for j in range(len(keys) - 1, depth - 1, -1):
            found = bad.get(entry_id_for(identity_digest, keys[j]))
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ what eviction reads

    def deferred_bytes(self) -> int:
        return self.index.deferred_bytes()

    def entry_free_bytes(self, entry: IndexedEntry, dropping: dict[str, int]) -> int:
        return self.index.entry_free_bytes(entry, dropping)

    def is_garbage(self, digest: str, protected: set[str]) -> bool:
        """No entry references the object, no live publication declared it, and it is not
        already deferred (the deletion of deferred objects waits for an fsync)."""
        return (digest not in self.index.refcount and digest not in protected
                and digest not in self.index.deferred)

    # ------------------------------------------------------------------ dropping entries

    def forget(self, entry_id: str) -> tuple[str | None, int, list[str]]:
        """Remove an entry from the view and defer the objects only it referenced (they stay
        counted as used until deleted); until ``unlinked``, a listing that still finds its
        manifest does not read it back in. Returns (its manifest's path, the manifest's bytes,
        the deferred digests); (None, 0, []) when it is not in the view."""
        index = self.index
        entry = index.entries.get(entry_id)
        if entry is None:
            return None, 0, []
        sizes = {p.digest: index.object_size.get(p.digest, 0) for p in entry.unique_pages}
        freed = index.remove(entry_id)
        for digest in freed:
            index.deferred[digest] = sizes[digest]
        index.unlinking[entry.path] = entry.inode  # not read back in until ``unlinked``
        return entry.path, allocated(entry.manifest_bytes, index.alloc_unit), freed

    def unlinked(self, paths: list[str] | None = None) -> None:
        """The collector is done unlinking these forgotten entries' manifests (None: every
        one; a pass starts with none of its own in flight). One that could not be unlinked
        is read back in by the next listing, its objects with it."""
        if paths is None:
            self.index.unlinking.clear()
        for path in paths or ():
            self.index.unlinking.pop(path, None)

    def deferred_digests(self, only: set[str] | None = None) -> list[str]:
        """The deferred objects (with ``only``: those of them in it)."""
        return [d for d in self.index.deferred if only is None or d in only]

    def take_deferred(self, digest: str, protected: set[str]) -> bool:
        """Stop deferring ``digest``; True when it is still garbage (no entry references it
        again and no live publication declared it), so the caller deletes it."""
        self.index.deferred.pop(digest, None)
        return digest not in protected and digest not in self.index.refcount

