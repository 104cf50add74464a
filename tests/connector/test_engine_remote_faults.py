"""The shared tier's faults on the real CPU engine (issue 44): SeaweedFS SIGKILLed while an engine
uploads and while another fetches, and a flipped byte in a remote object. A SeaweedFS of this
module's own (its kills touch no other test), the tiny Llama at TP=1, every life in its own
process, rounds of one life on an emptied GPU prefix cache (contracts/engine_driver.py,
``"phases"``):

1. life A (root A, reaching the server through ``testing.cutting_proxy``, as B does): prompt D
   computed, published and uploaded; then prompt V is computed and published, and the server is
   SIGKILLed once part of one of V's objects has been PUT (its upload fails, counted, retried
   with backoff); A's local store verifies clean; the server is started again on its directory
   and A's upload of V completes; the bucket check finds both entries whole;
2. life B (an empty root, reaching the server through ``testing.cutting_proxy``): V restored
   from the bucket with output identical to A's computed one; then D is asked for, and the
   server is SIGKILLed once part of one of D's objects has been sent: the fetch fails (a miss,
   ``io_error``, within the fetch deadline), nothing of D is kept, D is recomputed with
   identical output, B's root verifies clean, B still stops (its drain is bounded);
3. one byte of one of D's remote objects flipped; life C (an empty root) asks for D: the fetch
   refuses it (``corrupt``) and removes it from the bucket, D is recomputed with identical output
   and published locally, and C's upload puts the object back: the bucket check is clean again.
"""

from __future__ import annotations

import time
import uuid

import obstore
import pytest

from sparkcache.store import PageStore
from sparkcache.store.remote_keys import RemoteKeys
from testing.cutting_proxy import CuttingProxy

from .conftest import metric, run_engine, stored_entry
from .test_engine_remote import BLOCK, D, REUSABLE, V, bucket_check, remote_extra

pytestmark = [pytest.mark.engine, pytest.mark.slow]

UPLOAD_WAIT_S = 120.0
CUT_AFTER_BYTES = 100_000  # into an object's response (the tiny Llama's are larger) when the server dies  # how long a test waits for an upload retried after a restart (its backoff)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testing.seaweedfs import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs-faults")) as s:
        yield s


def _wait_for_entries(server, prefix: str, n: int, timeout_s: float = UPLOAD_WAIT_S):
    """The bucket check, once it finds ``n`` entries whole (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = bucket_check(server, prefix)
        if (report.clean and report.entries >= n) or time.monotonic() > deadline:
            return report
        time.sleep(0.5)


def _record(result: dict, i: int = 0) -> dict:
    return result["results"][i]["kv_transfer_params"]["sparkcache"]


def _flip_remote_object(server, root, prefix: str) -> str:
    """One byte of the middle page object of D's entry flipped in the bucket; its key."""
    store = PageStore(str(root), read_only=True)
    m = stored_entry(store, D, BLOCK, REUSABLE // BLOCK).manifest
    key = RemoteKeys.of(prefix, "default", m.identity).object_key(m.pages[len(m.pages) // 2].digest)
    raw = server.raw_store()
    data = bytearray(obstore.get(raw, key).bytes())
    data[len(data) // 2] ^= 1
    obstore.put(raw, key, bytes(data), use_multipart=False)  # unconditional: the damage
    return key


@pytest.fixture(scope="module")
def lives(tiny_model, server, tmp_path_factory):
    prefix = f"faults/{uuid.uuid4().hex[:8]}"
    roots = {name: tmp_path_factory.mktemp(f"faults-{name}") for name in ("a", "b", "c")}
    env = server.endpoint.aws_env()
    base = {"model": tiny_model, "max_tokens": 16, "block_size": BLOCK, "connector": "sparkcache"}
    out: dict = {"roots": roots}

    # A and B reach the server through a proxy that kills it in the middle of an object's PUT
    # (A) or of an object's response (B)
    proxy = CuttingProxy(("127.0.0.1", server.ports["s3"])).start()

    def between_a(phase: int, _done: list[dict]) -> None:
        if phase == 1:  # D uploaded; V's first object PUT will be cut, the server killed there
            out["a_first_upload"] = _wait_for_entries(server, prefix, 1)
            proxy.arm(b"PUT ", b"/objects/", after_bytes=CUT_AFTER_BYTES, action=server.kill, request=True)
        else:  # V published, its upload cut and failing while the server is down; then back
            time.sleep(3)  # the upload's retries meet the dead server
            out["a_cut"], out["a_killed"] = list(proxy.cut), not server.running()
            out["a_verify_down"] = PageStore.verify_root(str(roots["a"]), "default")
            server.start()
            out["a_retried"] = _wait_for_entries(server, prefix, 2)

    a_extra = {**remote_extra(server, roots["a"], prefix), "remote_endpoint": proxy.url}
    a = run_engine({**base, "extra": a_extra, "phases": [{"prompts": [D]}, {"prompts": [V]}, {"prompts": [D]}]},
                   timeout=900, env=env, between=between_a)
    out["a"] = a["phases"]
    out["a_check"] = bucket_check(server, prefix)
    proxy.cut.clear()

    def between_b(_phase: int, _done: list[dict]) -> None:  # before D is asked for
        proxy.arm(b"GET ", b"/objects/", after_bytes=CUT_AFTER_BYTES, action=server.kill)

    b_extra = {**remote_extra(server, roots["b"], prefix), "remote_endpoint": proxy.url, "remote_drain_seconds": 1}
    try:
        b = run_engine({**base, "extra": b_extra, "phases": [{"prompts": [V]}, {"prompts": [D]}]},
                       timeout=900, env=env, between=between_b)
    finally:
        proxy.close()
    out["b"], out["b_log"], out["b_cut"], out["b_killed"] = b["phases"], b["log"], proxy.cut, not server.running()
    server.start()
    out["b_verify"] = PageStore.verify_root(str(roots["b"]), "default")
    out["b_check"] = bucket_check(server, prefix)

    out["flipped_key"] = _flip_remote_object(server, roots["a"], prefix)
    out["flipped_check"] = bucket_check(server, prefix)
    out["c"] = run_engine({**base, "prompts": [D], "extra": remote_extra(server, roots["c"], prefix)}, env=env)
    out["c_check"] = _wait_for_entries(server, prefix, 2)
    out["c_verify"] = PageStore.verify_root(str(roots["c"]), "default")
    return out


def test_a_killed_server_during_uploads_leaves_serving_and_the_local_store_whole(lives):
    """The server died with part of one of V's objects PUT: serving went on, A's store verifies."""
    first, down, last = lives["a"]
    assert lives["a_killed"] and len(lives["a_cut"]) == 1 and lives["a_cut"][0].startswith("PUT ") \
        and "/objects/" in lives["a_cut"][0], lives["a_cut"]
    assert lives["a_first_upload"].clean and lives["a_first_upload"].entries == 1, lives["a_first_upload"]
    assert [_record(p)["external_tokens"] for p in (first, down)] == [0, 0]
    assert _record(last)["external_tokens"] == REUSABLE  # served locally after the restart
    assert last["results"][0]["tokens"] == first["results"][0]["tokens"]
    assert lives["a_verify_down"].ok, lives["a_verify_down"].problems
    failures = sum(metric(p, "vllm:sparkcache_remote_upload_failures") for p in (down, last))
    assert failures >= 1


def test_after_the_restart_the_upload_is_retried_and_the_bucket_holds_no_broken_entry(lives):
    retried = lives["a_retried"]
    assert retried.clean and retried.entries == 2, retried
    assert lives["a_check"].clean and lives["a_check"].entries == 2 and lives["a_check"].dangling_pointers == 0


def test_the_entry_uploaded_after_the_restart_restores_with_identical_output(lives):
    restored = lives["b"][0]
    rec = _record(restored)
    assert (rec["external_tokens"], rec["remote_tokens"]) == (REUSABLE, REUSABLE), rec
    assert restored["results"][0]["tokens"] == lives["a"][1]["results"][0]["tokens"]


def test_a_killed_server_during_a_fetch_is_a_miss_and_the_request_recomputes(lives):
    """The server died with an object's response part sent: the fetch is a miss, nothing of
    the entry is kept locally, the request recomputes with identical output."""
    missed = lives["b"][1]
    assert lives["b_killed"] and len(lives["b_cut"]) == 1 and "/objects/" in lives["b_cut"][0], lives["b_cut"]
    rec = _record(missed)
    assert (rec["external_tokens"], rec["recomputed_tokens"], rec["complete"]) == (0, 2100, True), rec
    assert missed["results"][0]["tokens"] == lives["a"][0]["results"][0]["tokens"]
    assert metric(missed, "vllm:sparkcache_remote_request_fetches", outcome="miss") == 1
    assert metric(missed, "vllm:sparkcache_remote_fetch_misses", reason="io_error") >= 1
    assert lives["b_verify"].ok, lives["b_verify"].problems
    assert lives["b_check"].clean, lives["b_check"]
    # B recomputed and published D with the server dead: its stop waited its drain, no longer
    assert "not uploaded to the shared tier within SPARKCACHE_REMOTE_DRAIN_SECONDS=1" in lives["b_log"]


def test_a_flipped_byte_in_a_remote_object_is_refused_recomputed_and_put_back(lives):
    assert not lives["flipped_check"].clean  # the damage is there before life C
    c = lives["c"]
    rec = _record(c)
    assert (rec["external_tokens"], rec["recomputed_tokens"]) == (0, 2100), rec
    assert c["results"][0]["tokens"] == lives["a"][0]["results"][0]["tokens"]
    assert metric(c, "vllm:sparkcache_remote_fetch_misses", reason="corrupt") == 1
    assert metric(c, "vllm:sparkcache_remote_corrupt_removed") == 1
    # C published D again and uploaded it: the object is back, the bucket whole
    assert lives["c_check"].clean and lives["c_check"].entries == 2, lives["c_check"]
    assert lives["c_verify"].ok, lives["c_verify"].problems
