"""Pass pacing: a unit starts only when its running cost estimate fits before 80% of the
budget, estimates follow measured time (and decay when skipped), lock wait counts.

Every test here runs on a fake clock (``FakeTimer``) and, for whole passes, a fake disk
whose units of work take a set number of fake seconds: what is asserted is the pacing
decision, never how fast this machine is."""

import pytest

from sparkcache.store import PassBudget, run_pass
from sparkcache.store import collector as collector_module
from sparkcache.store.locks import LockTimeout, exclusive_lock
from sparkcache.store.pacing import DECAY, LOCK_FRACTION, WORK_FRACTION, PassClock, UnitCosts
from store_helpers import IDENT, conv_keys, conv_pages, open_store


class FakeTimer:
    """Monotonic seconds that move only when a test (or the fake disk) says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _fake_disk(monkeypatch, timer: FakeTimer, unlink_batch_s: float, fsync_s: float) -> None:
    """A parallel batch of unlinks takes ``unlink_batch_s`` fake seconds, a round of fsyncs
    ``fsync_s``; the files are still really unlinked and synced."""

    def parallel_map(fn, items, pool="io"):
        timer.advance(unlink_batch_s)
        return [fn(x) for x in items]

    def sync_all(sync, items, pool="io"):
        timer.advance(fsync_s)
        for x in items:
            sync(x)

    monkeypatch.setattr(collector_module, "parallel_map", parallel_map)
    monkeypatch.setattr(collector_module, "sync_all", sync_all)


def test_clock_fits_only_what_its_estimate_allows():
    costs, timer = UnitCosts(), FakeTimer()
    costs.estimate["unlink_batch"] = 0.030
    clock = PassClock(costs, budget_ms=50.0, now=timer)  # works until 40 ms
    assert clock.fits("unlink_batch")
    assert not clock.fits("unlink_batch", reserve=0.015)
    timer.advance(0.015)  # the same unit, 15 ms into the pass, would end at 45 ms
    assert not clock.fits("unlink_batch")
    assert clock.fits("unlink_batch", reserve=-0.005)  # the deadline itself still fits
    costs.estimate["unlink_batch"] = 0.045
    clock.finish()  # skipped for time: the estimate decays, so the work is retried later
    assert costs.estimate["unlink_batch"] == pytest.approx(0.045 * DECAY)


def test_clock_records_the_time_of_a_unit_and_the_estimate_follows_it():
    costs, timer = UnitCosts(), FakeTimer()
    clock = PassClock(costs, budget_ms=100.0, now=timer)
    clock.run("fsync", lambda: timer.advance(0.020))
    assert costs.estimate["fsync"] == pytest.approx(0.020) and clock.units == 1
    assert clock.longest_unit_s == pytest.approx(0.020)
    clock.run("fsync", lambda: timer.advance(0.001))  # faster now: the estimate falls by DECAY
    assert costs.estimate["fsync"] == pytest.approx(0.020 * DECAY)
    clock.run("fsync", lambda: timer.advance(0.050))  # a spike raises it at once
    assert costs.estimate["fsync"] == pytest.approx(0.050) and costs.worst["fsync"] == pytest.approx(0.050)
    assert clock.units == 3 and clock.longest_unit_s == pytest.approx(0.050)
    with pytest.raises(OSError):  # a unit that fails still counts its time
        clock.run("shard", lambda: (timer.advance(0.007), (_ for _ in ()).throw(OSError("disk"))))
    assert costs.estimate["shard"] == pytest.approx(0.007) and clock.units == 4


def test_lock_timeout_is_a_fifth_of_the_budget_less_the_time_already_spent():
    timer = FakeTimer()
    clock = PassClock(UnitCosts(), budget_ms=100.0, now=timer)
    assert clock.lock_timeout() == pytest.approx(0.100 * LOCK_FRACTION)
    timer.advance(0.005)
    assert clock.lock_timeout() == pytest.approx(0.100 * LOCK_FRACTION - 0.005)
    timer.advance(0.100)
    assert clock.lock_timeout() == 0.0


def _over_max_store(tmp_path, n=30):
    store = open_store(tmp_path, page_blocks=16, max_bytes=1 << 30, low_watermark_bytes=0)
    for conv in range(n):
        assert store.publish(IDENT, conv_keys(conv, 16), conv_pages(conv, 16, 16)).ok
    store.max_bytes = 4096  # everything is now over max
    return store


def test_pass_does_not_start_a_unit_it_expects_to_overrun(tmp_path, monkeypatch):
    store = _over_max_store(tmp_path)
    timer = FakeTimer()
    _fake_disk(monkeypatch, timer, unlink_batch_s=1.0, fsync_s=0.0)  # "an unlink batch takes a second"
    costs = store.collector.unit_costs.estimate
    costs["unlink_batch"] = 1.0  # ... and the estimate knows it
    budget = PassBudget(max_entries=100, max_bytes=1 << 40, max_ms=50)
    report = run_pass(store, budget, timer=timer)
    assert report.stopped_by == "time" and report.entries_evicted == 0, report
    assert report.units == 1  # only the re-list of the manifests ran
    assert report.duration_s <= budget.max_ms / 1000 * WORK_FRACTION, report
    assert report.remaining_entries > 0
    # The skipped estimate decays pass by pass until a batch, the fsync after it and one
    # object unlink fit before the work deadline: no pass starts a batch before that.
    deadline = budget.max_ms / 1000 * WORK_FRACTION
    for _ in range(40):
        before = dict(costs)
        fits = 2 * before["unlink_batch"] + before["fsync"] <= deadline
        report = run_pass(store, budget, timer=timer)
        assert (report.entries_evicted > 0) == fits, (before, report)
        if fits:
            break
        assert costs["unlink_batch"] == pytest.approx(before["unlink_batch"] * DECAY)
    assert report.entries_evicted > 0


def test_pass_stops_starting_batches_when_the_next_no_longer_fits(tmp_path, monkeypatch):
    """Unlink batches of 6 ms and fsyncs of 4 ms against a 50 ms budget: each pass evicts
    some entries, stops on time with work left, and ends inside its budget (a pass that
    started a batch regardless of its estimate would not)."""
    store = _over_max_store(tmp_path, n=120)
    timer = FakeTimer()
    _fake_disk(monkeypatch, timer, unlink_batch_s=0.006, fsync_s=0.004)
    budget = PassBudget(max_entries=1000, max_bytes=1 << 40, max_ms=50)
    for _ in range(2):  # the estimates start from INITIAL_COSTS and follow the fake disk
        report = run_pass(store, budget, sweep_shards=0, timer=timer)
        assert report.stopped_by == "time" and report.remaining_entries > 0, report
        assert 0 < report.entries_evicted, report
        assert report.duration_s <= budget.max_ms / 1000 and not report.overran, report


def test_lock_wait_counts_and_is_capped_at_a_fifth_of_the_budget(tmp_path, monkeypatch):
    store = _over_max_store(tmp_path, n=3)
    timer = FakeTimer()
    asked = []

    def held_elsewhere(timeout_s):  # another collector holds the lock for the whole wait
        asked.append(timeout_s)
        timer.advance(timeout_s)
        raise LockTimeout("held")

    monkeypatch.setattr(store.collector, "exclusive", held_elsewhere)
    report = run_pass(store, PassBudget(max_ms=100), timer=timer)
    assert report.stopped_by == "lock" and report.entries_evicted == 0
    assert asked == [pytest.approx(0.100 * LOCK_FRACTION)]
    assert report.duration_s == pytest.approx(asked[0])  # the wait is part of the pass


def test_a_pass_gives_up_on_a_lock_another_process_holds(tmp_path):
    store = _over_max_store(tmp_path, n=3)
    with exclusive_lock(store.layout, 1.0):  # another collector holds it
        report = run_pass(store, PassBudget(max_ms=100))
    assert report.stopped_by == "lock" and report.entries_evicted == 0
    assert store.capacity().entries == 3
