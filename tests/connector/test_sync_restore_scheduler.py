"""Synchronous restores (``sync_loads``, attention-only single-group models) on vLLM's real
Scheduler with sparkcache's real scheduler-side connector and a real on-disk store; the
model outputs and the worker's reports (worker meta, invalid blocks) are synthetic.

The request is scheduled in the step that plans its load (no WAITING_FOR_REMOTE_KVS step);
a failed load is reported as invalid blocks, vLLM discards the step's output and recomputes,
and the attribution record moves the tokens from external to recomputed."""

from __future__ import annotations

import random

from testing.vllm_scheduler import step

from .scheduler_scenarios import BS, finish_all, make_scheduler, record_of, request, store_prefix


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _step(s, *, loaded=(), fail: str | None = None, token_id: int = 7):
    """One engine step with synthetic model outputs; the worker reports ``loaded`` as placed,
    and ``fail``'s synchronous load as failed (its plan's blocks invalid, as the worker does)."""
    from sparkcache.connector.connector import SparkcacheWorkerMetadata

    def invalid_blocks(out) -> dict:
        if fail is None:
            return {}
        (plan,) = [p for p in out.kv_connector_metadata.loads if p.req_id == fail]
        return {"invalid_block_ids": set(plan.block_ids[0])}

    meta = SparkcacheWorkerMetadata([], list(loaded), [fail] if fail is not None else [])
    return step(s, token_id, on_scheduled=invalid_blocks, kv_connector_worker_meta=meta)


def test_sync_restore_is_scheduled_in_the_same_step_and_credited(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    assert s.connector._sched.sync_loads
    prompt = _prompt(200, 1)
    stored = store_prefix(s, prompt)  # 192 tokens (12 blocks)
    r = request("a", prompt)
    s.add_request(r)
    out = _step(s, loaded={"a"})
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"a": 200 - stored}
    (plan,) = out.kv_connector_metadata.loads
    assert plan.sync and len(plan.block_ids[0]) == stored // BS
    # the worker reads the pages the scheduler's lookup found (no second lookup)
    assert plan.stored is not None and plan.stored.first_page == 0 and plan.stored.block_count == stored // BS
    assert r.status.name == "RUNNING" and r.num_output_tokens == 1
    finish_all(s)
    rec = record_of(s, "a")
    assert rec == {**rec, "local_hit_tokens": 0, "external_tokens": stored, "recomputed_tokens": 200 - stored,
                   "complete": True, "failed_restores": 0}


def test_failed_sync_restore_is_recomputed_and_attributed(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(200, 2)
    store_prefix(s, prompt)
    r = request("a", prompt)
    s.add_request(r)
    first = _step(s, fail="a")
    assert first.has_sync_kv_loads
    assert r.num_output_tokens == 0 and r.num_computed_tokens == 0  # output discarded, recompute all
    nxt = _step(s)
    assert nxt.num_scheduled_tokens == {"a": 200} and not nxt.kv_connector_metadata.loads
    finish_all(s)
    rec = record_of(s, "a")
    assert rec["external_tokens"] == 0 and rec["failed_restores"] == 1
    assert rec["recomputed_tokens"] == 200 and rec["complete"]
    assert rec["local_hit_tokens"] + rec["external_tokens"] + rec["recomputed_tokens"] == 200


def test_sync_loads_off_keeps_the_asynchronous_path(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False, extra={"sync_loads": False})
    prompt = _prompt(200, 3)
    store_prefix(s, prompt)
    r = request("a", prompt)
    s.add_request(r)
    out = _step(s)
    assert not out.has_sync_kv_loads and r.status.name == "WAITING_FOR_REMOTE_KVS"


def test_a_sync_restore_of_a_request_that_finishes_in_that_step_is_counted(tmp_path):
    # vLLM frees a request that finished (here: one output token) before it hands the step's
    # connector output to the scheduler side, so the worker's sync_loaded report arrives
    # after request_finished; the restore is still counted, once.
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(200, 4)
    stored = store_prefix(s, prompt)
    s.add_request(request("a", prompt, max_tokens=1))
    _step(s, loaded={"a"})
    assert not s.requests
    stats = [eco.scheduler_stats for eco in s.last_engine_outputs.values() if eco.scheduler_stats is not None]
    counters = {**((stats[0].kv_connector_stats or {}).get("counters") or {}), **s.connector._sched.counters.data}
    assert (counters.get("restores_ok"), counters.get("restored_tokens")) == (1, stored), counters
