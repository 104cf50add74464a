"""A restore places every byte of every manager block it was captured from, in each physical
KV cache layout vLLM 0.32.0 hands a connector and whether or not vLLM splits manager blocks
into kernel blocks (issue 41: with a split, dim 0 of the tensors counts kernel blocks).

Real parts: vLLM's own layout and view code on CPU tensors (``vllm_kv_caches``), sparkcache's
worker half and its store on disk. A read-write worker captures from shuffled block ids; a
restore-only worker with another KV cache (other random bytes) restores into other ids in
descending order. Compared by vLLM's own regrouping (``group_kernel_blocks``): each restored
manager block byte for byte, and every other byte of the destination allocation unchanged.
"""

from __future__ import annotations

import random
import time

import pytest

from sparkcache.connector.connector import _open_store
from sparkcache.connector.keys import BlockKeys
from sparkcache.connector.kv_layout import LayoutKind, describe_kv_layout
from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.scheduler_side import LoadPlan, StoredPages
from sparkcache.connector.worker_side import WorkerSide
from sparkcache.settings import load_settings
from sparkcache.store import Identity

from testing.vllm_kv_caches import CASES as KV_CASES
from testing.vllm_kv_caches import (BLOCK, NEVER_SPLIT, NUM_BLOCKS, VllmKV, apart_from, block_mask,
                                     vllm_kv_caches)

CAPTURED = 20   # pages of 8 blocks: 8, 8, 4
START = 3       # the restore's first 3 blocks are local hits: placed from block 3 on
PAGE_BLOCKS = 8
CASES = [pytest.param(name, ratio, layers, id=f"{name}-ratio{ratio}") for name, ratio, layers in KV_CASES]


def _worker(kv: VllmKV, root, mode: str) -> WorkerSide:
    settings = load_settings(env={}, extra_config={
        "root": str(root), "access_mode": mode, "page_blocks": PAGE_BLOCKS, "max_bytes": "64MiB",
        "low_watermark_bytes": "32MiB", "min_span_tokens": BLOCK, "capture_slots": 2,
        "capture_slot_bytes": "4MiB"})
    layout = describe_kv_layout(kv.config)
    assert layout.kind is (LayoutKind.HYBRID if kv.state_layers else LayoutKind.ATTENTION)
    identity = Identity("kv-layouts-test", layout.description, BLOCK, 0, "untransformed")
    worker = WorkerSide(settings, identity, _open_store(settings), kv.config, layout)
    worker.register_kv_caches(kv.caches)
    return worker


def _capture(worker: WorkerSide, keys: list[str], ids: list[int], state_id: int | None) -> None:
    hybrid = state_id is not None
    worker.capture(CapturePlan("store", keys, 0, [ids] + ([[]] if hybrid else []),
                               state_block_ids=[state_id] if hybrid else None))
    worker.capture_after_forward()  # the forward that wrote the state (hybrid plans wait for it)
    assert worker.slots.stats.queued == 1, "the capture was not copied out"
    deadline = time.monotonic() + 60
    while worker.slots.stats.published < 1:
        assert worker.slots.stats.publish_failed == 0 and time.monotonic() < deadline
        time.sleep(0.02)


def _restore(worker: WorkerSide, keys: list[str], ids: list[int], state_id: int | None) -> None:
    hybrid = state_id is not None
    found = worker.store.lookup(worker.identity, keys, with_state=hybrid)
    assert found.hit and found.hit_blocks == len(keys), found
    stored = StoredPages.of(found.handle, START, len(keys))
    groups = [ids] + ([[0] * (len(ids) - 1) + [state_id]] if hybrid else [])
    worker.load(LoadPlan("r", keys, START, groups, stored=stored))
    assert worker.take_results()[1:] == ({"r"}, set())  # reported restored


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
@pytest.mark.parametrize("layout,ratio,layers", CASES)
def test_restore_places_whole_manager_blocks(tmp_path, layout, ratio, layers, hybrid):
    src = vllm_kv_caches(layout, ratio, hybrid=hybrid, layers=layers, seed=1)
    dst = vllm_kv_caches(layout, ratio, hybrid=hybrid, layers=layers, seed=2)
    assert src.caches[src.page_layers[0]].shape[0] == NUM_BLOCKS * ratio  # what the worker gets
    rng = random.Random(f"{layout}{ratio}{hybrid}")
    src_ids = rng.sample(range(1, NUM_BLOCKS), CAPTURED + hybrid)  # shuffled; one more: the state's
    src_state = src_ids.pop() if hybrid else None
    dst_ids = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - (CAPTURED - START), -1))  # descending
    dst_state = 1 if hybrid else None  # its bytes apart from the attention blocks' (groups overlay)
    assert not hybrid or dst_state in apart_from(dst, {dst.page_layers[0]: dst_ids}, dst.state_layers)
    keys = BlockKeys(BLOCK).upto(list(range(1, CAPTURED * BLOCK + 2)), CAPTURED)

    writer = _worker(src, tmp_path / "store", "read-write")
    try:
        _capture(writer, keys, src_ids, src_state)
    finally:
        writer.close()
    reader = _worker(dst, tmp_path / "store", "restore-only")
    before = dst.raw.clone()
    try:
        _restore(reader, keys, dst_ids, dst_state)
    finally:
        reader.close()

    placed = {name: dst_ids for name in dst.page_layers}
    placed.update({name: [dst_state] for name in dst.state_layers})
    wrong = [(name, s, d) for name in src.page_layers for s, d in zip(src_ids[START:], dst_ids)
             if not src.block(name, s).equal(dst.block(name, d))]
    wrong += [(name, src_state, dst_state) for name in src.state_layers
              if not src.block(name, src_state).equal(dst.block(name, dst_state))]
    assert wrong == [], f"{len(wrong)} manager blocks differ (layer, source id, destination id)"
    outside = ~block_mask(dst, placed)
    assert dst.raw[outside].equal(before[outside]), "bytes outside the destination blocks changed"


@pytest.mark.parametrize("layout", NEVER_SPLIT)
def test_vllm_never_hands_these_layouts_split(layout):
    """The layouts not covered at ratio 4 above: vLLM refuses to split their blocks."""
    for layers in (1, 2):
        with pytest.raises((ValueError, RuntimeError)):
            vllm_kv_caches(layout, 4, layers=layers)
