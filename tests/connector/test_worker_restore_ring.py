"""Restores into KV caches a page cannot be read straight into go through a ring of host
buffers (``restore_ring``): at most its slots' worth of an entry in host memory at once, every
object placed in order, and a refused object stops the restore without a reader left writing.

Real parts: vLLM 0.32.0's own views of a KV cache whose blocks it splits into kernel blocks
(``vllm_kv_caches``; what FlashInfer on Hopper gets, and what a restore cannot read into),
sparkcache's worker half and its store on disk, the page objects as files. On CUDA the same
ring copies on a load stream (``bench/gpu_copy.py`` checks that part on a device).
"""

from __future__ import annotations

import os
import random
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sparkcache.connector import restore_ring
from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.connector import _open_store
from sparkcache.connector.keys import BlockKeys
from sparkcache.connector.kv_layout import describe_kv_layout
from sparkcache.connector.scheduler_side import LoadPlan, StoredPages
from sparkcache.connector.worker_side import WorkerSide
from sparkcache.settings import load_settings
from sparkcache.store import Identity
from sparkcache.store.layout import done_now

from testing.vllm_kv_caches import BLOCK, NUM_BLOCKS, block_mask, vllm_kv_caches

PAGES = 40  # pages of one block: ten times the ring


def _worker(kv, root, mode: str, slot_bytes: str = "4MiB") -> WorkerSide:
    settings = load_settings(env={}, extra_config={
        "root": str(root), "access_mode": mode, "page_blocks": 1, "max_bytes": "64MiB",
        "low_watermark_bytes": "32MiB", "min_span_tokens": BLOCK, "capture_slots": 2,
        "capture_slot_bytes": slot_bytes})
    layout = describe_kv_layout(kv.config)
    worker = WorkerSide(settings, Identity("restore-ring-test", layout.description, BLOCK, 0, "untransformed"),
                        _open_store(settings), kv.config, layout)
    worker.register_kv_caches(kv.caches)
    return worker


@pytest.fixture
def stored(tmp_path):
    """An entry of ``PAGES`` pages captured from shuffled blocks of a split KV cache."""
    src = vllm_kv_caches("LBHNC", 4, seed=1)
    ids = random.Random(0).sample(range(NUM_BLOCKS), PAGES)
    keys = BlockKeys(BLOCK).upto(list(range(1, PAGES * BLOCK + 2)), PAGES)
    writer = _worker(src, tmp_path / "store", "read-write")
    try:
        writer.capture(CapturePlan("store", keys, 0, [ids]))
        deadline = time.monotonic() + 60
        while writer.slots.stats.published < 1:
            assert writer.slots.stats.publish_failed == 0 and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        writer.close()
    return src, ids, keys, tmp_path / "store"


def _plan(worker: WorkerSide, keys: list[str], dest: list[int]) -> LoadPlan:
    found = worker.store.lookup(worker.identity, keys)
    assert found.hit and found.hit_blocks == len(keys), found
    return LoadPlan("r", keys, 0, [dest], stored=StoredPages.of(found.handle, 0, len(keys)))


def _load(worker: WorkerSide, plan: LoadPlan) -> tuple[set, set]:
    worker.load(plan)
    return worker.take_results()[1:]


def _wrong_blocks(src, ids, dst, dest) -> list:
    return [(name, s, d) for name in src.page_layers for s, d in zip(ids, dest)
            if not src.block(name, s).equal(dst.block(name, d))]


def test_a_restore_holds_at_most_the_rings_objects_in_host_memory(stored):
    src, ids, keys, root = stored
    dst = vllm_kv_caches("LBHNC", 4, seed=2)
    dest = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - PAGES, -1))
    reader = _worker(dst, root, "restore-only")
    page = sum(v.block_bytes for v in reader.views.values())
    try:
        assert not reader._into_blocks, "the test needs a KV cache a page cannot be read into"
        plan = _plan(reader, keys, dest)
        tracemalloc.start()
        try:
            assert _load(reader, plan) == ({"r"}, set())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        reader.close()
    assert _wrong_blocks(src, ids, dst, dest) == []
    # the ring's slots are torch's, not traced: what is traced is the restore's own objects
    assert peak < PAGES * page // 2, (f"a restore of {PAGES} pages of {page} bytes held {peak} bytes of "
                                      "Python buffers: it read the whole entry into memory before placing it")


@pytest.mark.parametrize("bad", [0, 7, PAGES - 1])
def test_a_corrupt_page_refuses_the_restore_and_leaves_no_reader_writing(stored, bad):
    src, ids, keys, root = stored
    dst = vllm_kv_caches("LBHNC", 4, seed=2)
    dest = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - PAGES, -1))
    reader = _worker(dst, root, "restore-only")
    before = dst.raw.clone()
    try:
        found = reader.store.lookup(reader.identity, keys)
        path = reader.store.objects.path(found.handle.pages[bad].digest)
        with open(path, "r+b") as f:  # one payload byte flipped, as the disk might
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        assert _load(reader, _plan(reader, keys, dest)) == ({"r"}, {"r"}), "the corrupt page was not refused"
        outside = ~block_mask(dst, {name: dest for name in dst.page_layers})
        assert dst.raw[outside].equal(before[outside]), "bytes outside the destination blocks changed"
        ring = reader._ring
        slots = [t.clone() for t in ring._host]
        time.sleep(0.2)  # a reader still running would write into a slot meanwhile
        assert all(a.equal(b) for a, b in zip(slots, ring._host))
    finally:
        reader.close()


def test_the_ring_reads_ahead_while_it_places_and_places_in_order():
    """Each object is placed after its read, in order, with at most ``slots`` reads begun and
    not yet placed; the slots hold exactly each object's bytes."""
    ring = restore_ring.RestoreRing(64, torch.device("cpu"), slots=3)
    sizes = [64, 1, 17, 64, 0, 33, 64]
    events: list[tuple[str, int]] = []
    got: dict[int, bytes] = {}

    def read_into(k: int, buf: memoryview) -> None:
        events.append(("read", k))
        buf[:] = bytes([k]) * len(buf)

    def place(k: int, obj: torch.Tensor) -> int:
        events.append(("place", k))
        got[k] = bytes(obj.numpy())
        return obj.numel()

    placed, event = ring.restore(sizes, read_into, place, done_now)
    assert placed == sum(sizes) and event is None
    assert got == {k: bytes([k]) * n for k, n in enumerate(sizes)}
    assert [k for e, k in events if e == "place"] == list(range(len(sizes)))
    for k in range(len(sizes)):
        begun = {j for e, j in events[:events.index(("place", k))] if e == "read"}
        assert k in begun and len(begun - set(range(k))) <= 3


def test_an_object_larger_than_the_slots_grows_the_ring():
    ring = restore_ring.RestoreRing(8, torch.device("cpu"), slots=2)
    placed, _ = ring.restore([8, 100, 3], lambda k, buf: buf.__setitem__(slice(None), b"x" * len(buf)),
                             lambda k, obj: obj.numel(), done_now)
    assert placed == 111 and ring.slot_bytes == 100


def test_a_refused_read_is_raised_after_every_read_in_flight_ended():
    pool = ThreadPoolExecutor(4)
    ring = restore_ring.RestoreRing(16, torch.device("cpu"), slots=4)
    ended: list[int] = []

    def read_into(k: int, buf: memoryview) -> None:
        if k == 1:
            raise OSError("refused")
        time.sleep(0.2)
        buf[:] = b"y" * len(buf)
        ended.append(k)

    try:
        with pytest.raises(OSError, match="refused"):
            ring.restore([16] * 8, read_into, lambda k, obj: obj.numel(), pool.submit)
        # 0 placed; 2, 3 and 4 (begun once 0's slot was free) in flight when 1's failure was found
        assert sorted(ended) == [0, 2, 3, 4], "a read was still writing into a slot when the error was raised"
    finally:
        pool.shutdown()


@pytest.mark.parametrize("corrupt", [False, True], ids=["whole", "corrupt"])
def test_an_asynchronous_load_on_the_loader_thread_is_reported_once_it_is_done(stored, corrupt):
    """The loader thread an accelerator's worker starts (here on the CPU ring): ``load``
    returns at once, ``take_results`` reports the request only once its objects are placed,
    a refused one in ``failed_recving`` too."""
    src, ids, keys, root = stored
    dst = vllm_kv_caches("LBHNC", 4, seed=2)
    dest = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - PAGES, -1))
    reader = _worker(dst, root, "restore-only")
    reader._loader = ThreadPoolExecutor(1, "sparkcache-load")
    gate = threading.Event()
    reader._loader.submit(gate.wait)  # the load queues behind this until the test lets it go
    try:
        plan = _plan(reader, keys, dest)
        if corrupt:
            path = reader.store.objects.path(plan.stored.pages[PAGES // 2].digest)
            with open(path, "r+b") as f:
                f.write(b"\xff" * 8)
        reader.load(plan)
        assert reader.take_results()[1:] == (set(), set()), "reported before it was read"
        gate.set()
        deadline = time.monotonic() + 30
        while not (got := reader.take_results()[1:])[0]:
            assert time.monotonic() < deadline, "the asynchronous load was never reported"
            time.sleep(0.01)
        assert got == ({"r"}, {"r"} if corrupt else set())
        assert reader.take_results()[1:] == (set(), set()), "reported twice"
    finally:
        reader.close()
    if not corrupt:
        assert _wrong_blocks(src, ids, dst, dest) == []


def _address_space() -> int:
    """The process's mapped bytes (the kernel's VmSize): a buffer given back is unmapped."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_close_gives_back_the_capture_slots_and_the_ring_while_the_worker_is_still_referenced(tmp_path):
    """vLLM keeps its connector after shutting it down, and on CUDA the slots are page-locked.
    Before, the buffers lived until a full garbage collection (the worker's threads make
    cycles): in ``make test`` several closed workers' slots, adjacent and merged into one
    mapping larger than the machine's memory, made every later ``fork`` fail with ENOMEM."""
    kv = vllm_kv_caches("LBHNC", 4, seed=1)
    gib = 1 << 30
    before = _address_space()
    worker = _worker(kv, tmp_path / "store", "read-write", slot_bytes="1GiB")
    assert worker._ring is not None, "the test needs a KV cache restored through the ring"
    assert _address_space() - before >= 2 * gib, "the slots were not made at register_kv_caches"
    worker.close()
    worker.close()  # a second close does nothing
    left = _address_space() - before
    assert left < gib // 4, f"{left} bytes still mapped after close"
    assert worker._ring.slot_bytes == 0 and worker.slots.buffer_bytes() == 0


def test_a_closed_ring_gives_its_slots_back_and_a_later_restore_makes_them_again():
    ring = restore_ring.RestoreRing(256 << 20, torch.device("cpu"))
    before = _address_space()
    ring.close()
    assert before - _address_space() >= restore_ring.RING_SLOTS * (256 << 20) * 9 // 10
    data = [bytes([k]) * 1000 for k in range(6)]
    got: list[bytes] = []

    def read_into(k: int, buf: memoryview) -> None:
        buf[:] = data[k]

    def place(k: int, obj: torch.Tensor) -> int:
        got.append(obj.numpy().tobytes())
        return obj.numel()

    with ThreadPoolExecutor(2) as pool:
        placed, _ = ring.restore([len(d) for d in data], read_into, place, pool.submit)
    assert placed == 6000 and got == data
