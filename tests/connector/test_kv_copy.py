"""``kv_copy``: pages are the same bytes in every KV cache layout and kernel-block split vLLM
0.32.0 hands a connector, and the bytes a cache that is not split always gave (so stored
entries keep their identity); a restore is one batched copy per layer and page, in any block
order, from any buffer.

Real parts: vLLM's own layout and view code on CPU tensors (``vllm_kv_caches``), vLLM's
``group_kernel_blocks`` as the reference for what a manager block is, torch's dispatcher to
see which copies run. Kernel block ``b * ratio + k`` holds tokens ``k * N / ratio ..`` of
manager block ``b`` (the runner's ``kernel_block_offsets``, ``arange(ratio)``).
"""

from __future__ import annotations

import mmap
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparkcache.connector import kv_copy

from testing.vllm_kv_caches import NUM_BLOCKS, VllmKV, apart_from, vllm_kv_caches

SPLITS = [("LBHNC", 1, 2), ("LBNHC", 1, 2), ("LHBNC", 1, 2), ("BLHNC", 1, 2), ("BLNHC", 1, 2),
          ("BHLNC", 1, 2), ("LBHNC", 4, 2), ("LBNHC", 4, 2), ("BLHNC", 4, 1), ("BLNHC", 4, 1)]


def _views(kv: VllmKV, layers) -> list[kv_copy.BlockView]:
    return [kv_copy.block_view(n, kv.caches[n], kv.config.num_blocks) for n in layers]


def _copy_logical(src: VllmKV, dst: VllmKV, blocks: dict[str, list[int]]) -> None:
    """Give blocks ``blocks`` (layer -> ids) of ``dst`` the KV of ``src`` (not split): the same
    heads, tokens and content per manager block, in ``dst``'s own layout and kernel blocks."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    for name, ids in blocks.items():
        logical = src.caches[name][ids]  # [n, H, N, C]
        grouped = group_kernel_blocks(dst.caches[name], dst.config.num_blocks)
        if grouped.dim() == 5:  # [B, ratio, H, N / ratio, C]
            logical = logical.unflatten(2, (grouped.shape[1], -1)).permute(0, 2, 1, 3, 4)
        grouped[ids] = logical


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_pages_are_the_same_bytes_in_every_layout_and_split(hybrid):
    reference = vllm_kv_caches("LBHNC", 1, hybrid=hybrid, layers=1, seed=3)  # the CPU backend's
    rng = random.Random(0)
    blocks = {n: rng.sample(range(NUM_BLOCKS), 11) for n in reference.page_layers[:1]}
    if hybrid:  # groups overlay one allocation: state blocks apart from those, in every layout
        apart = set.intersection(*(apart_from(vllm_kv_caches(layout, ratio, hybrid=True, layers=1),
                                              blocks, reference.state_layers)
                                   for layout, ratio, _ in SPLITS))
        blocks[reference.state_layers[0]] = rng.sample(sorted(apart), 11)
    layers = tuple(blocks)
    # what the worker stored before kv_copy: kv[layer][block].contiguous(), block after block
    before = {n: [reference.caches[n].view(torch.uint8)[b].contiguous().numpy().tobytes() for b in ids]
              for n, ids in blocks.items()}
    expected = [b"".join(b"".join(before[n][lo:lo + 4]) for n in layers) for lo in (0, 4, 8)]
    for layout, ratio, _ in SPLITS:
        kv = vllm_kv_caches(layout, ratio, hybrid=hybrid, layers=1, seed=4)
        _copy_logical(reference, kv, blocks)
        views = _views(kv, layers)
        assert views[0].ratio == ratio
        pages = kv_copy.gather([(v, blocks[v.layer]) for v in views], 4)  # pages of 4, 4, 3 blocks
        assert [bytes(p) for p in pages] == expected, (layout, ratio)


class _Ops(TorchDispatchMode):
    """The aten operators torch runs meanwhile, counted."""

    def __init__(self):
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout,ratio,layers", SPLITS, ids=[f"{n}-ratio{r}" for n, r, _ in SPLITS])
def test_place_is_one_index_copy_per_layer_in_any_order(layout, ratio, layers):
    src = vllm_kv_caches(layout, ratio, hybrid=True, layers=layers, seed=5)
    dst = vllm_kv_caches(layout, ratio, hybrid=True, layers=layers, seed=6)
    rng = random.Random(layout)
    src_ids = rng.sample(range(NUM_BLOCKS), 9)
    orders = {"descending": list(range(40, 31, -1)), "shuffled": rng.sample(range(NUM_BLOCKS), 9)}
    src_views, dst_views = _views(src, src.page_layers), _views(dst, dst.page_layers)
    (page,) = kv_copy.gather([(v, src_ids) for v in src_views], 9)
    for order, dst_ids in orders.items():
        with _Ops() as ops:
            placed = kv_copy.place([(v, dst_ids[2:]) for v in dst_views], page, 9, skip=2)
        assert placed == 7 * sum(v.block_bytes for v in dst_views)
        copies = {op: n for op, n in ops.seen.items() if "copy" in op or "index_put" in op}
        assert copies == {"index_copy_": len(dst_views)}, (order, ops.seen)
        for name in dst.page_layers:
            for s, d in zip(src_ids[2:], dst_ids[2:]):
                assert src.block(name, s).equal(dst.block(name, d)), (order, name, s, d)
    # the recurrent state: one block per layer, into the block vLLM reads it from
    (state,) = kv_copy.gather([(v, [src_ids[0]]) for v in _views(src, src.state_layers)], 1)
    kv_copy.place([(v, [orders["descending"][0]]) for v in _views(dst, dst.state_layers)], state, 1)
    for name in dst.state_layers:
        assert src.block(name, src_ids[0]).equal(dst.block(name, orders["descending"][0]))


def test_pages_are_read_through_the_buffer_protocol_aligned_or_not(tmp_path):
    src = vllm_kv_caches("LBNHC", 4, seed=7)
    views = _views(src, src.page_layers)
    assert {v.width for v in views} == {16}  # the widest copies these views allow
    ids = [5, 3, 9, 1]
    (page,) = kv_copy.gather([(v, ids) for v in views], 4)
    path = tmp_path / "page"
    path.write_bytes(page)
    odd = bytearray(len(page) + 1)
    odd[1:] = page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        for source in (bytes(page), bytearray(page), memoryview(odd)[1:], mapped):
            dst = vllm_kv_caches("LBNHC", 4, seed=8)
            kv_copy.place([(v, [40, 41, 2, 30]) for v in _views(dst, dst.page_layers)], source, 4)
            for name in src.page_layers:
                for s, d in zip(ids, [40, 41, 2, 30]):
                    assert src.block(name, s).equal(dst.block(name, d)), (type(source), name)


def test_a_boundary_object_is_its_parts_one_after_another_and_places_only_the_tail_asked_for():
    """``gather_parts``: a state part (one block per layer) then a window part (three blocks per
    layer) in one object; ``place_parts`` puts the state back and only the window's last two
    blocks (the first is the request's own), and refuses an object of another size before
    placing anything."""
    src, dst = (vllm_kv_caches("LBNHC", 1, hybrid=True, seed=s) for s in (3, 4))
    assert src.state_layers and src.page_layers
    state, window = _views(src, src.state_layers), _views(src, src.page_layers)
    obj = kv_copy.gather_parts([[(v, [7]) for v in state], [(v, [4, 9, 2]) for v in window]])
    assert obj.nbytes == kv_copy.page_bytes([(v, ()) for v in state], 1) \
        + kv_copy.page_bytes([(v, ()) for v in window], 3)
    d_state, d_window = _views(dst, dst.state_layers), _views(dst, dst.page_layers)
    untouched = {name: dst.block(name, 30).clone() for name in dst.page_layers}
    parts = [([(v, [11]) for v in d_state], 1, 0), ([(v, [21, 22]) for v in d_window], 3, 1)]
    with pytest.raises(kv_copy.KVCopyError, match="parts are"):
        kv_copy.place_parts(parts, bytes(obj)[:-1])
    assert all(dst.block(n, 30).equal(b) for n, b in untouched.items())
    assert kv_copy.place_parts(parts, obj) == obj.nbytes - kv_copy.page_bytes([(v, ()) for v in window], 1)
    for name in dst.state_layers:
        assert dst.block(name, 11).equal(src.block(name, 7))
    for name in dst.page_layers:
        assert dst.block(name, 21).equal(src.block(name, 9)) and dst.block(name, 22).equal(src.block(name, 2))


def test_tensors_that_cannot_be_regrouped_are_refused_with_the_fix():
    kv = vllm_kv_caches("LBHNC", 4, layers=1)
    t = kv.caches[kv.page_layers[0]]
    with pytest.raises(kv_copy.KVCopyError, match="not a multiple.*--block-size"):
        kv_copy.block_view("l", t, NUM_BLOCKS * 4 + 1)
    with pytest.raises(kv_copy.KVCopyError, match="kernel blocks.*--block-size"):
        kv_copy.block_view("l", t.unsqueeze(1), NUM_BLOCKS)  # not [blocks, heads, tokens, content]
    view = kv_copy.block_view("l", t, NUM_BLOCKS)
    (page,) = kv_copy.gather([(view, [0])], 1)
    with pytest.raises(kv_copy.KVCopyError, match=f"outside layer 'l'.s {NUM_BLOCKS} blocks"):
        kv_copy.place([(view, [NUM_BLOCKS])], page, 1)
    with pytest.raises(kv_copy.KVCopyError, match="a page of"):
        kv_copy.place([(view, [1])], bytes(page)[:-1], 1)
