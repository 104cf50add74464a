"""Wall-clock pacing of one maintenance pass: a deadline with a margin, and running estimates
of what each kind of unit of work costs, so a pass starts a unit only when it expects to
finish it in time.

A pass's budget is wall time from its start to its end (lock wait, waiting on the disk and
being preempted all count). The pass plans to end by ``WORK_FRACTION`` of the budget, so a
unit that costs more than its estimate still ends inside the budget. A unit is the smallest
thing the pass does between two checks: one parallel batch of unlinks (all of a batch run
at once, so a batch costs about one unlink's latency), one round of directory fsyncs, one
re-list of the manifests, one object shard swept.

Estimates are a decaying maximum of the unit's recent wall times (a spike raises it at
once; it falls by ``DECAY`` per later sample). A unit skipped for lack of time is decayed
too, so one slow sample cannot stop that kind of work for good.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

DECAY = 0.8
WORK_FRACTION = 0.8  # plan to finish by this share of the budget; the rest is the margin
LOCK_FRACTION = 0.2  # longest a pass waits for the gc lock, as a share of the budget

# Starting estimates (seconds), replaced by measurements after the first samples.
INITIAL_COSTS = {"fsync": 0.010, "unlink_batch": 0.008, "refresh": 0.003, "shard": 0.004}


class UnitCosts:
    """Per-kind running estimate of a unit's wall time. Lives on the store, across passes."""

    def __init__(self) -> None:
        self.estimate: dict[str, float] = dict(INITIAL_COSTS)
        self.worst: dict[str, float] = {k: 0.0 for k in INITIAL_COSTS}

    def record(self, kind: str, seconds: float) -> None:
        self.estimate[kind] = max(seconds, self.estimate.get(kind, 0.0) * DECAY)
        self.worst[kind] = max(self.worst.get(kind, 0.0), seconds)

    def decay(self, kind: str) -> None:
        self.estimate[kind] = self.estimate.get(kind, 0.0) * DECAY


class PassClock:
    """The deadline of one pass and the test "does one more unit of this kind fit?"."""

    def __init__(self, costs: UnitCosts, budget_ms: float, *, start: float | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.costs = costs
        self.now = now  # the pass's clock: monotonic seconds (a test may pass a fake one)
        self.start = now() if start is None else start
        self.budget_s = budget_ms / 1000.0
        self.work_deadline = self.start + self.budget_s * WORK_FRACTION
        self.skipped: set[str] = set()
        self.units = 0
        self.longest_unit_s = 0.0

    def lock_timeout(self) -> float:
        return max(self.budget_s * LOCK_FRACTION - (self.now() - self.start), 0.0)

    def fits(self, kind: str, reserve: float = 0.0) -> bool:
        """Whether a unit of ``kind`` is expected to end before the work deadline, with
        ``reserve`` seconds left over for work that must follow it."""
        if self.now() + self.costs.estimate.get(kind, 0.0) + reserve <= self.work_deadline:
            return True
        self.skipped.add(kind)
        return False

    def run(self, kind: str, fn: Callable[[], T]) -> T:
        """Run one unit and record its wall time (it counts, whatever it was spent on:
        disk, lock or CPU wait)."""
        t0 = self.now()
        try:
            return fn()
        finally:
            took = self.now() - t0
            self.costs.record(kind, took)
            self.units += 1
            self.longest_unit_s = max(self.longest_unit_s, took)

    def finish(self) -> None:
        """End of the pass: decay the estimates of kinds that were skipped for time."""
        for kind in self.skipped:
            self.costs.decay(kind)


def runqueue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux
    ``/proc/thread-self/schedstat``); 0.0 where that is not available."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0
