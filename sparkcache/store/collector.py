"""The collector: deletes what the store no longer needs, in the order that keeps it
crash-safe: a manifest is unlinked, its directory fsynced, and only then are the objects
that it alone referenced deleted (a crash never brings back a manifest whose objects are
gone). Objects no manifest or live publication references (crash leftovers) are swept
shard by shard.

Objects are deleted through the object backend it is given (``delete``; the sweep finds them
with its ``list``), never by their files.

It owns its state: whether it is draining toward the low watermark, the manifest
directories with unlinks not yet fsynced, what its units of work recently cost and where
the next orphan sweep starts. It shares the catalog with ``PageStore`` and receives the
in-process ``lock`` that guards both (an ``RLock``); it takes ``lock`` itself around every
change to the catalog and to its draining flag and unsynced directories. The shard cursor and
the unit costs are only touched by the holder of the exclusive gc lock (a pass), so they take
no in-process lock.

Two locks, always taken in this order: the cross-process exclusive gc lock
(``locks.exclusive_lock``), then ``lock``. Methods marked [gc lock] must be called with the
exclusive gc lock held (``exclusive`` takes it); the passes in ``maintenance`` and
``discard`` here do.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Sequence

from .backend import ObjectBackend, ObjectError
from .catalog import Catalog
from .clocks import SYSTEM_CLOCK, Clock
from .index import IndexedEntry
from .layout import (MANIFEST_SUFFIX, StoreLayout, UnsafePathError, is_identity_digest, parallel_map,
                     sync_all)
from .locks import exclusive_lock
from .pacing import PassClock, UnitCosts
from .pins import live_pins
from .results import CapacitySnapshot
from .staging import read_live_intents

_SHARDS = [f"{i:02x}" for i in range(256)]
_UNLINK_BATCH = 16  # files a maintenance unit unlinks in parallel (the maintenance pool size)


class ShardCursor:
    """Round-robin cursor over the 256 object shards: where a store's next sweep starts."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[str]:
        shards = [_SHARDS[(self.next + i) % 256] for i in range(n)]
        self.next = (self.next + n) % 256
        return shards


class ViewIncomplete(Exception):
    """A listing or a read the collector needs failed: what it would delete is not known to
    be garbage, so it deletes nothing (the next pass tries again)."""

    def __init__(self, unknown: dict[str, str]) -> None:
        first = ", ".join(f"{path}: {why}" for path, why in list(unknown.items())[:3])
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        super().__init__(f"{len(unknown)} store path(s) could not be read, so nothing is evicted or "
                         f"deleted until they can: {first}{more}; check the disk and its "
                         "permissions (`sparkcache verify` lists them)")
        self.unknown = unknown


class Collector:
    def __init__(self, layout: StoreLayout, catalog: Catalog, objects: ObjectBackend,
                 lock: threading.RLock) -> None:
        self.layout = layout
        self.catalog = catalog
        self.objects = objects
        self.lock = lock
        self.draining = False  # above max once; evicting until at or under the low watermark
        self.unsynced_dirs: set[str] = set()  # manifest dirs with unlinks not yet fsynced
        self.unit_costs = UnitCosts()  # what a pass's units of work recently cost
        self.shard_cursor = ShardCursor()  # where the next orphan sweep starts

    def exclusive(self, timeout_s: float):
        """The exclusive gc lock, within ``timeout_s`` (``LockTimeout`` after that)."""
        return exclusive_lock(self.layout, timeout_s=timeout_s)

    # ------------------------------------------------------------------ one pass's ends

    def refresh_view(self) -> set[str]:
        """[gc lock] Digests of live publications, then the journal since the last refresh (and
        a full listing when a record or a dead publication asks for it), in that order, so an
        entry published meanwhile is seen by one of them. Raises
        ``OSError`` when the live publications cannot be read; the view may come back
        incomplete (``catalog.complete``), and then nothing may be deleted on it."""
        # a publisher died: it may have renamed a manifest it never journaled
        protected, _ = read_live_intents(self.layout, before_removal=self._ask_rescan)
        with self.lock:
            self.catalog.unlinked()  # the gc lock's holder unlinks: none of ours is in flight
            self.catalog.refresh(complete=True)
        return protected

    def _ask_rescan(self) -> None:
        """Every process lists the manifests again, this one at this pass's refresh (raises
        ``OSError`` when the journal cannot say it)."""
        with self.lock:
            self.catalog.ask_rescan()

    def require_complete(self) -> None:
        """Raise ``ViewIncomplete`` unless the view knows every manifest and its recency."""
        with self.lock:
            if not self.catalog.complete:
                raise ViewIncomplete(self.catalog.unknown())

    def begin_pass(self, now: float, lease_seconds: float, max_bytes: int,
                   clocks: Clock = SYSTEM_CLOCK, window: int = 1 << 30) -> tuple[set[str], set[str], int, list[IndexedEntry]]:
        """[gc lock] Live intents, re-listed manifests and recency, live pins (expired pin
        files removed); starts draining when above ``max_bytes``. ``now`` is the filesystem's
        (``clocks``). Returns (protected digests, pinned entries, used bytes, entries least
        recently used first)."""
        protected = self.refresh_view()
        with self.lock:
            self.catalog.refresh_recency(now)
        self.require_complete()
        with self.lock:
            pinned = live_pins(self.layout, lease_seconds, clocks, now=now, remove_expired=True)
            used = self.catalog.used_bytes
            if used > max_bytes:
                self.draining = True  # evict down to the low watermark, over several passes
            by_age = self.catalog.oldest(window)
        return protected, pinned, used, by_age

    def end_pass(self, max_bytes: int, low_watermark_bytes: int) -> tuple[CapacitySnapshot, int]:
        """Stop draining once at or under the low watermark. Returns the capacity now and
        how many objects of dropped entries are still to delete."""
        with self.lock:
            used = self.catalog.used_bytes
            self.draining = self.draining and used > low_watermark_bytes
            snapshot = CapacitySnapshot(self.catalog.entry_count, used, max_bytes,
                                        low_watermark_bytes, self.catalog.bad_count,
                                        len(self.catalog.unknown()))
            return snapshot, self.catalog.deferred_count

    def any_expired(self, now: float, ttl_seconds: float) -> bool:
        """Whether an entry was last used more than ``ttl_seconds`` before ``now`` (the
        filesystem's, ``clocks``)."""
        with self.lock:
            oldest = self.catalog.oldest_access()
        return oldest is not None and now - oldest > ttl_seconds

    # ------------------------------------------------------------------ eviction

    def discard(self, entry_ids: Sequence[str], lease_seconds: float,
                clocks: Clock = SYSTEM_CLOCK) -> tuple[str, ...]:
        """Evict these entries now, except pinned ones; returns those evicted. Takes the gc
        lock without waiting: nothing when another holds it or the disk fails."""
        try:
            with self.exclusive(timeout_s=0.0):
                protected = self.refresh_view()
                self.require_complete()
                pinned = live_pins(self.layout, lease_seconds, clocks)
                with self.lock:
                    done = tuple(e for e in entry_ids
                                 if e not in pinned and self.catalog.entry(e) is not None)
                if done:
                    _, kept = self.evict(done, protected)
                    done = tuple(e for e in done if e not in kept)
                return done
        except (OSError, UnsafePathError, ViewIncomplete):  # held by another (LockTimeout), a bad disk
            return ()

    def evict(self, entry_ids: Sequence[str], protected: set[str]) -> tuple[int, set[str]]:
        """[gc lock] Evict entries completely: manifests, fsync, then the objects only they
        referenced. Returns (bytes reclaimed, the ids of those whose manifest could not be
        unlinked: still entries). ``protected`` comes from ``refresh_view``. Deletes only
        these entries' objects; older deferred work is the next pass's."""
        freed, sizes = set(), {}
        for entry_id in entry_ids:
            path, nbytes, digests = self.forget(entry_id)
            if path is not None:
                freed.update(digests)
                sizes[path] = (nbytes, entry_id)
        kept = self.unlink(list(sizes))
        reclaimed = sum(n for path, (n, _) in sizes.items() if path not in kept)
        self.sync_dropped()
        deleted, _ = self.delete_deferred(protected, only=freed)
        return reclaimed + deleted, {sizes[path][1] for path in kept}

    def forget(self, entry_id: str) -> tuple[str | None, int, list[str]]:
        """[gc lock] Drop an entry from the catalog and mark its manifest's directory
        unsynced; the caller unlinks the returned path with ``unlink`` (until then no listing
        reads it back in). Returns (path, manifest bytes, deferred digests)."""
        with self.lock:
            path, nbytes, freed = self.catalog.forget(entry_id)
            if path is not None:
                self.unsynced_dirs.add(os.path.dirname(path))
            return path, nbytes, freed

    def unlink(self, paths: list[str], clock: PassClock | None = None) -> list[str]:
        """[gc lock] Unlink the manifests of forgotten entries in parallel, then let listings
        see them again. One that could not be unlinked (EIO, EACCES: it may still be there)
        is read back into the view at once, so the objects it names are referenced again
        before any deferred object is deleted (and if it cannot be read, the view is
        incomplete and nothing is): a failed unlink never leaves a manifest whose objects are
        gone. Returns those paths. An unlink that frees data blocks can wait on the device
        (ext4 with online discard issues the discard inside the unlink and waits for it,
        queued behind pending writes); parallel unlinks share that wait."""
        if not paths:
            return []
        work = lambda: parallel_map(self._unlink_quietly, paths, "maintenance")  # noqa: E731
        kept = list(paths)  # until the unlinks say otherwise
        try:
            done = clock.run("unlink_batch", work) if clock is not None else work()
            kept = [path for path, ok in zip(paths, done) if not ok]
        finally:
            stayed = set(kept)
            # Only those gone are journaled: another process's view must keep a kept one's
            # objects referenced (it may be the next maintainer).
            self.catalog.removed([path for path in paths if path not in stayed])
            with self.lock:
                self.catalog.unlinked(paths)
                for path in kept:
                    self.catalog.add_published(os.path.basename(os.path.dirname(path)),
                                               os.path.basename(path)[: -len(MANIFEST_SUFFIX)])
        return kept

    def _unlink_quietly(self, path: str) -> bool:
        """Whether ``path`` is gone (unlinked now, or already)."""
        try:
            self.layout.unlink(path)
            return True
        except FileNotFoundError:
            return True
        except (OSError, UnsafePathError):
            return False  # a failing disk, a directory, or a link on the way (never followed)

    def _fsync_dir_if_safe(self, path: str) -> None:
        """fsync a store directory; one that is gone or not a real directory any more
        holds nothing to make durable."""
        try:
            self.layout.fsync_dir(path)
        except (FileNotFoundError, UnsafePathError):
            pass

    def sync_dropped(self, clock: PassClock | None = None) -> float:
        """[gc lock] fsync the directories of dropped manifests, so no crash can bring one
        back after its objects are deleted. Returns the seconds it took."""
        with self.lock:
            dirs = sorted(self.unsynced_dirs)
        if not dirs:
            return 0.0
        now = clock.now if clock is not None else time.monotonic
        t0 = now()
        work = lambda: sync_all(self._fsync_dir_if_safe, dirs, "maintenance")  # noqa: E731
        clock.run("fsync", work) if clock is not None else work()
        with self.lock:
            self.unsynced_dirs.difference_update(dirs)
        return now() - t0

    def delete_deferred(self, protected: set[str], clock: PassClock | None = None,
                        only: set[str] | None = None) -> tuple[int, bool]:
        """[gc lock] Delete deferred objects that are still garbage, in parallel batches;
        with ``clock`` only while the next batch is expected to fit. ``only`` limits it to
        those digests. Returns (bytes reclaimed, whether none of them are left). Does
        nothing while a dropped manifest's directory is not yet fsynced, nor while the view
        is incomplete (an object is deleted only when a complete listing shows no manifest
        references it)."""
        with self.lock:
            pending = self.catalog.deferred_digests(only)
            complete = self.catalog.complete
        if self.unsynced_dirs or not complete:
            return 0, not pending
        reclaimed = 0
        while pending:
            if clock is not None and not clock.fits("unlink_batch"):
                return reclaimed, False
            with self.lock:  # one referenced again (a publication reused it) is not garbage
                batch = [d for d in pending[:_UNLINK_BATCH] if self.catalog.take_deferred(d, protected)]
            pending = pending[_UNLINK_BATCH:]
            work = lambda: parallel_map(self._delete, batch, "maintenance")  # noqa: E731
            sizes = clock.run("unlink_batch", work) if clock is not None else work()
            reclaimed += sum(size or 0 for size in sizes)
        return reclaimed, True

    # ------------------------------------------------------------------ orphans

    def sweep(self, protected: set[str], clock: PassClock,
              n_shards: int) -> tuple[int, int, int, float]:
        """[gc lock] Delete unreferenced objects in up to ``n_shards`` shards while time
        allows. Returns (objects deleted, bytes freed, shards swept, seconds spent in fsync)."""
        count = freed = swept = 0
        with self.lock:
            complete = self.catalog.complete
        if self.unsynced_dirs or not complete or not clock.fits("fsync"):
            return 0, 0, 0, 0.0
        # Another process's manifest unlinks must be durable before their objects go.
        dirs = [self.layout.identity_dir(d) for d in self.layout.listdir(self.layout.manifests_dir)
                if is_identity_digest(d)]
        t0 = clock.now()
        clock.run("fsync", lambda: sync_all(self._fsync_dir_if_safe, dirs, "maintenance"))
        fsync_s = clock.now() - t0
        for _ in range(n_shards):
            if not clock.fits("shard"):
                break
            shard = self.shard_cursor.take(1)[0]
            swept += 1
            garbage = clock.run("shard", lambda: self._sweep_shard(shard, protected))
            count += len(garbage)
            freed += sum(garbage)
        return count, freed, swept, fsync_s

    def _sweep_shard(self, shard: str, protected: set[str]) -> list[int]:
        """Unlink (in parallel) the unreferenced objects of one shard; returns their sizes.
        Reads the catalog without ``lock``: no publication claims an object while the gc
        lock is held, and what live ones claimed before is in ``protected``."""
        garbage = [found.digest for found in self.objects.list(shard)
                   if self.catalog.is_garbage(found.digest, protected)]
        done = parallel_map(self._delete, garbage, "maintenance")
        return [size for size in done if size is not None]

    def _delete(self, digest: str) -> int | None:
        """The object's bytes freed (0: it was gone already), or None when it stays (a link or
        a directory on the way, never followed; a failing disk: verify reports it)."""
        try:
            return self.objects.delete(digest)
        except ObjectError:
            return None


__all__ = ["Collector", "ShardCursor", "ViewIncomplete"]
