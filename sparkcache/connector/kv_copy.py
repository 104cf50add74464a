"""Every tensor operation of capture and restore, in torch alone (no vLLM import).

**Views.** vLLM 0.32.0 hands ``register_kv_caches`` one tensor per layer: the logical
``[B, H, N, C]`` view (blocks, heads, the block's tokens, content) of ``KVCacheLayout`` over
the backing allocation, strided by the physical stride order (LBHNC, LBNHC, LHBNC, BLHNC,
BLNHC or BHLNC). When the attention backend's kernels take smaller blocks than the KV cache
manager's, vLLM splits each manager block into ``ratio`` kernel blocks and dim 0 counts
kernel blocks: manager block ``b`` is kernel blocks ``b * ratio .. b * ratio + ratio - 1``,
in token order (``create_kv_cache_views``; the block table maps each id the same way).
``block_view`` regroups as vLLM's ``group_kernel_blocks`` does (dim 0 unflattened into
``(B, ratio)``) and moves the kernel-block axis beside the token axis: ``[B, H, ratio,
N / ratio, C]``, a strided view of the same bytes whose dim 0 is the manager block, in
every stride order. Recurrent (Mamba) layers are never split: ``[B, 1, 1, state bytes]``.

**Page bytes.** A block's bytes in a page are its view's elements in order: the logical
``[H, N, C]`` array of the whole manager block (heads, then its tokens in order, then the
content), whatever the stride order and the kernel block size. That is what a cache that is
not split always gave (``kv[layer][block].contiguous()``), so stored entries keep their
identity, and an entry is the same bytes on every backend. A page holds, layer after layer,
each layer's blocks of the page, block after block (``gather``); an entry's boundary object
is such pages one after another (``gather_parts``): one block per recurrent layer, then each
window group's blocks before the boundary.

**Copies.** A capture gathers each layer's blocks with one ``index_select`` on the KV
cache's device and copies them into the pages' host buffer (one copy per layer for the full
pages, one for a short last page). A restore places each page with one ``index_copy_`` per
layer and one index tensor, for block ids in any order (vLLM hands descending and shuffled
ids after churn); on an accelerator the page goes over once first. Both run on the widest
element (up to 16 bytes) that the view's strides and both buffers' alignment allow, since
indexed copies go element by element (docs/RESULTS.md, "Measurements behind the code");
the bytes are the same at every width.

The buffers a restore reads are anything with the buffer protocol (``mmap``, ``bytearray``,
``memoryview``, ``bytes``): read through ``torch.frombuffer``, never a type's own methods.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

# What a restore reads a page from: anything with the buffer protocol.
PageBuffer = bytes | bytearray | memoryview | mmap.mmap
# Element types by width in bytes, widest first; copies move whole elements, never convert.
_BY_WIDTH = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class KVCopyError(ValueError):
    """A KV cache tensor, block id or page that does not fit; the message names the value
    and the fix."""


@dataclass(frozen=True)
class BlockView:
    """One layer's KV cache by manager block (``block_view``)."""

    layer: str
    blocks: torch.Tensor  # uint8, dim 0 the manager block, the rest in page byte order
    ratio: int            # kernel blocks per manager block (1: not split)
    width: int            # the widest element (bytes) the view's strides and address allow

    @functools.cached_property
    def block_bytes(self) -> int:  # asked per layer on every restore: one tensor view made once
        return self.blocks[0].numel()

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def typed(self, width: int) -> torch.Tensor:
        return self.blocks.view(_BY_WIDTH[width])


def block_memory(view: BlockView) -> memoryview | None:
    """The layer's KV cache as one writable byte buffer from block 0's first byte, when it is
    in host memory and each manager block's page bytes lie in one run in page order (block
    ``b`` at ``b * blocks.stride(0)``): a restore then reads a page's bytes straight into
    its destination blocks (``WorkerSide``), no copy between. None otherwise (a device, or
    kernel blocks whose tokens are not adjacent)."""
    b = view.blocks
    if (b.device.type != "cpu" or b.shape[0] == 0 or not b[0].is_contiguous()
            or (b.shape[0] > 1 and b.stride(0) < view.block_bytes)):  # blocks that overlap: never
        return None
    span = (b.shape[0] - 1) * b.stride(0) + view.block_bytes
    return memoryview((ctypes.c_ubyte * span).from_address(b.data_ptr())).cast("B")


def _widest(t: torch.Tensor, at_most: int = 16) -> int:
    """The widest element width (dividing ``at_most``) that ``t`` (uint8) can be viewed as:
    its address, offset, strides and last dim divisible by it, the last dim contiguous."""
    for width in (16, 8, 4, 2):
        if at_most % width or t.data_ptr() % width:
            continue
        try:
            t.view(_BY_WIDTH[width])
        except RuntimeError:
            continue
        return width
    return 1


def block_view(layer: str, tensor: torch.Tensor, num_blocks: int) -> BlockView:
    """``tensor`` (what vLLM hands ``register_kv_caches`` for ``layer``) as manager blocks.
    KVCopyError when it cannot be regrouped: dim 0 not a multiple of the KV cache config's
    ``num_blocks``, or kernel blocks in a tensor that is not vLLM 0.32.0's ``[B, H, N, C]``."""
    fix = ("Fix: run with --block-size equal to the attention backend's kernel block size (vLLM "
           "then splits no block), or switch the store off with SPARKCACHE_ENABLED=0")
    if tensor.dim() < 2 or num_blocks <= 0 or tensor.shape[0] % num_blocks:
        raise KVCopyError(f"sparkcache: the KV cache of layer {layer!r} has shape "
                          f"{tuple(tensor.shape)}; dim 0 is not a multiple of the KV cache's "
                          f"{num_blocks} blocks, so its blocks cannot be found. {fix}")
    try:
        u = tensor.view(torch.uint8)
    except RuntimeError as exc:
        raise KVCopyError(f"sparkcache: the KV cache of layer {layer!r} (shape "
                          f"{tuple(tensor.shape)}, strides {tensor.stride()}, {tensor.dtype}) "
                          f"cannot be read as bytes: {exc}. {fix}") from None
    ratio = tensor.shape[0] // num_blocks
    if ratio > 1:
        if u.dim() != 4:
            raise KVCopyError(f"sparkcache: the KV cache of layer {layer!r} has {ratio} kernel "
                              f"blocks per block in shape {tuple(tensor.shape)}, not vLLM "
                              f"0.32.0's [blocks, heads, tokens, content]: its tokens cannot be "
                              f"put back in order. {fix}")
        u = u.unflatten(0, (num_blocks, ratio)).permute(0, 2, 1, 3, 4)
    return BlockView(layer, u, ratio, _widest(u))


def check_ids(ids: Sequence[int], view: BlockView) -> None:
    """KVCopyError unless every id is one of ``view``'s blocks."""
    if ids and not (0 <= min(ids) and max(ids) < view.num_blocks):
        raise KVCopyError(f"sparkcache: block ids {min(ids)}..{max(ids)} outside layer "
                          f"{view.layer!r}'s {view.num_blocks} blocks")


def _index(ids: Sequence[int], view: BlockView) -> torch.Tensor:
    check_ids(ids, view)
    return torch.tensor(list(ids), dtype=torch.long, device=view.device)


def _indices(layers: Sequence[tuple[BlockView, Sequence[int]]]) -> list[torch.Tensor]:
    """One index tensor per layer, built once per list of ids and device (a group's layers
    share their ids)."""
    made: dict[tuple[int, torch.device], torch.Tensor] = {}
    out = []
    for view, ids in layers:
        key = (id(ids), view.device)
        if key not in made:
            made[key] = _index(ids, view)
        out.append(made[key])
    return out


def page_bytes(layers: Sequence[tuple[BlockView, Sequence[int]]], blocks: int) -> int:
    return blocks * sum(view.block_bytes for view, _ in layers)


def host_buffer(nbytes: int, pinned: bool) -> memoryview:
    """``nbytes`` of host memory for captures, page-locked when ``pinned`` (an accelerator's
    copies into it then run without a bounce). Unpinned, its pages are only backed once
    written: a slot costs the bytes its largest capture used."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    return memoryview(t.numpy())  # keeps ``t`` alive


def copy_marker(layers: Sequence[tuple[BlockView, Sequence[int]]]) -> object | None:
    """An event on the current stream of the layers' accelerator (what a later ``gather``
    on another thread waits for: the forwards that wrote the blocks), or None on the CPU."""
    cuda = next((v.device for v, _ in layers if v.device.type == "cuda"), None)
    return None if cuda is None else torch.cuda.current_stream(cuda).record_event()


_SIDE_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    """A copy stream per accelerator, made once, so a capture never queues behind (or holds
    up) the model's forwards."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def gather(layers: Sequence[tuple[BlockView, Sequence[int]]], page_blocks: int,
           out: memoryview | None = None, after: object | None = None) -> list[memoryview]:
    """The pages of blocks ``ids`` of every ``(view, ids)`` (all ``ids`` of one length ``n``):
    pages of ``page_blocks`` blocks, the last one short when ``n`` is not a multiple; in each,
    every layer's blocks of that page, layer after layer, block after block. One buffer in
    host memory under them all (``out``'s first bytes when given, else a new one); one
    ``index_select`` per layer. ``after`` (a ``copy_marker``): on an accelerator the copies
    run on a side stream once that event is reached, and this returns when they are done."""
    counts = {len(ids) for _, ids in layers}
    if len(counts) > 1:
        raise KVCopyError(f"sparkcache: a capture names {sorted(counts)} blocks in different "
                          "layers; every layer's page holds the same blocks")
    n = counts.pop() if counts else 0
    per_block = page_bytes(layers, 1)
    if n == 0 or per_block == 0:
        return []
    if out is not None and out.nbytes < n * per_block:
        raise KVCopyError(f"sparkcache: {n} blocks of {per_block} bytes do not fit a buffer of "
                          f"{out.nbytes} bytes")
    host = memoryview(bytearray(n * per_block)) if out is None else out[:n * per_block]
    if after is not None:
        stream = _side_stream(next(v.device for v, _ in layers if v.device.type == "cuda"))
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            _gather_into(torch.frombuffer(host, dtype=torch.uint8), layers, n, page_blocks)
        stream.synchronize()
    else:
        _gather_into(torch.frombuffer(host, dtype=torch.uint8), layers, n, page_blocks)
    full, short = divmod(n, page_blocks)
    sizes = [page_blocks] * full + ([short] if short else [])
    starts = [p * page_blocks * per_block for p in range(len(sizes))]
    return [host[s:s + k * per_block] for s, k in zip(starts, sizes)]


def _gather_into(out: torch.Tensor, layers: Sequence[tuple[BlockView, Sequence[int]]], n: int,
                 page_blocks: int) -> None:
    per_block = page_bytes(layers, 1)
    full, short = divmod(n, page_blocks)
    before = 0  # bytes of the layers before this one, per block
    for (view, _), idx in zip(layers, _indices(layers)):
        bb = view.block_bytes
        got = view.typed(view.width).index_select(0, idx).view(torch.uint8).reshape(n, bb)
        if full:  # layer l of full page p starts at p * page + before * page_blocks
            out.as_strided((full, page_blocks * bb), (page_blocks * per_block, 1),
                           before * page_blocks).copy_(got[:full * page_blocks].reshape(full, -1))
        if short:
            at = full * page_blocks * per_block + before * short
            out[at:at + short * bb].view(short, bb).copy_(got[full * page_blocks:])
        before += bb


def _source(page: PageBuffer | torch.Tensor) -> torch.Tensor:
    """The page as a flat uint8 tensor: a tensor as it is (a ring's slot, a device staging
    buffer), a buffer through ``frombuffer``."""
    if isinstance(page, torch.Tensor):
        return page.view(torch.uint8).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer of a read-only buffer: we only read it
        return torch.frombuffer(page, dtype=torch.uint8)


def place(layers: Sequence[tuple[BlockView, Sequence[int]]], page: PageBuffer | torch.Tensor,
          page_blocks: int, skip: int = 0) -> int:
    """Copy blocks ``skip .. skip + len(ids)`` of each layer of ``page`` (a page of
    ``page_blocks`` blocks, as ``gather`` lays it out; a buffer, or a uint8 tensor on any
    device) into blocks ``ids`` of that layer's view, ids in any order: one ``index_copy_``
    per layer. Returns the bytes placed."""
    src = _source(page)
    size = src.numel()
    if size != page_bytes(layers, page_blocks):
        raise KVCopyError(f"sparkcache: a page of {size} bytes; {page_blocks} blocks of these "
                          f"{len(layers)} layers are {page_bytes(layers, page_blocks)} bytes")
    if size == 0:
        return 0
    staged: dict[torch.device, torch.Tensor] = {src.device: src}
    offset = placed = 0
    for (view, ids), idx in zip(layers, _indices(layers)):
        bb, m = view.block_bytes, len(ids)
        if skip + m > page_blocks:
            raise KVCopyError(f"sparkcache: blocks {skip}..{skip + m - 1} of a page of "
                              f"{page_blocks} blocks")
        part = staged.get(view.device)  # on another device, the whole page goes over once
        if part is None:
            part = staged[view.device] = src.to(view.device)
        part = part[offset + skip * bb:offset + (skip + m) * bb]
        offset += page_blocks * bb
        if m == 0:
            continue
        width = _widest(part, view.width)
        dst = view.typed(width)
        dst.index_copy_(0, idx, part.view(_BY_WIDTH[width]).view(m, *dst.shape[1:]))
        placed += m * bb
    return placed


def gather_parts(parts: Sequence[Sequence[tuple[BlockView, Sequence[int]]]],
                 out: memoryview | None = None) -> memoryview:
    """One object of several parts, part after part: each a page of all its layers' blocks
    (``gather`` with one page for every id of the part), in ``out``'s first bytes when given."""
    parts = [layers for layers in parts if layers and layers[0][1]]
    sizes = [page_bytes(layers, len(layers[0][1])) for layers in parts]
    if out is None:
        out = memoryview(bytearray(sum(sizes)))
    if out.nbytes < sum(sizes):
        raise KVCopyError(f"sparkcache: an object of {sum(sizes)} bytes does not fit a buffer of "
                          f"{out.nbytes} bytes")
    at = 0
    for layers, size in zip(parts, sizes):
        gather(layers, len(layers[0][1]), out[at:at + size])
        at += size
    return out[:at]


def place_parts(parts: Sequence[tuple[Sequence[tuple[BlockView, Sequence[int]]], int, int]],
                obj: PageBuffer | torch.Tensor) -> int:
    """Place an object ``gather_parts`` made (a buffer, or a uint8 tensor on any device). Each
    part: its layers with destination ids, the blocks it holds and the first of them to place
    (``place``'s ``skip``: the ids are the part's last ones). Returns the bytes placed; an
    object of another size places nothing."""
    buf = _source(obj)
    sizes = [page_bytes(layers, blocks) for layers, blocks, _ in parts]
    if sum(sizes) != buf.numel():
        raise KVCopyError(f"sparkcache: an object of {buf.numel()} bytes; its parts are {sizes} bytes")
    offset = placed = 0
    for (layers, blocks, skip), size in zip(parts, sizes):
        placed += place(layers, buf[offset:offset + size], blocks, skip)
        offset += size
    return placed
