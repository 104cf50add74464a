"""A finished request's capture streams through its slot (issue 41): an entry larger than a
capture slot is copied out of the KV cache and published a slot's worth of pages at a time,
so no conversation is too long to store, and what captures hold in host memory stays within
``CAPTURE_SLOTS x CAPTURE_SLOT_BYTES``.

vLLM keeps a finished request's blocks until the workers report it in ``finished_sending``;
a streamed capture reports it only once its last chunk is copied, and never after the GPU
lease (``sparkcache_gpu_lease_seconds``) could have handed the blocks to another request.

Real parts: vLLM's own layout and view code on CPU tensors (``vllm_kv_caches``), sparkcache's
worker half and its store on disk, the store's own cross-process lock to hold the publisher.
"""

from __future__ import annotations

import random
import time

import pytest

from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.connector import _open_store
from sparkcache.connector.keys import BlockKeys
from sparkcache.connector.kv_layout import describe_kv_layout
from sparkcache.connector.scheduler_side import LoadPlan, StoredPages
from sparkcache.connector.worker_side import WorkerSide
from sparkcache.settings import load_settings
from sparkcache.store import Identity
from sparkcache.store.locks import exclusive_lock

from testing.vllm_kv_caches import BLOCK, NUM_BLOCKS, VllmKV, vllm_kv_caches

PAGE_BLOCKS = 2
LAYERS = 2
BLOCK_BYTES = LAYERS * 4096       # both layers' share of one block (vllm_kv_caches)
PAGE_BYTES = PAGE_BLOCKS * BLOCK_BYTES
SLOT_BYTES = 64 << 10             # 4 pages a chunk
CAPTURED = 40                     # blocks: 320 KiB, five slots' worth


def _worker(kv: VllmKV, root, mode: str, **extra) -> WorkerSide:
    settings = load_settings(env={}, extra_config={
        "root": str(root), "access_mode": mode, "page_blocks": PAGE_BLOCKS, "max_bytes": "64MiB",
        "low_watermark_bytes": "32MiB", "min_span_tokens": BLOCK, "capture_slots": 2,
        "capture_slot_bytes": SLOT_BYTES, **extra})
    layout = describe_kv_layout(kv.config)
    identity = Identity("streamed-capture-test", layout.description, BLOCK, 0, "untransformed")
    worker = WorkerSide(settings, identity, _open_store(settings), kv.config, layout)
    worker.register_kv_caches(kv.caches)
    return worker


def _keys(n: int) -> list[str]:
    return BlockKeys(BLOCK).upto(list(range(1, n * BLOCK + 2)), n)


def _wait(what, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _sending_reports(worker: WorkerSide, seen: list[str]) -> list[str]:
    seen += sorted(worker.take_results()[0])
    return seen


@pytest.mark.parametrize("layout,ratio", [("LBHNC", 1), ("BLNHC", 4)])
def test_an_entry_larger_than_a_slot_is_published_and_restores_every_block(tmp_path, layout, ratio):
    layers = 1 if layout.startswith("B") else LAYERS  # vLLM splits a block-outermost page alone
    src = vllm_kv_caches(layout, ratio, layers=layers, seed=3)
    dst = vllm_kv_caches(layout, ratio, layers=layers, seed=4)
    assert CAPTURED * len(src.page_layers) * 4096 > 2 * SLOT_BYTES
    src_ids = random.Random(layout).sample(range(1, NUM_BLOCKS), CAPTURED)
    dst_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - CAPTURED, -1))
    keys = _keys(CAPTURED)
    writer = _worker(src, tmp_path / "store", "read-write")
    reports: list[str] = []
    try:
        writer.capture(CapturePlan("long", keys, 0, [src_ids]))
        st = writer.slots.stats
        _wait(lambda: st.published + st.publish_failed + st.skipped_too_large + st.skipped_slots_full)
        assert (writer.slots.stats.published, writer.slots.stats.skipped_too_large) == (1, 0)
        assert _sending_reports(writer, reports) == ["long"], "the blocks were never released"
        assert writer.slots.buffer_bytes() <= 2 * SLOT_BYTES
    finally:
        writer.close()
    assert _sending_reports(writer, reports) == ["long"], "finished_sending reported twice"

    reader = _worker(dst, tmp_path / "store", "restore-only")
    try:
        found = reader.store.lookup(reader.identity, keys)
        assert found.hit and found.hit_blocks == CAPTURED, found
        reader.load(LoadPlan("r", keys, 0, [dst_ids], stored=StoredPages.of(found.handle, 0, CAPTURED)))
        assert reader.take_results()[1:] == ({"r"}, set())
    finally:
        reader.close()
    wrong = [(name, s, d) for name in src.page_layers for s, d in zip(src_ids, dst_ids)
             if not src.block(name, s).equal(dst.block(name, d))]
    assert wrong == [], f"{len(wrong)} manager blocks differ (layer, source id, destination id)"


def test_the_blocks_are_held_until_the_last_chunk_is_copied(tmp_path):
    """The publisher is held at its first page (the store's lock, taken exclusively as a
    maintenance pass takes it): one chunk is copied, the blocks are not yet released; once the
    lock is free the rest is copied and ``finished_sending`` reports the request once."""
    kv = vllm_kv_caches("LBHNC", 1, layers=LAYERS, seed=5)
    writer = _worker(kv, tmp_path / "store", "read-write")
    reports: list[str] = []
    try:
        with exclusive_lock(writer.store.layout, 5.0):
            writer.capture(CapturePlan("held", _keys(CAPTURED), 0, [list(range(1, CAPTURED + 1))]))
            time.sleep(0.5)  # the publisher copied its first chunk and waits for the lock
            assert _sending_reports(writer, reports) == [], "released before its pages were copied"
            assert writer.counters.get("captured_page_bytes", 0) <= SLOT_BYTES
        _wait(lambda: writer.slots.stats.published == 1)
        assert _sending_reports(writer, reports) == ["held"]
        assert writer.take_stats(time.monotonic())[0]["captured_page_bytes"] == CAPTURED * BLOCK_BYTES
    finally:
        writer.close()


def test_a_capture_that_outlives_the_gpu_lease_publishes_nothing(tmp_path):
    """With the GPU lease, vLLM frees a finished request's blocks at its deadline whether or not
    the copy is done: a streamed capture still copying by then could read another request's
    bytes, so it stops, publishes nothing and is counted; the request is reported once."""
    kv = vllm_kv_caches("LBHNC", 1, layers=LAYERS, seed=6)
    writer = _worker(kv, tmp_path / "store", "read-write", sparkcache_gpu_lease_seconds=0.2)
    reports: list[str] = []
    try:
        with exclusive_lock(writer.store.layout, 5.0):
            writer.capture(CapturePlan("slow", _keys(CAPTURED), 0, [list(range(1, CAPTURED + 1))]))
            time.sleep(0.3)  # past half the lease: the next chunk's copy is not trusted
        _wait(lambda: writer.slots.stats.publish_failed == 1)
        assert writer.slots.stats.published == 0
        assert _sending_reports(writer, reports) == ["slow"]
        assert writer.take_stats(time.monotonic())[0]["publish_failed_source_failed"] == 1
        assert not writer.store.lookup(writer.identity, _keys(CAPTURED)).hit
    finally:
        writer.close()
    assert writer.store.entries() == []
