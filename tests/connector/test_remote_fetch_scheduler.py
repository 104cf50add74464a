"""The scheduler half fetching from the shared tier, on vLLM 0.32.0's real Scheduler: a local
miss starts a fetch of every rank's shard off the scheduler's thread and the request is skipped
(``get_num_new_matched_tokens`` answers None) until the fetch ended; then the entry is local and
offered, and the record says ``remote_tokens``. With the server hung (SIGSTOP), every step stays
short and the request is scheduled, to recompute, once the fetch deadline passed; an engine with
nothing else to do waits for the fetch a little each step instead of stepping back to back, and
one with running requests never does.

Real parts: vLLM's Scheduler, the connector's scheduler half, stores on disk, the tests'
SeaweedFS on 127.0.0.1. The worker's reports are synthetic (``scheduler_scenarios``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import uuid

from sparkcache.store.remote_tier import RemoteTier
from sparkcache.store.s3_location import S3Location
from testing.vllm_scheduler import step

from .scheduler_scenarios import finish_all, make_scheduler, record_of, request, store_prefix
from .test_worker_upload import _aws

DEADLINE_S = 3.0


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _remote(server, prefix: str) -> dict:
    return {"remote_bucket": server.endpoint.bucket, "remote_endpoint": server.endpoint.url,
            "remote_prefix": prefix, "remote_fetch_deadline_seconds": DEADLINE_S, "remote_retries": 0}


def _uploaded(tmp_path, server, prefix: str, prompt: list[int]) -> int:
    """``prompt``'s whole blocks published in a store of its own and uploaded; the tokens stored."""
    a = make_scheduler(str(tmp_path / "a"), hybrid=False)
    stored = store_prefix(a, prompt)
    store = a.connector._sched.stores[0]
    tier = RemoteTier(S3Location(server.endpoint.bucket, prefix, server.endpoint.url), store)
    try:
        assert all(tier.upload(e.entry_id) for e in store.entries())
        assert tier.uploads.wait_idle(30), tier.uploads.last_error
    finally:
        tier.close()
    return stored


def _step(s):
    """One engine step; the worker reports this step's synchronous loads placed."""
    from sparkcache.connector.connector import SparkcacheWorkerMetadata

    def report(out) -> dict:
        loaded = [p.req_id for p in out.kv_connector_metadata.loads]
        return {"kv_connector_worker_meta": SparkcacheWorkerMetadata([], loaded, [])} if loaded else {}

    started = time.monotonic()
    out = step(s, 7, on_scheduled=report)
    return out, time.monotonic() - started


def _until_scheduled(s, req_id: str, timeout_s: float = 30.0):
    """Step until ``req_id`` is scheduled: (that step's output, the steps before it, the longest step)."""
    skipped, longest = 0, 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out, took = _step(s)
        longest = max(longest, took)
        if req_id in out.num_scheduled_tokens:
            return out, skipped, longest
        skipped += 1
        time.sleep(0.01)
    raise AssertionError(f"{req_id} not scheduled within {timeout_s} s")


@contextlib.contextmanager
def _hung(server):
    """The server stopped (SIGSTOP) for the block: every request to it waits."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def _fetching(tmp_path, server, monkeypatch, **kwargs):
    """A scheduler on an empty root and a bucket prefix of its own, its fetches given 30 s."""
    _aws(monkeypatch, server)
    return make_scheduler(str(tmp_path / "b"), hybrid=False, **kwargs,
                          extra={**_remote(server, f"sched/{uuid.uuid4().hex[:8]}"), "remote_fetch_deadline_seconds": 30})


def test_a_local_miss_is_fetched_while_the_request_waits_then_restored(tmp_path, seaweedfs, monkeypatch):
    _aws(monkeypatch, seaweedfs)
    prefix = f"sched/{uuid.uuid4().hex[:8]}"
    prompt = _prompt(200, 3)
    stored = _uploaded(tmp_path, seaweedfs, prefix, prompt)
    s = make_scheduler(str(tmp_path / "b"), hybrid=False, extra=_remote(seaweedfs, prefix))
    s.add_request(request("r", prompt))
    out, skipped, _ = _until_scheduled(s, "r")
    assert skipped >= 1  # the step that started the fetch scheduled nothing of it
    assert out.num_scheduled_tokens == {"r": 200 - stored}  # the fetched entry, offered from local
    finish_all(s)
    rec = record_of(s, "r")
    assert (rec["external_tokens"], rec["remote_tokens"], rec["failed_restores"]) == (stored, stored, 0), rec
    side = s.connector._sched
    assert side.stores[0].capacity().entries == 1 and not side.remote.pending()


def test_a_hung_server_never_holds_the_scheduler_and_the_request_recomputes_after_the_deadline(
        tmp_path, seaweedfs, monkeypatch):
    _aws(monkeypatch, seaweedfs)
    prefix = f"sched/{uuid.uuid4().hex[:8]}"
    prompt = _prompt(200, 4)
    s = make_scheduler(str(tmp_path / "b"), hybrid=False, extra=_remote(seaweedfs, prefix))
    s.add_request(request("r", prompt))
    with _hung(seaweedfs):
        started = time.monotonic()
        out, skipped, longest = _until_scheduled(s, "r")
        waited = time.monotonic() - started
    assert longest < DEADLINE_S / 4, longest  # no step waited on the network
    assert skipped >= 1 and DEADLINE_S * 0.9 <= waited < DEADLINE_S + 5, (skipped, waited)
    assert out.num_scheduled_tokens == {"r": 200}  # nothing local: recomputed
    finish_all(s)
    rec = record_of(s, "r")
    assert (rec["external_tokens"], rec["remote_tokens"], rec["recomputed_tokens"]) == (0, 0, 200), rec


def _steps_within(s, seconds: float) -> int:
    """Engine steps, one after another with nothing between (vLLM's busy loop), for ``seconds``."""
    n, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        _step(s)
        n += 1
    return n


def test_an_engine_with_nothing_else_to_do_waits_for_the_fetch_instead_of_spinning(tmp_path, seaweedfs, monkeypatch):
    """vLLM steps again at once while a request is skipped: with nothing else scheduled, every
    step would be an empty forward on every worker, as fast as they go, taking the CPUs the fetch
    (and the server it reads) needs. An idle step waits for the fetch a while instead."""
    from sparkcache.connector.scheduler_side import IDLE_FETCH_WAIT_S

    s = _fetching(tmp_path, seaweedfs, monkeypatch)
    s.add_request(request("r", _prompt(200, 5)))
    seconds = 1.0
    with _hung(seaweedfs):
        _step(s)  # starts the fetch
        steps = _steps_within(s, seconds)
    assert steps <= seconds / IDLE_FETCH_WAIT_S + 5, steps
    remote = s.connector._sched.remote
    assert remote.running("r") and remote.idle_waits >= steps  # still fetching, and every step waited


def test_a_data_parallel_engine_never_waits_for_a_fetch(tmp_path, seaweedfs, monkeypatch):
    """Data-parallel engines step in lockstep: an idle one that waited would hold the others."""
    s = _fetching(tmp_path, seaweedfs, monkeypatch, data_parallel_size=2)
    s.add_request(request("r", _prompt(200, 8)))
    with _hung(seaweedfs):
        for _ in range(20):
            _step(s)
    remote = s.connector._sched.remote
    assert remote.running("r") and remote.idle_waits == 0


def test_a_step_with_running_requests_never_waits_for_a_fetch(tmp_path, seaweedfs, monkeypatch):
    s = _fetching(tmp_path, seaweedfs, monkeypatch)
    s.add_request(request("busy", _prompt(40, 6), max_tokens=100_000))
    _until_scheduled(s, "busy")  # its own fetch missed: it runs, and every later step decodes it
    s.add_request(request("r", _prompt(200, 7)))
    remote = s.connector._sched.remote
    waits = remote.idle_waits
    with _hung(seaweedfs):
        for _ in range(50):
            _step(s)
    assert remote.running("r") and remote.idle_waits == waits
