"""Attribution on vLLM's real Scheduler (hybrid attention + Mamba align, retention 0) with
sparkcache's real scheduler-side connector and a real on-disk store; model outputs and the
workers' transfer reports are synthetic. In every case the three numbers sum to the prompt
length, or the record says incomplete."""

from __future__ import annotations

import random



from .scheduler_scenarios import finish_all, make_scheduler, record_of, request, step, store_prefix


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _sums(rec: dict) -> bool:
    return rec["local_hit_tokens"] + rec["external_tokens"] + rec["recomputed_tokens"] == rec["prompt_tokens"]


def test_consumed_restore_is_credited_as_external(tmp_path):
    s = make_scheduler(str(tmp_path))
    prompt = _prompt(200, 1)
    stored = store_prefix(s, prompt)  # 192 tokens (12 blocks)
    r = request("a", prompt)
    s.add_request(r)
    step(s)
    assert r.status.name == "WAITING_FOR_REMOTE_KVS"
    step(s, recving={"a"})
    finish_all(s)
    rec = record_of(s, "a")
    assert rec == {**rec, "local_hit_tokens": 0, "external_tokens": stored, "recomputed_tokens": 200 - stored,
                   "complete": True, "failed_restores": 0}
    assert _sums(rec)


def test_restore_that_fails_after_being_offered_recomputes(tmp_path):
    s = make_scheduler(str(tmp_path))
    prompt = _prompt(200, 2)
    store_prefix(s, prompt)
    r = request("a", prompt)
    s.add_request(r)
    step(s)
    assert r.status.name == "WAITING_FOR_REMOTE_KVS"
    step(s, failed={"a"})  # the worker refused it (corrupt page): finished + failed
    finish_all(s)
    rec = record_of(s, "a")
    assert rec["external_tokens"] == 0 and rec["failed_restores"] == 1
    assert rec["recomputed_tokens"] == 200 and rec["complete"] and _sums(rec)


def test_abort_while_restore_in_flight_is_incomplete_and_frees_on_late_completion(tmp_path):
    from vllm.v1.request import RequestStatus

    s = make_scheduler(str(tmp_path))
    prompt = _prompt(200, 3)
    store_prefix(s, prompt)
    r = request("a", prompt)
    s.add_request(r)
    step(s)
    assert r.status.name == "WAITING_FOR_REMOTE_KVS"
    used = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    rec = record_of(s, "a")
    assert not rec["complete"] and rec["reason"].startswith("finished_before_prefill")
    assert _sums(rec) and rec["external_tokens"] == 0
    # blocks stay held while the load may still write into them
    assert "a" in s.requests and s.connector.has_pending_block_frees()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == used
    step(s, recving={"a"})  # the late completion frees them
    assert "a" not in s.requests and not s.connector.has_pending_block_frees()


def test_two_requests_share_one_restored_prefix(tmp_path):
    s = make_scheduler(str(tmp_path))
    common = _prompt(192, 4)
    stored = store_prefix(s, common)
    a, b = request("a", common + _prompt(40, 5)), request("b", common + _prompt(56, 6))
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s, recving={"a", "b"})
    finish_all(s)
    ra, rb = record_of(s, "a"), record_of(s, "b")
    assert ra["external_tokens"] == stored and rb["external_tokens"] == stored
    assert ra["recomputed_tokens"] == 40 and rb["recomputed_tokens"] == 56
    assert _sums(ra) and _sums(rb) and ra["complete"] and rb["complete"]
    # a third request after them: whatever vLLM finds locally is credited as local (the
    # hybrid local hit needs the Mamba state too); anything beyond it is restored again
    c = request("c", common + _prompt(24, 7))
    s.add_request(c)
    admitted = {}
    reported = False
    for _ in range(50):
        report = c.status.name == "WAITING_FOR_REMOTE_KVS" and not reported
        reported |= report
        out = step(s, recving={"c"} if report else ())
        for n in out.scheduled_new_reqs:
            admitted[n.req_id] = n.num_computed_tokens
        if "c" in admitted:
            break
    finish_all(s)
    rc = record_of(s, "c")
    assert rc["local_hit_tokens"] + rc["external_tokens"] == admitted["c"] and _sums(rc) and rc["complete"]


def test_preemption_in_the_middle_of_a_prefill(tmp_path):
    # 18 blocks, 24-token chunks: "victim" (200 tokens) is preempted by the decoding
    # "long" after 192 of its 200 prompt tokens were computed (found by a sweep; the
    # assertions below check that it really happened mid-prefill).
    s = make_scheduler(str(tmp_path), num_blocks=18, max_num_batched_tokens=24)
    long = request("long", _prompt(15, 8), max_tokens=200)
    victim = request("victim", _prompt(200, 9), max_tokens=2)
    s.add_request(long)
    for _ in range(3):
        step(s)
    s.add_request(victim)
    admitted: list[int] = []
    preempted_at = None
    for _ in range(800):
        before = (victim.num_preemptions, victim.num_computed_tokens)
        out = step(s)
        if victim.num_preemptions > before[0] and preempted_at is None:
            preempted_at = before[1]
        for n in out.scheduled_new_reqs:
            if n.req_id == "victim":
                admitted.append(n.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid == "victim" and rid in (cached.resumed_req_ids or ()):
                admitted.append(cached.num_computed_tokens[i])
        if not s.requests:
            break
    finish_all(s)
    assert victim.num_preemptions == 1 and preempted_at is not None and 0 < preempted_at < 200
    rec = record_of(s, "victim")
    assert rec["preemptions"] == 1 and rec["admissions"] == 2 and rec["complete"] and _sums(rec), str(rec)
    # the record describes the admission that completed the prefill: its local hit is
    # what vLLM had computed (cached) when it re-admitted the request
    assert len(admitted) == 2 and rec["local_hit_tokens"] == admitted[-1]
    assert rec["external_tokens"] == 0 and rec["recomputed_tokens"] == 200 - admitted[-1]
