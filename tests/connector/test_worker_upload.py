"""A writing worker with a shared tier (``SPARKCACHE_REMOTE_BUCKET``): what it publishes is
uploaded by the tier's thread, placed as the publisher is (off the CPUs vLLM pinned the worker to,
at the publisher's niceness), its counts shipped with the worker's stats; at close its pending
uploads get ``SPARKCACHE_REMOTE_DRAIN_SECONDS`` and no longer, whatever the remote store does.

Real parts: the worker half on torch KV tensors as vLLM lays them out, its store on disk, the
tests' SeaweedFS (testing/seaweedfs.py) on 127.0.0.1, real affinity and priorities.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.keys import BlockKeys
from sparkcache.store import cpus
from sparkcache.store.remote_bucket import RemoteBucket
from sparkcache.store.remote_check import remote_check
from sparkcache.store.s3_location import S3Location

from .test_worker_maintenance import BLOCK, BLOCKS_PER_ENTRY, _cpus_of, _placed, _stats_until, _worker


def _aws(monkeypatch, server) -> None:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")  # never the instance's role
    for name, value in server.endpoint.aws_env().items():
        monkeypatch.setenv(name, value)


def _capture(worker, req: str, seed: int) -> None:
    tokens = [seed] + list(range(BLOCKS_PER_ENTRY * BLOCK))
    worker.capture(CapturePlan(req, BlockKeys(BLOCK).upto(tokens, BLOCKS_PER_ENTRY), 0,
                               [list(range(BLOCKS_PER_ENTRY))]))


def test_a_writing_worker_uploads_what_it_publishes_off_the_model_s_cpus(tmp_path, seaweedfs, monkeypatch):
    _aws(monkeypatch, seaweedfs)
    prefix = f"worker/{uuid.uuid4().hex[:8]}"
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"needs two CPUs to tell them apart, this process has {sorted(allowed)}"
    model, rest = {min(allowed)}, allowed - {min(allowed)}
    os.sched_setaffinity(0, model)  # as vLLM pins the worker before the connector starts
    try:
        worker = _worker(tmp_path / "store", "read-write", remote_bucket=seaweedfs.endpoint.bucket,
                         remote_endpoint=seaweedfs.endpoint.url, remote_prefix=prefix)
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        _capture(worker, "req-0", 1)
        counters: dict[str, float] = {}
        _stats_until(worker, counters, {}, lambda: counters.get("remote_uploads_done", 0) == 1)
        threads = {t.name: t for t in threading.enumerate()}
        _placed(threads, ("sparkcache-upload",), rest)
        assert _cpus_of(threads["sparkcache-upload"]) == rest == _cpus_of(threads["sparkcache-publisher"])
        nice = os.getpriority(os.PRIO_PROCESS, threads["sparkcache-upload"].native_id)
        assert nice == max(os.getpriority(os.PRIO_PROCESS, 0), cpus.PUBLISH_NICE)
        assert counters["remote_upload_bytes"] > 0 and not counters.get("remote_upload_failures")
    finally:
        worker.close()
    bucket = RemoteBucket(S3Location(seaweedfs.endpoint.bucket, prefix, seaweedfs.endpoint.url))
    try:
        report = remote_check(bucket, "default")
    finally:
        bucket.close()
    assert report.clean and report.entries == 1, report


def test_close_gives_pending_uploads_the_drain_bound_and_no_longer(tmp_path, seaweedfs, monkeypatch, caplog):
    """Nothing listens at the endpoint: the upload fails and waits for its retry; close returns
    within ``SPARKCACHE_REMOTE_DRAIN_SECONDS`` (and the tier's stop), saying what it left."""
    from testing.seaweedfs import free_ports

    _aws(monkeypatch, seaweedfs)
    (port,) = free_ports(1)
    worker = _worker(tmp_path / "store", "read-write", remote_bucket=seaweedfs.endpoint.bucket,
                     remote_endpoint=f"http://127.0.0.1:{port}", remote_prefix="worker/dead",
                     remote_retries=0, remote_drain_seconds=1)
    _capture(worker, "req-0", 2)
    counters: dict[str, float] = {}
    _stats_until(worker, counters, {}, lambda: counters.get("remote_upload_failures", 0) >= 1)
    with caplog.at_level(logging.WARNING, logger="sparkcache.connector"):
        started = time.monotonic()
        worker.close()
        took = time.monotonic() - started
    assert took < 1 + 5, took  # the drain bound, and the upload under way is not waited past it
    assert any("SPARKCACHE_REMOTE_DRAIN_SECONDS=1" in r.getMessage() for r in caplog.records), caplog.text
    assert worker.store.capacity().entries == 1  # published locally all the same
