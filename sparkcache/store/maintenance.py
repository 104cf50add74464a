"""Maintenance: budgeted passes of TTL expiry, LRU eviction toward the low watermark and
orphan collection, run on a background thread with a guaranteed idle gap between passes.

One pass:
  1. takes the exclusive gc lock (polled, within the pass's time budget);
  2. reads live publications' intents, then re-lists manifests (nothing in flight is lost);
  3. plans: TTL-expired entries, then least-recently-used entries until the projected use
     is at or under the low watermark (only while above max, or still draining toward low);
     pinned entries are never planned;
  4. evicts while the budget (entries, bytes, milliseconds) allows: manifests first, one
     fsync of their directories, then the objects only they referenced (object by object,
     so a large entry cannot overrun the time budget; what is left is deferred to the next
     pass and still counted as used);
  5. with time left, sweeps a few object shards for objects no manifest or live
     publication references (crash leftovers, superseded tails).
A pass that stops on its budget reports ``remaining_entries`` and ``stopped_by``.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .layout import allocated, fsync_dir, sync_all
from .locks import LockTimeout, exclusive_lock
from .pins import live_pins

_SHARDS = [f"{i:02x}" for i in range(256)]


@dataclass(frozen=True)
class PassBudget:
    max_entries: int = 64
    max_bytes: int = 4 << 30
    max_ms: float = 100.0

    @classmethod
    def from_settings(cls, settings: Any) -> "PassBudget":
        return cls(settings.maintenance_max_entries, settings.maintenance_max_bytes,
                   settings.maintenance_max_ms)


@dataclass(frozen=True)
class PassReport:
    started_at: float
    duration_s: float
    budget_ms: float
    entries_evicted: int
    entries_expired: int
    bytes_reclaimed: int
    orphans_collected: int
    orphan_bytes: int
    shards_swept: int
    pinned_skipped: int
    remaining_entries: int
    deferred_objects: int  # objects of evicted entries left for the next pass (time budget)
    stopped_by: str  # done | entries | bytes | time | lock
    used_bytes_before: int
    used_bytes_after: int
    max_bytes: int
    low_watermark_bytes: int
    entries_after: int
    lock_wait_ms: float
    cpu_ms: float  # CPU time of the pass's thread: duration minus waiting and preemption
    plan_ms: float  # lock held: re-list manifests, read pins, plan
    fsync_ms: float

    @property
    def over_budget(self) -> bool:
        return self.duration_s * 1000.0 > self.budget_ms


class _Sweeper:
    """Round-robin cursor over the 256 object shards."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[str]:
        shards = [_SHARDS[(self.next + i) % 256] for i in range(n)]
        self.next = (self.next + n) % 256
        return shards


def run_pass(store: Any, budget: PassBudget, *, sweep_shards: int = 16,
             now: float | None = None) -> PassReport:
    started_wall = time.time() if now is None else now
    t0 = time.monotonic()
    cpu0 = time.thread_time()
    deadline = t0 + budget.max_ms / 1000.0
    index = store.index
    metrics = store.metrics
    if metrics is not None:
        metrics.on_pass_start()
    used_before = index.used_bytes
    evicted = expired_n = reclaimed = orphans = orphan_bytes = swept = skipped = remaining = 0
    fsync_s = lock_wait_s = plan_s = 0.0
    stopped_by = "done"
    try:
        with exclusive_lock(store.layout.gc_lock_path, timeout_s=max(deadline - time.monotonic(), 0)):
            lock_wait_s = time.monotonic() - t0
            protected = store.locked_view_refresh()
            with store._mutex:
                index.refresh_recency()
                pinned = live_pins(store.layout.pins_dir, started_wall, remove_expired=True)
                used_before = index.used_bytes
                if used_before > store.max_bytes:
                    store.draining = True  # evict down to the low watermark, over several passes
                plan = _plan(store, pinned, started_wall)
                skipped = next(plan)
            plan_s = time.monotonic() - t0 - lock_wait_s
            # 1. finish what earlier passes left: fsync their manifest dirs (always: that is
            #    the progress guarantee), delete their objects while time allows
            if store.unsynced_dirs:
                fsync_s += store.sync_dropped_locked()
            deleted, _ = store.delete_deferred_locked(protected, deadline)
            reclaimed += deleted
            # 2. plan and drop manifests, oldest first, as the budget allows; keep time for
            #    the fsync that must follow (but always make progress: one entry at least)
            planned = 0
            pending_item = None
            for item in plan:
                entry_id, est, expired = item
                if evicted and time.monotonic() + store.fsync_cost_s >= deadline:
                    stopped_by, pending_item = "time", item
                    break
                if evicted >= budget.max_entries:
                    stopped_by, pending_item = "entries", item
                    break
                if evicted > 0 and planned + est > budget.max_bytes:
                    stopped_by, pending_item = "bytes", item
                    break
                with store._mutex:
                    reclaimed += store.drop_manifests_locked([entry_id])
                planned += est
                evicted += 1
                expired_n += expired
            if pending_item is not None:
                remaining = 1 + _count_rest(plan, deadline + budget.max_ms / 10000.0)
            # 3. make the drops durable, then delete the objects they freed
            if store.unsynced_dirs and time.monotonic() + store.fsync_cost_s < deadline:
                fsync_s += store.sync_dropped_locked()
            deleted, all_deleted = store.delete_deferred_locked(protected, deadline)
            reclaimed += deleted
            if not all_deleted and stopped_by == "done":
                stopped_by = "time"
            # 4. orphan sweep with the time left
            if stopped_by == "done":
                orphans, orphan_bytes, swept = _sweep(store, protected, deadline, sweep_shards)
                if swept < sweep_shards:
                    stopped_by = "time"
    except LockTimeout:
        stopped_by = "lock"
    with store._mutex:
        used_after = index.used_bytes
        store.draining = store.draining and used_after > store.low_watermark_bytes
        entries_after = len(index.entries)
        deferred = len(index.deferred)
    report = PassReport(started_wall, time.monotonic() - t0, budget.max_ms, evicted - expired_n,
                        expired_n, reclaimed + orphan_bytes, orphans, orphan_bytes, swept, skipped,
                        remaining, deferred, stopped_by, used_before, used_after, store.max_bytes,
                        store.low_watermark_bytes, entries_after, lock_wait_s * 1e3,
                        (time.thread_time() - cpu0) * 1e3, plan_s * 1e3,
                        fsync_s * 1e3)
    if metrics is not None:
        metrics.on_pass(report)
        metrics.on_capacity(store.capacity())
    return report


def _plan(store: Any, pinned: set[str], now: float):
    """Generator: first yields the number of pinned entries skipped, then
    ``(entry_id, expected bytes freed, expired)`` oldest first: TTL-expired entries, then
    least-recently-used ones until the projected use is at or under the low watermark.
    Lazy, so the planning work of a pass is bounded by the pass's own budget. Call under
    ``store._mutex``-free conditions only from ``run_pass`` (it reads the index)."""
    index = store.index
    by_age = sorted(index.entries.values(), key=lambda e: e.last_access)
    candidates = [e for e in by_age if e.entry_id not in pinned]
    yield len(by_age) - len(candidates)
    dropping: dict[str, int] = {}
    projected = index.used_bytes - index.deferred_bytes()  # deferred objects go anyway
    expired: set[str] = set()
    if store.ttl_seconds > 0:
        for e in candidates:
            if now - e.last_access > store.ttl_seconds:
                free = index.entry_free_bytes(e, dropping)
                expired.add(e.entry_id)
                projected -= free
                yield e.entry_id, free, True
                _forget_if_removed(index, e, dropping)
    if projected > store.max_bytes or (store.draining and projected > store.low_watermark_bytes):
        for e in candidates:
            if projected <= store.low_watermark_bytes:
                break
            if e.entry_id in expired:
                continue
            free = index.entry_free_bytes(e, dropping)
            projected -= free
            yield e.entry_id, free, False
            _forget_if_removed(index, e, dropping)


def _forget_if_removed(index: Any, entry: Any, dropping: dict[str, int]) -> None:
    """The consumer really evicted ``entry``: its references are gone from the index's
    refcounts, so they must not be subtracted a second time."""
    if entry.entry_id not in index.entries:
        for page in entry.unique_pages:
            dropping[page.digest] -= 1


def _count_rest(plan, until: float) -> int:
    """How many more entries the plan holds (counted while time allows, then estimated)."""
    count = 0
    for _ in plan:
        count += 1
        if time.monotonic() >= until:
            return count + 1  # at least one more; an estimate, the next pass re-plans
    return count


def _sweep(store: Any, protected: set[str], deadline: float, n_shards: int) -> tuple[int, int, int]:
    """Delete unreferenced objects in up to ``n_shards`` shards while time allows."""
    sweeper = store.__dict__.setdefault("_sweeper", _Sweeper())
    count = freed = swept = 0
    if store.unsynced_dirs or n_shards <= 0:
        return 0, 0, 0
    # Another process's manifest unlinks must be durable before their objects go.
    dirs = [os.path.join(store.layout.manifests_dir, d) for d in os.listdir(store.layout.manifests_dir)]
    if time.monotonic() + store.fsync_cost_s * 2 >= deadline:
        return 0, 0, 0
    sync_all(fsync_dir, [d for d in dirs if os.path.isdir(d)])
    shard_cost = 0.0
    for _ in range(n_shards):
        t_shard = time.monotonic()
        if t_shard + shard_cost >= deadline:
            break
        shard = sweeper.take(1)[0]
        swept += 1
        for digest, size in store.objects.iter_shard(shard):
            if digest in store.index.refcount or digest in protected or digest in store.index.deferred:
                continue
            try:
                os.unlink(os.path.join(store.layout.objects_dir, shard, digest[2:]))
                count += 1
                freed += allocated(size, store.index.alloc_unit)
            except (FileNotFoundError, IsADirectoryError):
                pass
        shard_cost = max(shard_cost, time.monotonic() - t_shard)
    return count, freed, swept


def pass_due(store: Any, now: float | None = None) -> bool:
    """Whether capacity or TTL asks for a pass (cheap; reads the in-memory view)."""
    now = time.time() if now is None else now
    cap = store.capacity()
    if cap.used_bytes > store.max_bytes:
        return True
    if store.draining and cap.used_bytes > store.low_watermark_bytes:
        return True
    if store.ttl_seconds > 0:
        with store._mutex:
            return any(now - e.last_access > store.ttl_seconds for e in store.index.entries.values())
    return False


class MaintenanceThread:
    """Runs passes off the caller's thread: at most one pass per ``interval_s`` (the gap is
    measured from the end of one pass to the start of the next, so a store that is always
    full still leaves the machine idle for ``interval_s`` between passes)."""

    def __init__(self, store: Any, budget: PassBudget, interval_s: float, *,
                 sweep_every_s: float = 30.0, nice: int = 10,
                 on_report: Callable[[PassReport], None] | None = None,
                 keep_reports: int = 10000) -> None:
        self.store = store
        self.budget = budget
        self.interval_s = interval_s
        self.sweep_every_s = sweep_every_s
        self.nice = nice
        self.on_report = on_report
        self.reports: collections.deque[PassReport] = collections.deque(maxlen=keep_reports)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> "MaintenanceThread":
        if self._thread is not None:
            raise RuntimeError("MaintenanceThread already started")
        self._thread = threading.Thread(target=self._run, name="sparkcache-maintenance", daemon=True)
        self._thread.start()
        return self

    def trigger(self) -> None:
        """Ask for a check soon (still no sooner than the idle gap after the last pass)."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError):
                pass
        last_end = -float("inf")
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                gap = last_end + self.interval_s - time.monotonic()
                if gap > 0 and self._stop.wait(gap):
                    break
                sweep_due = time.monotonic() - last_sweep >= self.sweep_every_s
                if not (sweep_due or pass_due(self.store)):
                    self._wake.wait(self.interval_s)
                    self._wake.clear()
                    continue
                report = run_pass(self.store, self.budget, sweep_shards=16 if sweep_due else 0)
                if sweep_due:
                    last_sweep = time.monotonic()
                last_end = time.monotonic()
                self.reports.append(report)
                if self.on_report is not None:
                    self.on_report(report)
        except BaseException as exc:  # surfaced through .error and the metrics, not swallowed
            self.error = exc
            raise
