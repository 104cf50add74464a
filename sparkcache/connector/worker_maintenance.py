"""The writing worker's store maintenance, and its numbers for vLLM's stats.

A worker that publishes (read-write, store-only) keeps its rank's store under max_bytes
(above it new publications are refused): the store's ``MaintenanceThread`` runs bounded
passes at the process's own priority (a niced thread misses its wall-clock budget on a
saturated CPU; docs/SIZING.md), at least ``maintenance_interval_seconds`` apart and woken
after each publication. Each pass is folded into the counters and gauges the worker ships
with its next stats, with the waits for the store's lock that gave up meanwhile (counted by
the store, ``locks.take_lock_timeouts``; only long ones are logged, rarely).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from sparkcache.store import MaintenanceThread, PassBudget, PassReport
from sparkcache.store.locks import take_lock_timeouts

from .samples import Samples, add_count

if TYPE_CHECKING:  # for readers and type checkers
    from sparkcache.settings import Settings
    from sparkcache.store import PageStore

logger = logging.getLogger("sparkcache.connector")


class WorkerMaintenance:
    def __init__(self, store: PageStore, settings: Settings, pace: Callable[[], None] | None = None) -> None:
        """``pace``: called before each pass, which waits while it does."""
        self.root = settings.root
        self.layout = store.layout
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self.samples = Samples()  # pass durations, for the histogram
        self._error_logged = False
        self.thread = MaintenanceThread(
            store, PassBudget.from_settings(settings), settings.maintenance_interval_seconds,
            nice=None, on_report=self._on_pass, keep_reports=100, pace=pace).start()

    def trigger(self) -> None:
        self.thread.trigger()

    def stop(self) -> None:
        self.thread.stop()

    def _on_pass(self, report: PassReport) -> None:
        """Runs on the maintenance thread: fold one pass into the next stats."""
        self.samples.add("maintenance_pass_seconds", report.duration_s)
        evicted = report.entries_evicted + report.entries_expired
        with self._lock:
            add_count(self._counters, "evicted_entries", evicted)
            add_count(self._counters, "bytes_reclaimed", report.bytes_reclaimed)
            add_count(self._counters, "maintenance_passes", 1)
            add_count(self._counters, "maintenance_overrun", int(report.overran))
            add_count(self._counters, "maintenance_stopped_lock", int(report.stopped_by == "lock"))
            add_count(self._counters, "maintenance_stopped_error", int(report.stopped_by == "error"))
            add_count(self._counters, "maintenance_stopped_unknown", int(report.stopped_by == "unknown"))
            self._gauges.update(maintenance_last_pass_duration_seconds=report.duration_s,
                                maintenance_remaining_entries=report.remaining_entries)

    def take(self) -> tuple[dict, dict]:
        """Counter deltas and gauges since the last call (the health gauge every time)."""
        error = self.thread.error
        if error is not None and not self._error_logged:
            self._error_logged = True
            logger.error("sparkcache: maintenance of %s stopped on %r; the store is no longer kept "
                         "under max_bytes and publications will be refused once it is full. Fix the "
                         "cause, run `sparkcache gc --root %s`, then restart the server.",
                         self.root, error, self.root)
        with self._lock:
            counters, self._counters = self._counters, {}
            gauges, self._gauges = self._gauges, {}
        for kind, n in take_lock_timeouts(self.layout).items():  # the passes' and publications'
            add_count(counters, "lock_timeouts_" + kind, n)
        gauges["maintenance_healthy"] = 0.0 if error is not None else 1.0
        return counters, gauges
