"""A writing worker keeps its store under max_bytes: the store's maintenance thread runs in
the connector, and its passes reach vLLM's stats (evictions, bytes reclaimed, pass gauges).

Real parts: vLLM 0.32.0's KV cache config types, torch KV tensors laid out as vLLM hands
them to the connector (blocks at dim 0), sparkcache's worker half and its store on disk.
The scheduler half is not involved: the capture plans are the ones it would send.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import time

import pytest
import torch

from sparkcache.connector.connector import _open_store
from sparkcache.connector.keys import BlockKeys
from sparkcache.connector.kv_layout import describe_kv_layout
from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.worker_side import WorkerSide
from sparkcache.metrics import COUNTER_KEYS, RANK_GAUGE_KEYS
from sparkcache.settings import load_settings
from sparkcache.store import Identity, PageStore
from sparkcache.store import cpus, layout
from sparkcache.store.maintenance import pass_due

BLOCK = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 64
BLOCKS_PER_ENTRY = 32  # 32 blocks x 2 layers x 2 (K, V) x 32 tokens x 2 heads x 32 x 4 bytes = 1 MiB


def _kv_cache_config(num_blocks: int = NUM_BLOCKS):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def _worker(root, mode: str, num_blocks: int = NUM_BLOCKS, **settings_extra) -> WorkerSide:
    settings = load_settings(env={}, extra_config={
        "root": str(root), "access_mode": mode, "max_bytes": "3MiB", "low_watermark_bytes": "2MiB",
        "min_span_tokens": BLOCK, "capture_slots": 2, "capture_slot_bytes": "2MiB",
        "maintenance_interval_seconds": 0.05, **settings_extra})
    identity = Identity("maint-test", "fp32-2x2x32", BLOCK, 0, "untransformed")
    store = _open_store(settings)  # the connector's own choice per access mode
    config = _kv_cache_config(num_blocks)
    worker = WorkerSide(settings, identity, store, config, describe_kv_layout(config))
    torch.manual_seed(0)
    worker.register_kv_caches({name: torch.randn(num_blocks, 2, BLOCK, 2, 32) for name in LAYERS})
    return worker


def _stats_until(worker: WorkerSide, totals: dict, gauges: dict, done, timeout: float = 60.0) -> None:
    """Add the worker's stats into ``totals`` / ``gauges`` (as vLLM would ship them) until ``done``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c, g = worker.take_stats(time.monotonic())
        for k, v in c.items():
            totals[k] = totals.get(k, 0) + v
        gauges.update(g)
        if done():
            return
        time.sleep(0.05)


def test_read_write_worker_evicts_to_the_watermark_and_reports_it(tmp_path):
    worker = _worker(tmp_path / "store", "read-write")
    try:
        assert worker.maintenance is not None
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for i in range(6):  # 6 x 1 MiB entries into a 3 MiB store
            # a publication into a store above max_bytes is refused (over_capacity) until a pass
            # evicts: wait for the pass the last publication triggered, as a steady stream would
            _stats_until(worker, counters, gauges, lambda: not pass_due(worker.store))
            tokens = [1000 * (i + 1) + t for t in range(BLOCKS_PER_ENTRY * BLOCK + 1)]
            for kv in worker.kv.values():  # each conversation's own KV bytes (no shared pages)
                kv.random_(0, 256)
            worker.capture(CapturePlan(f"req-{i}", BlockKeys(BLOCK).upto(tokens, BLOCKS_PER_ENTRY), 0,
                                       [list(range(BLOCKS_PER_ENTRY))]))
            # one publication at a time (each waits for its outcome)
            _stats_until(worker, counters, gauges, lambda: counters.get("captures_published", 0)
                         + counters.get("captures_publish_failed", 0) == i + 1)
        _stats_until(worker, counters, gauges, lambda: not pass_due(worker.store) and (
            counters.get("evicted_entries", 0) == 6 - worker.store.capacity().entries))
    finally:
        worker.close()
    capacity = worker.store.capacity()
    assert capacity.used_bytes <= capacity.max_bytes, capacity
    # 6 x 1 MiB (+ a manifest each) into 3 MiB: every third publication crosses max_bytes and a
    # pass evicts the oldest entries down to the 2 MiB low watermark.
    assert counters["captures_published"] == 6 and counters["evicted_entries"] >= 2, counters
    assert capacity.entries == 6 - counters["evicted_entries"]
    assert counters["bytes_reclaimed"] >= counters["evicted_entries"] * 2**20
    assert counters["maintenance_passes"] >= 1
    assert gauges["maintenance_healthy"] == 1.0
    assert gauges["maintenance_last_pass_duration_seconds"] > 0
    assert "maintenance_remaining_entries" in gauges
    # every number shipped has a vllm:sparkcache_* metric behind it
    assert set(counters) <= COUNTER_KEYS and set(gauges) <= RANK_GAUGE_KEYS, (counters, gauges)
    # a pass past its budget + 20% (the bound docs/SIZING.md states) is counted; one inside it not
    real = worker.maintenance.thread.reports[-1]
    for share, counted in ((1.19, 0), (1.21, 1)):
        worker.maintenance._on_pass(dataclasses.replace(real, duration_s=share * real.budget_ms / 1000))
        taken = worker.maintenance.take()[0]
        assert taken.get("maintenance_overrun", 0) == counted, share
        assert set(taken) <= COUNTER_KEYS, taken


def test_restore_only_worker_runs_no_maintenance(tmp_path):
    PageStore.from_settings(load_settings(env={}, extra_config={"root": str(tmp_path / "store")}))
    worker = _worker(tmp_path / "store", "restore-only")
    try:
        assert worker.maintenance is None
        assert "maintenance_healthy" not in worker.take_stats(time.monotonic())[1]
    finally:
        worker.close()


def test_a_stopped_lock_holder_stops_passes_and_is_counted(tmp_path, caplog):
    """A process holding the store's lock and stopped (SIGSTOP) never hangs the worker: each
    pass gives up on the lock within its budget, shipped as ``maintenance_stopped_lock``
    (``vllm:sparkcache_maintenance_passes_stopped_total{reason="lock"}``); the capture that
    waits for the shared lock fails after its bound instead of blocking the publisher forever."""
    import logging
    import signal

    caplog.set_level(logging.DEBUG, logger="sparkcache")
    worker = _worker(tmp_path / "store", "read-write")
    holder = _lock_holder(worker.store.layout.gc_lock_path, "LOCK_EX")
    try:
        holder.send_signal(signal.SIGSTOP)
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        tokens = list(range(BLOCKS_PER_ENTRY * BLOCK + 1))
        worker.capture(CapturePlan("req-locked", BlockKeys(BLOCK).upto(tokens, BLOCKS_PER_ENTRY), 0,
                                   [list(range(BLOCKS_PER_ENTRY))]))
        _stats_until(worker, counters, gauges, lambda: counters.get("captures_publish_failed", 0) == 1
                     and counters.get("maintenance_stopped_lock", 0) >= 1, timeout=90)
        assert counters.get("captures_publish_failed") == 1, counters
        assert counters.get("maintenance_stopped_lock", 0) >= 1, counters
        # the publication's 10 s wait and the passes' waits, counted by kind
        assert counters.get("lock_timeouts_shared") == 1, counters
        assert counters.get("lock_timeouts_exclusive", 0) >= counters["maintenance_stopped_lock"], counters
        # one warning says so (the publication's long wait), the store's, not one per event
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len([m for m in logged if "lock" in m]) == 1, logged
        assert gauges["maintenance_healthy"] == 1.0  # gave up, did not die
        assert set(counters) <= COUNTER_KEYS and set(gauges) <= RANK_GAUGE_KEYS, (counters, gauges)
    finally:
        holder.kill()
        holder.wait()
        worker.close()


def _lock_holder(lock: str, operation: str):
    """Another process holding ``lock`` with ``fcntl.flock(operation)`` until killed."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({lock!r}, os.O_RDWR | os.O_CREAT)\n"
        f"fcntl.flock(fd, fcntl.{operation})\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_ordinary_lock_contention_is_counted_not_logged(tmp_path, caplog):
    """Another process holding the store's lock shared (a writer publishing): each pass of an
    over-full store gives up on the exclusive lock within its budget. Each is counted
    (``lock_timeouts_exclusive``, ``vllm:sparkcache_lock_timeouts_total{lock="exclusive"}``)
    and none is logged: a 20 ms wait that fails says nothing about a stopped process."""
    import logging

    caplog.set_level(logging.DEBUG, logger="sparkcache")
    worker = _worker(tmp_path / "store", "read-write")
    holder = _lock_holder(worker.store.layout.gc_lock_path, "LOCK_SH")  # a publishing writer
    try:
        for first in (0, 1):  # two entries of 2 MiB: over 3 MiB (one entry may not exceed the cap)
            keys = BlockKeys(BLOCK).upto(list(range(first, first + 16 * BLOCK + 1)), 16)
            assert worker.store.publish(worker.identity, keys, [os.urandom(2 << 20)]).ok
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        _stats_until(worker, counters, gauges,
                     lambda: counters.get("maintenance_stopped_lock", 0) >= 5, timeout=90)
    finally:
        holder.kill()
        holder.wait()
        worker.close()
    counters.update({k: counters.get(k, 0) + v for k, v in worker.take_stats(time.monotonic())[0].items()})
    assert counters["maintenance_stopped_lock"] >= 5, counters
    assert counters.get("lock_timeouts_exclusive") == counters["maintenance_stopped_lock"], counters
    assert "lock_timeouts_shared" not in counters, counters
    assert set(counters) <= COUNTER_KEYS, counters
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in logged if "lock" in m], logged


def test_a_refused_publication_is_shipped_with_its_reason_and_free_space_with_the_gauges(tmp_path):
    """A floor no volume here meets: every publication is refused as low_free_space, shipped
    as ``publish_failed_low_free_space`` (``vllm:sparkcache_publish_failures_total{reason=...}``),
    next to the filesystem's free bytes."""
    worker = _worker(tmp_path / "store", "read-write", min_free_bytes=1 << 50)
    try:
        counters: dict[str, float] = {}
        gauges: dict[str, float] = {}
        tokens = list(range(BLOCKS_PER_ENTRY * BLOCK + 1))
        worker.capture(CapturePlan("req", BlockKeys(BLOCK).upto(tokens, BLOCKS_PER_ENTRY), 0,
                                   [list(range(BLOCKS_PER_ENTRY))]))
        _stats_until(worker, counters, gauges, lambda: counters.get("captures_publish_failed", 0) == 1)
    finally:
        worker.close()
    assert counters["publish_failed_low_free_space"] == 1 and worker.store.capacity().entries == 0
    assert 0 < gauges["free_bytes"] < 1 << 50
    assert set(counters) <= COUNTER_KEYS and set(gauges) <= RANK_GAUGE_KEYS, (counters, gauges)


def _cpus_of(thread) -> set[int]:
    return os.sched_getaffinity(thread.native_id)


def _placed(threads: dict, names: tuple[str, ...], cpus: set[int], hang_s: float = 60.0) -> None:
    """Wait until each named thread moved itself onto ``cpus``: a thread places itself when it
    first runs, which nothing here can wait on but its affinity (``hang_s`` is a hang guard)."""
    deadline = time.monotonic() + hang_s
    while any(_cpus_of(threads[n]) != cpus for n in names) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_publication_and_maintenance_run_off_the_cpus_vllm_pinned_the_worker_to(tmp_path):
    """vLLM's CPU worker pins its process to its OpenMP cores (threads that inherit that pin
    compute beside the model: Report B's setting): a worker created on a pinned thread records
    those CPUs, and its publisher, its maintenance thread and their pools run on the other
    allowed ones (publication niced); a restore's readers run on every allowed CPU. Real
    affinity and priorities, on this machine's cores."""
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"needs two CPUs to tell them apart, this process has {sorted(allowed)}"
    model, rest = {min(allowed)}, allowed - {min(allowed)}
    os.sched_setaffinity(0, model)  # as vLLM pins the worker before the connector starts
    try:
        worker = _worker(tmp_path / "store", "read-write")
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        tokens = list(range(BLOCKS_PER_ENTRY * BLOCK + 1))
        worker.capture(CapturePlan("req-0", BlockKeys(BLOCK).upto(tokens, BLOCKS_PER_ENTRY), 0,
                                   [list(range(BLOCKS_PER_ENTRY))]))
        counters: dict[str, float] = {}
        _stats_until(worker, counters, {}, lambda: counters.get("captures_published", 0) == 1)
        threads = {t.name: t for t in threading.enumerate()}
        _placed(threads, ("sparkcache-publisher", "sparkcache-maintenance"), rest)
        assert _cpus_of(threads["sparkcache-publisher"]) == rest
        assert _cpus_of(threads["sparkcache-maintenance"]) == rest
        # the pools placed since this worker noted its model CPUs (a pool from an earlier
        # test is replaced when next used)
        current = {pool: executor._threads for pool, (noted, executor, _) in layout._POOLS.items()
                   if noted == frozenset(model)}
        assert current["publish"], "the publication hashed on its pool"
        placed = {pool: {t.name: _cpus_of(t) for t in threads} for pool, threads in current.items()}
        assert all(c == (allowed if pool == "io" else rest) for pool, by in placed.items() for c in by.values()), placed
        # publication also yields the CPUs it shares with vLLM's other processes; maintenance
        # (a wall-time budget) keeps the process's priority
        nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in [threads["sparkcache-publisher"], threads["sparkcache-maintenance"], *current["publish"]]}
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert nice == {name: (own if name == "sparkcache-maintenance" else max(own, cpus.PUBLISH_NICE))
                        for name in nice}, nice
    finally:
        worker.close()


@pytest.mark.parametrize("bind, cpus_listed", [
    ("0-3|4-7", set(range(8))), ("0,2|1,3", {0, 1, 2, 3}), ("5", {5}), ("auto", set()),
    ("nobind", set()), ("all", set()), ("", set()), ("0-|1", set()), ("1-x", set()), ("|", set())])
def test_an_explicit_omp_bind_lists_every_ranks_cores(bind, cpus_listed):
    assert cpus.omp_bound_cpus(bind) == cpus_listed


def test_background_work_avoids_the_other_ranks_cores_too(tmp_path, monkeypatch):
    """Tensor parallel on CPU, one core per rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``): rank
    0's publisher must not move onto rank 1's model core; with no core left it keeps every
    allowed one (as a worker vLLM did not pin)."""
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"needs two CPUs, this process has {sorted(allowed)}"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(allowed)))
    os.sched_setaffinity(0, {min(allowed)})
    try:
        worker = _worker(tmp_path / "store", "read-write")
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        threads = {t.name: t for t in threading.enumerate()}
        _placed(threads, ("sparkcache-publisher", "sparkcache-maintenance"), allowed)
        assert _cpus_of(threads["sparkcache-publisher"]) == allowed
        assert _cpus_of(threads["sparkcache-maintenance"]) == allowed
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["read-write", "restore-only"])
def test_a_worker_notes_the_cpus_vllm_bound_the_models_openmp_threads_to(tmp_path, monkeypatch, mode):
    """Every worker that restores, writing or not: its restores read off those CPUs
    (``layout.reader_cpus``; tests/store/test_read_into.py)."""
    _worker(tmp_path / "store", "read-write").close()  # a store there to restore from
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0 1")  # as vLLM's CPU worker sets it for libgomp
    cpus.note_spinning_cpus({})
    worker = _worker(tmp_path / "store", mode)
    try:
        assert worker.store is not None
        assert cpus.spinning_cpus() == {0, 1}
    finally:
        worker.close()
        cpus.note_spinning_cpus({})


@pytest.mark.parametrize("mode,lowered", [("read-write", True), ("restore-only", False)])
def test_a_writing_worker_shortens_the_wait_for_the_gil(tmp_path, mode, lowered):
    """Its publisher and maintenance threads run Python in vLLM's worker process: the model's
    thread, which takes the GIL back after every torch op, then waits at most the
    interpreter's switch interval for them (docs/RESULTS.md, Report B). A worker that writes
    nothing starts no such thread and leaves the interval as it was."""
    import sys

    from sparkcache.connector.worker_side import GIL_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, whatever an earlier test left
    worker = None
    try:
        worker = _worker(tmp_path / "store", mode)
        assert (sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S) is lowered, sys.getswitchinterval()
    finally:
        if worker is not None:
            worker.close()
        sys.setswitchinterval(before)
