"""Maintenance: budgeted passes of TTL expiry, LRU eviction toward the low watermark and
orphan collection, run on a background thread with a guaranteed idle gap between passes.

One pass (its budget is wall time, lock wait included; see ``pacing``: it plans to end by
80% of the budget and starts a unit of work only when that unit's running cost estimate
still fits):
  1. takes the exclusive gc lock (polled, for at most 20% of the budget);
  2. reads live publications' intents, then re-lists manifests (nothing in flight is lost);
  3. plans: TTL-expired entries, then least-recently-used entries until the projected use
     is at or under the low watermark (only while above max, or still draining toward low)
     and the filesystem's free space is back at its floor (``min_free_bytes``);
     pinned entries are never planned; the shards that tensor-parallel ranks published of
     one entry (``EntryIndex.unit_of``) are planned and evicted together, or not at all when one
     of them is pinned;
  4. first finishes what earlier passes left (fsync, deferred objects), then evicts while
     the budget (entries, bytes, milliseconds) allows: manifests first (parallel batches),
     one fsync of their directories, then the objects only they referenced (parallel
     batches of unlinks, so a large entry cannot overrun the time budget; what is left is
     deferred to the next pass and still counted as used);
  5. with time left, sweeps a few object shards for objects no manifest or live
     publication references (crash leftovers, superseded tails).
A pass that stops on its budget reports ``remaining_entries`` and ``stopped_by``. A pass
whose view of the store is incomplete (a listing or a read of manifests, pins, recency or
live publications failed: EIO, EACCES) evicts and deletes nothing and stops with
``unknown``; one that cannot read the filesystem's clock (its stamp of the pins directory
fails) stops with ``error`` before it plans: deletion is decided only on positive knowledge.
A manifest whose unlink fails is read back into the view before any object is deleted.

A pass drives the store's collector (``collector.py``: the crash-safe deletions, the sweep,
and the state that carries from pass to pass) against the store's limits; this module holds
the pacing, the plan and the thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from . import cpus
from .clocks import Clock
from .collector import ViewIncomplete
from ..settings import check_number
from .layout import UnsafePathError
from .locks import LockTimeout
from .pacing import PassClock, runqueue_wait_s
from .snapshot import SnapshotWriter

if TYPE_CHECKING:
    from ..settings import Settings
    from .catalog import Catalog
    from .collector import Collector
    from .index import IndexedEntry
    from .pagestore import PageStore

log = logging.getLogger("sparkcache.store")


@dataclass(frozen=True)
class PassBudget:
    max_entries: int = 64
    max_bytes: int = 4 << 30
    max_ms: float = 100.0

    def __post_init__(self) -> None:  # a NaN or a negative budget: refused, not a busy pass
        check_number("PassBudget", "max_entries", self.max_entries, minimum=1, integer=True,
                     setting="SPARKCACHE_MAINTENANCE_MAX_ENTRIES")
        check_number("PassBudget", "max_bytes", self.max_bytes, minimum=1, integer=True,
                     unit="bytes", setting="SPARKCACHE_MAINTENANCE_MAX_BYTES")
        check_number("PassBudget", "max_ms", self.max_ms, above=0, unit="milliseconds",
                     setting="SPARKCACHE_MAINTENANCE_MAX_MS")

    @classmethod
    def from_settings(cls, settings: Settings) -> "PassBudget":
        return cls(settings.maintenance_max_entries, settings.maintenance_max_bytes,
                   settings.maintenance_max_ms)


OVERRUN_TOLERANCE = 0.2  # a pass may run 20% past its time budget (its last unit of work)


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
    stopped_by: str  # done | entries | bytes | time | lock | error | unknown
    used_bytes_before: int
    used_bytes_after: int
    max_bytes: int
    low_watermark_bytes: int
    entries_after: int
    lock_wait_ms: float
    cpu_ms: float  # CPU time of the pass's thread: duration minus waiting and preemption
    plan_ms: float  # lock held: re-list manifests, read pins, plan
    fsync_ms: float
    units: int = 0  # units of work run (batches of unlinks, fsync rounds, re-list, shards)
    longest_unit_ms: float = 0.0  # wall time of the slowest unit
    runqueue_wait_ms: float = 0.0  # the pass's thread runnable but without a CPU (preempted)
    error: str = ""  # what stopped a pass by lock, error or unknown (the exception's message)

    @property
    def overran(self) -> bool:
        """Longer than the bound a pass keeps: its time budget plus ``OVERRUN_TOLERANCE``
        (a unit of work cannot be interrupted once started; docs/SIZING.md)."""
        return self.duration_s * 1000.0 > self.budget_ms * (1.0 + OVERRUN_TOLERANCE)


def run_pass(store: PageStore, budget: PassBudget, *, sweep_shards: int = 16,
             clocks: Clock | None = None, timer: Callable[[], float] = time.monotonic) -> PassReport:
    """One budgeted pass (see the module docstring). Its ``duration_s`` is wall time from
    the call to the return, lock wait included; the pass plans to end by 80% of the budget
    and starts a unit of work only when its running cost estimate still fits. ``timer``
    is the clock the pass paces itself by (monotonic seconds; a test may pass a fake one).
    ``clocks`` (default: the store's) judge leases and recency (``clocks.py``: the boot
    clock and the filesystem's, never the wall clock, which only dates the report)."""
    clocks = store.clocks if clocks is None else clocks
    started_wall = clocks.wall()
    store.accesses.flush(timeout=1.0)  # this process's recent hits count as used before it plans
    collector = store.collector
    clock = PassClock(collector.unit_costs, budget.max_ms, now=timer)
    cpu0 = time.thread_time()
    runq0 = runqueue_wait_s()
    with collector.lock:  # the view's sums change under publication's and lookups' refreshes
        used_before = collector.catalog.used_bytes
    evicted = expired_n = reclaimed = orphans = orphan_bytes = swept = skipped = remaining = 0
    fsync_s = lock_wait_s = plan_s = 0.0
    stopped_by = "done"
    error = ""
    try:
        with collector.exclusive(timeout_s=clock.lock_timeout()):
            lock_wait_s = clock.now() - clock.start
            plan, skipped, used_before = clock.run("refresh", lambda: _locked_plan(store, clocks, budget))
            plan_s = clock.now() - clock.start - lock_wait_s
            protected = plan.protected
            # 1. finish what earlier passes left: fsync their manifest dirs, then delete their
            #    objects, each only when it is expected to fit
            if collector.unsynced_dirs:
                if clock.fits("fsync"):
                    fsync_s += collector.sync_dropped(clock)
                else:
                    stopped_by = "time"
            deleted, all_deleted = collector.delete_deferred(protected, clock)
            reclaimed += deleted
            if not all_deleted:
                stopped_by = "time"
            # 2. drop manifests, oldest first, a parallel batch at a time, while the batch
            #    and the fsync that must follow it fit
            if stopped_by == "done":
                stopped_by, n, n_expired, freed, pending = _drop_planned(collector, plan, budget, clock)
                evicted += n
                expired_n += n_expired
                reclaimed += freed
                if pending:
                    remaining = 1 + _count_rest(plan.items, clock)
            else:  # out of time on earlier work: the planned evictions are all still to do
                remaining = _count_rest(plan.items, clock)
            # 3. make the drops durable, then delete the objects they freed
            if collector.unsynced_dirs and clock.fits("fsync"):
                fsync_s += collector.sync_dropped(clock)
            deleted, all_deleted = collector.delete_deferred(protected, clock)
            reclaimed += deleted
            if (not all_deleted or collector.unsynced_dirs) and stopped_by == "done":
                stopped_by = "time"
            # 4. orphan sweep with the time left
            if stopped_by == "done" and sweep_shards > 0:
                orphans, orphan_bytes, swept, sweep_fsync_s = collector.sweep(protected, clock,
                                                                              sweep_shards)
                fsync_s += sweep_fsync_s
                if swept < sweep_shards:
                    stopped_by = "time"
    except LockTimeout as exc:
        stopped_by, error = "lock", str(exc)
    except ViewIncomplete as exc:  # a listing or read failed: nothing is deleted on it
        stopped_by, error = "unknown", str(exc)
        log.warning("sparkcache: maintenance pass deleted nothing: %s", exc)
    except (OSError, UnsafePathError) as exc:  # a failing disk: this pass stops, the next tries
        stopped_by, error = "error", str(exc)
        log.warning("sparkcache: maintenance pass stopped: %s", exc)
    clock.finish()
    snapshot, deferred = collector.end_pass(store.max_bytes, store.low_watermark_bytes)
    used_after, entries_after = snapshot.used_bytes, snapshot.entries
    return PassReport(started_wall, clock.now() - clock.start, budget.max_ms,
                        evicted - expired_n, expired_n, reclaimed + orphan_bytes, orphans,
                        orphan_bytes, swept, skipped, remaining, deferred, stopped_by, used_before,
                        used_after, store.max_bytes, store.low_watermark_bytes, entries_after,
                        lock_wait_s * 1e3, (time.thread_time() - cpu0) * 1e3, plan_s * 1e3,
                        fsync_s * 1e3, clock.units, clock.longest_unit_s * 1e3,
                        (runqueue_wait_s() - runq0) * 1e3, error)


_Planned = tuple[str, int, bool, bool]  # (entry id, expected bytes freed, expired, joined)


@dataclass
class _Plan:
    protected: set[str]  # digests named by live publications
    items: Iterator[_Planned]  # the ``_plan`` generator, past its first value (an int)


def _locked_plan(store: PageStore, clocks: Clock, budget: PassBudget) -> tuple[_Plan, int, int]:
    """Under the exclusive lock: live intents, the view brought up to date, recency, pins,
    the plan (judged at the filesystem's now, read afresh) over the least recently used
    entries a pass can reach (``plan_window``). Returns (plan, pinned entries skipped, used
    bytes before the pass)."""
    collector = store.collector
    now = clocks.fs_now(store.layout, fresh=True, required=True)  # its I/O error stops the pass
    protected, pinned, used_before, by_age = collector.begin_pass(
        now, store.lease_seconds, store.max_bytes, clocks, window=plan_window(budget))
    items = _plan(store, collector.catalog, by_age, pinned, collector.draining, now)
    skipped = next(items)
    return _Plan(protected, items), skipped, used_before


def _drop_planned(collector: Collector, plan: _Plan, budget: PassBudget, clock: PassClock):
    """Drop planned manifests in parallel batches within the budget. Returns (stopped_by,
    entries dropped, of them expired, manifest bytes, whether planned work is left)."""
    evicted = expired_n = reclaimed = 0
    planned_bytes = 0
    pending = None
    stopped_by = "done"
    costs = clock.costs.estimate
    while True:
        # a batch starts only if it, the fsync after it and one object unlink still fit
        reserve = costs.get("fsync", 0.0) + costs.get("unlink_batch", 0.0)
        if not clock.fits("unlink_batch", reserve=reserve):
            clock.skipped.add("fsync")
            stopped_by = "time"
            pending = pending if pending is not None else next(plan.items, None)
            break
        paths = []
        dropped: dict[str, tuple[int, bool]] = {}  # path -> (manifest bytes, expired)
        while True:
            item = pending if pending is not None else next(plan.items, None)
            pending = None
            if item is None:
                break
            entry_id, est, expired, joined = item
            # a shard joined to the entry before it goes with it, past any budget: a unit
            # is never split between passes
            if not joined and len(paths) >= _DROP_BATCH:
                pending = item
                break
            if not joined and paths and not clock.fits("unlink_batch", reserve=reserve):
                stopped_by, pending = "time", item  # forgetting entries costs CPU too
                break
            if not joined and evicted >= budget.max_entries:
                stopped_by, pending = "entries", item
                break
            if not joined and evicted > 0 and planned_bytes + est > budget.max_bytes:
                stopped_by, pending = "bytes", item
                break
            path, nbytes, _ = collector.forget(entry_id)
            if path is not None:
                paths.append(path)
                dropped[path] = (nbytes, expired)
                reclaimed += nbytes
            planned_bytes += est
            evicted += 1
            expired_n += expired
        for path in collector.unlink(paths, clock):  # not removed: back in the view
            nbytes, expired = dropped[path]
            evicted, expired_n, reclaimed = evicted - 1, expired_n - expired, reclaimed - nbytes
        if stopped_by != "done" or pending is None:
            break
    return stopped_by, evicted, expired_n, reclaimed, pending is not None


_DROP_BATCH = 16  # manifests unlinked in parallel as one unit


def plan_window(budget: PassBudget) -> int:
    """How many of the least recently used entries a pass plans over: what its entry budget
    can evict, with room for pinned ones and the shards that join them (the next pass goes
    on from where this one stopped)."""
    return 4 * budget.max_entries + 1024


def _plan(store: PageStore, catalog: Catalog, by_age: list[IndexedEntry], pinned: set[str],
          draining: bool, now: float) -> Iterator[int | _Planned]:
    """Generator over ``by_age`` (the entries, least recently used first): first yields the
    number of pinned entries skipped, then ``(entry_id, expected bytes freed, expired,
    joined)`` oldest first: TTL-expired entries, then least-recently-used ones until the
    projected use is at or under the low watermark (the store's limits); each followed by
    the other shards of its unit (``joined``: True), and no unit of which a shard is pinned.
    Lazy, so the planning work of a pass is bounded by the pass's own budget. Only for
    ``run_pass``, under the exclusive gc lock (no other pass or ``discard`` runs meanwhile);
    ``by_age`` is this pass's own list, and the catalog's sums are read under the in-process
    lock (a lookup's refresh may change the view meanwhile)."""
    with store.collector.lock:  # lookups' refreshes change the units meanwhile
        units = {e.entry_id: catalog.unit_of(e) or [e] for e in by_age}
    candidates = [e for e in by_age if not any(s.entry_id in pinned for s in units[e.entry_id])]
    yield len(by_age) - len(candidates)
    dropping: dict[str, int] = {}
    with store.collector.lock:
        projected = catalog.used_bytes - catalog.deferred_bytes()  # deferred objects go anyway
    planned: set[str] = set()

    def drop(e: IndexedEntry, expired: bool) -> Iterator[_Planned]:
        nonlocal projected
        for joined, shard in enumerate([e, *(s for s in units[e.entry_id] if s is not e)]):
            if shard.entry_id in planned:
                continue
            planned.add(shard.entry_id)
            free = catalog.entry_free_bytes(shard, dropping)
            projected -= free
            # a joined shard counts as expired only if it is (it goes with its unit anyway)
            own = expired and (shard is e or now - shard.last_access > store.ttl_seconds)
            yield shard.entry_id, free, own, joined > 0
            _forget_if_removed(catalog, shard, dropping)

    if store.ttl_seconds > 0:
        for e in candidates:
            if now - e.last_access > store.ttl_seconds:
                yield from drop(e, True)
    over = projected > store.max_bytes or (draining and projected > store.low_watermark_bytes)
    # below the free-space floor: evict this much more, and an eighth of the floor beyond it
    # so that publications resume (they need the floor kept after their own bytes)
    short = store.free_space_deficit()
    short = short + store.min_free_bytes // 8 if short > 0 else 0
    if over or short > 0:
        start = projected
        for e in candidates:
            if (not over or projected <= store.low_watermark_bytes) and start - projected >= short:
                break
            yield from drop(e, False)


def _forget_if_removed(catalog: Catalog, entry: IndexedEntry, dropping: dict[str, int]) -> None:
    """The consumer really evicted ``entry``: its references are gone from the catalog's
    refcounts, so they must not be subtracted a second time."""
    if catalog.entry(entry.entry_id) is None:
        for page in entry.unique_pages:
            dropping[page.digest] -= 1


def _count_rest(plan, clock: PassClock) -> int:
    """How many more entries the plan holds (counted while time allows, then estimated)."""
    count = 0
    for _ in plan:
        count += 1
        if clock.now() >= clock.work_deadline:
            return count + 1  # at least one more; an estimate, the next pass re-plans
    return count


def pass_due(store: PageStore, clocks: Clock | None = None) -> bool:
    """Whether capacity, the free-space floor or TTL asks for a pass (cheap: the in-memory
    view, one statvfs and, with a TTL, the filesystem's now: ``Clock.fs_now``)."""
    cap = store.capacity()
    if cap.used_bytes > store.max_bytes:
        return True
    if store.collector.draining and cap.used_bytes > store.low_watermark_bytes:
        return True
    if store.free_space_deficit() > 0 and cap.entries:
        return True
    if store.ttl_seconds > 0:
        now = (store.clocks if clocks is None else clocks).fs_now(store.layout)
        return store.collector.any_expired(now, store.ttl_seconds)
    return False


class MaintenanceThread:
    """Runs passes off the caller's thread: at most one pass per ``interval_s`` (the gap is
    measured from the end of one pass to the start of the next, so a store that is always
    full still leaves the machine idle for ``interval_s`` between passes).

    ``nice`` is the thread's own niceness (None: inherit the process's). A pass's budget is
    wall time, so a thread niced below a saturated CPU waits for the CPU at every blocking
    call; see docs/SIZING.md before raising it. ``pace`` is called before each pass, which
    waits while it does (the connector holds maintenance there while the model prefills)."""

    def __init__(self, store: PageStore, budget: PassBudget, interval_s: float, *,
                 sweep_every_s: float = 30.0, nice: int | None = 10,
                 on_report: Callable[[PassReport], None] | None = None,
                 keep_reports: int = 10000, pace: Callable[[], None] | None = None) -> None:
        check_number("MaintenanceThread", "interval_s", interval_s, above=0, unit="seconds",
                     setting="SPARKCACHE_MAINTENANCE_INTERVAL_SECONDS")
        check_number("MaintenanceThread", "sweep_every_s", sweep_every_s, minimum=0, unit="seconds")
        if nice is not None:
            check_number("MaintenanceThread", "nice", nice, minimum=-20, maximum=19, integer=True)
        check_number("MaintenanceThread", "keep_reports", keep_reports, minimum=0, integer=True)
        self.store = store
        self.budget = budget
        self.interval_s = interval_s
        self.sweep_every_s = sweep_every_s
        self.nice = nice
        self.on_report = on_report
        self.pace = pace or (lambda: None)  # called before each pass; may wait
        self.reports: collections.deque[PassReport] = collections.deque(maxlen=keep_reports)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.snapshots = SnapshotWriter(store.layout)  # a large store's snapshot, now and then

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
        self.snapshots.stop()

    def _run(self) -> None:
        cpus.run_off_model_cpus()  # background work: not on the model's cores (cpus.py)
        if self.nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError):
                pass  # lowering niceness needs CAP_SYS_NICE: the thread keeps the process's
        last_end = -float("inf")
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                gap = last_end + self.interval_s - time.monotonic()
                if gap > 0 and self._stop.wait(gap):
                    break
                sweep_due = time.monotonic() - last_sweep >= self.sweep_every_s
                self.snapshots.maybe_start(self.store.capacity().entries)
                if not (sweep_due or pass_due(self.store)):
                    self._wake.wait(self.interval_s)
                    self._wake.clear()
                    continue
                self.pace()
                if self._stop.is_set():  # stopped while its pace held it
                    break
                report = run_pass(self.store, self.budget, sweep_shards=16 if sweep_due else 0)
                if sweep_due:
                    last_sweep = time.monotonic()
                last_end = time.monotonic()
                self.reports.append(report)
                if self.on_report is not None:
                    self.on_report(report)
        except BaseException as exc:  # surfaced through .error (the connector's maintenance_healthy gauge), not swallowed
            self.error = exc
            raise
