"""Pass pacing: a unit starts only when its running cost estimate fits before 80% of the
budget, estimates follow measured wall time (and decay when skipped), lock wait counts."""

import os
import time

from sparkcache.store import PassBudget, run_pass
from sparkcache.store.locks import exclusive_lock
from sparkcache.store.pacing import DECAY, PassClock, UnitCosts
from store_helpers import IDENT, conv_keys, conv_pages, open_store


def test_clock_fits_only_what_its_estimate_allows():
    costs = UnitCosts()
    costs.estimate["unlink_batch"] = 0.030
    clock = PassClock(costs, budget_ms=50.0)  # works until 40 ms
    assert clock.fits("unlink_batch")
    assert not clock.fits("unlink_batch", reserve=0.015)
    costs.estimate["unlink_batch"] = 0.045
    assert not clock.fits("unlink_batch")
    clock.finish()  # skipped for time: the estimate decays, so the work is retried later
    assert abs(costs.estimate["unlink_batch"] - 0.045 * DECAY) < 1e-9


def test_clock_records_wall_time_of_a_unit():
    costs = UnitCosts()
    clock = PassClock(costs, budget_ms=100.0)
    clock.run("fsync", lambda: time.sleep(0.02))
    assert costs.estimate["fsync"] >= 0.02 and clock.units == 1
    assert clock.longest_unit_s >= 0.02


def _over_max_store(tmp_path, n=30):
    store = open_store(tmp_path, page_blocks=16, max_bytes=1 << 30, low_watermark_bytes=0)
    for conv in range(n):
        assert store.publish(IDENT, conv_keys(conv, 16), conv_pages(conv, 16, 16)).ok
    store.max_bytes = 4096  # everything is now over max
    return store


def test_pass_does_not_start_a_unit_it_expects_to_overrun(tmp_path):
    store = _over_max_store(tmp_path)
    store.collector.unit_costs.estimate["unlink_batch"] = 1.0  # "an unlink batch takes a second"
    report = run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 40, max_ms=50))
    assert report.stopped_by == "time" and report.entries_evicted == 0
    assert report.duration_s < 0.050 * 1.2, report
    assert report.remaining_entries > 0
    # the skipped estimate decays pass by pass until the work fits again
    for _ in range(30):
        report = run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 40, max_ms=50))
        if report.entries_evicted:
            break
    assert report.entries_evicted > 0


def test_lock_wait_counts_and_is_capped_at_a_fifth_of_the_budget(tmp_path):
    store = _over_max_store(tmp_path, n=3)
    with exclusive_lock(store.layout, 1.0):  # another collector holds it
        report = run_pass(store, PassBudget(max_ms=100))
    assert report.stopped_by == "lock"
    assert 0.015 <= report.duration_s < 0.100, report
    assert os.path.exists(store.layout.gc_lock_path)
