"""An idle engine keeps stepping until the connector's last numbers left in a step's stats.

vLLM 0.32.0 collects connector stats only inside ``Scheduler.update_from_output`` (worker
stats from the model runner output, scheduler stats right after) and steps the engine only
while ``Scheduler.has_requests()``. A capture is published by the worker *after* the
request's last step, so without more steps its outcome and the store's new size never reach
``/metrics`` on an idle server. The connector's ``has_pending_push_work`` (part of
``has_requests``) stays true until every worker reported the capture settled in its worker
meta. Real Scheduler (full attention, so captures are planned), real store, synthetic
model outputs and worker reports.
"""

from __future__ import annotations

import random

from .scheduler_scenarios import finish_all, make_scheduler, request, step


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _connector_stats(scheduler) -> dict:
    stats = [eco.scheduler_stats for eco in scheduler.last_engine_outputs.values()
             if eco.scheduler_stats is not None]
    assert stats, "the step returned no scheduler stats"
    return stats[0].kv_connector_stats or {}


def test_idle_engine_steps_until_the_capture_settled(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    s.add_request(request("a", _prompt(200, 1)))
    finish_all(s)  # runs it to the end; the capture copy (finished_sending) reported
    side = s.connector._sched
    assert not s.requests and not side.awaiting_send
    assert "a" in side.unsettled
    assert s.has_requests(), "the engine would go idle before the publication is reported"
    step(s)  # nothing scheduled: the worker has not finished publishing yet
    assert s.has_requests()
    step(s, settled=["a"])
    assert not side.unsettled and not s.has_requests()


def test_attribution_counters_leave_with_the_finishing_step(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    s.add_request(request("b", _prompt(120, 2), max_tokens=1))
    seen = {}
    for _ in range(20):
        step(s, sending=set(s.connector._sched.awaiting_send))
        for k, v in (_connector_stats(s).get("counters") or {}).items():
            seen[k] = seen.get(k, 0) + v
        if not s.requests:
            break
    assert seen.get("attr_requests_complete") == 1
    assert seen.get("attr_recomputed_tokens") == 120
    assert not s.connector._sched.counters.data


def test_a_lost_settle_report_stops_holding_the_engine(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    side = s.connector._sched
    side.settle_timeout_s = -1.0  # every settle deadline is already past, however fast the steps
    s.add_request(request("c", _prompt(200, 3)))
    finish_all(s)
    assert not s.has_requests()  # deadline passed: warned, not waited for
