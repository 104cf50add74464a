"""The data path's device check: ``sparkcache/connector/kv_copy.py`` (every tensor operation of
a capture and a restore) on the KV cache views vLLM 0.32.0 hands a connector, with torch alone
(no vLLM, no store: what a GPU machine without vLLM can run).

    python -m testing.vllm_kv_caches --out views.json     # where vLLM is installed: its own views
    python -m bench.gpu_copy --views views.json --out gpu_copy.json [--device cuda|cpu] [--tokens 32768]

``--views`` is vLLM's own view of every layout and kernel-block split (``testing.vllm_kv_caches``:
``allocate_kv_cache`` on CPU tensors, written as dtype, shape, strides and offset per layer);
each is rebuilt here with ``torch.as_strided`` over an allocation on ``--device``.

- **A, layouts**: for each case (the four dense stride orders and the two strided ones, kernel
  blocks 1 and 4 per block, attention only and with a recurrent state group), 20 blocks are
  captured from shuffled ids (``kv_copy.gather``, on CUDA after a ``copy_marker`` on the side
  stream), restored into other ids in descending order in a second allocation of other random
  bytes through the worker's ring (``restore_ring``: each page, then the state, into a host
  slot, then ``kv_copy.place`` / ``place_parts``; on CUDA from pinned slots over the ring's load
  stream, the current stream ordered after it), and every manager block compared
  byte for byte (regrouped as vLLM's ``group_kernel_blocks`` does), and no byte outside them
  changed.
- **B, stall** (CUDA only): with ``STALL_SECONDS`` of ``torch.cuda._sleep`` queued on the compute stream,
  how long the model thread is held by a capture (recording its marker and handing the copy to
  another thread, as ``WorkerSide.capture`` does) and by a synchronous restore of one page
  through the ring (read into a pinned slot, its copies queued on the load stream, the model's
  stream ordered after them): the target is under 1 ms each.
- **C, throughput**: one rank of a 70B-class GQA model at tensor parallel 4 (80 layers, 2 KV
  heads of 128, bf16, 16-token blocks) at ``--tokens``: a capture (``gather`` into a host buffer,
  pinned on CUDA), a placement (``place`` of those pages from it) and a restore through the
  ring (each page copied into a slot by 4 reader threads, standing in for the reads from the
  page cache, then placed from it) against a raw device-to-host and host-to-device copy of the
  same bytes (pinned on CUDA), as GB/s and ratios.

Writes the JSON (``--out``) and prints a line per part. On a CPU (``--device cpu``, what the
test suite runs) B is skipped as not applicable and C runs on host memory.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sparkcache.connector import kv_copy, restore_ring
from sparkcache.store.layout import done_now

CAPTURED = 20
PAGE_BLOCKS = 8
STALL_SECONDS = 0.3  # the compute stream's queued work in B: far longer than the calls' target
CALIBRATION_CYCLES = 10**7


def _rebuild(desc: dict, device: torch.device, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (desc["raw_bytes"],), dtype=torch.uint8, generator=gen).to(device)
    caches = {}
    for name, v in {**desc["page_layers"], **desc["state_layers"]}.items():
        typed = raw.view(getattr(torch, v["dtype"]))
        caches[name] = torch.as_strided(typed, v["shape"], v["stride"], v["offset"])
    return raw, caches


def _blocks(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """vLLM's ``group_kernel_blocks``: dim 0 the manager block."""
    return t if t.shape[0] == num_blocks else t.unflatten(0, (num_blocks, -1))


def _mask(raw: torch.Tensor, caches: dict, num_blocks: int, blocks: dict[str, list[int]]) -> torch.Tensor:
    """True at every byte of ``raw`` that blocks ``blocks`` (layer -> ids) hold."""
    twin = torch.zeros_like(raw)
    for name, ids in blocks.items():
        t = caches[name]
        over = torch.as_strided(twin.view(t.dtype), t.shape, t.stride(), t.storage_offset())
        grouped = _blocks(over, num_blocks)
        for b in ids:
            grouped[b].view(torch.uint8).fill_(1)
    return twin.bool()


def layout_case(desc: dict, device: torch.device) -> dict:
    nb, pages, states = desc["num_blocks"], list(desc["page_layers"]), list(desc["state_layers"])
    src_raw, src = _rebuild(desc, device, 1)
    dst_raw, dst = _rebuild(desc, device, 2)
    rng = random.Random(f"{desc['layout']}{desc['ratio']}{desc['hybrid']}")
    src_ids = rng.sample(range(1, nb), CAPTURED + bool(states))
    src_state = src_ids.pop() if states else None
    dst_ids = list(range(nb - 1, nb - 1 - CAPTURED, -1))
    placed = {n: dst_ids for n in pages}
    dst_state = None
    if states:  # groups overlay one allocation: a state block whose bytes no page block holds
        busy = _mask(dst_raw, dst, nb, placed)
        dst_state = next(b for b in range(1, nb) if not (_mask(dst_raw, dst, nb, {n: [b] for n in states}) & busy).any())
        placed.update({n: [dst_state] for n in states})
    sv = {n: kv_copy.block_view(n, t, nb) for n, t in src.items()}
    dv = {n: kv_copy.block_view(n, t, nb) for n, t in dst.items()}
    before = dst_raw.clone()
    layers = [(sv[n], src_ids) for n in pages]
    got = kv_copy.gather(layers, PAGE_BLOCKS, after=kv_copy.copy_marker(layers))
    objects = got + ([kv_copy.gather_parts([[(sv[n], [src_state]) for n in states]])] if states else [])

    def place(k: int, obj: torch.Tensor) -> int:
        if k == len(got):  # the state, after every page
            return kv_copy.place_parts([([(dv[n], [dst_state]) for n in states], 1, 0)], obj)
        ids = dst_ids[k * PAGE_BLOCKS:(k + 1) * PAGE_BLOCKS]
        return kv_copy.place([(dv[n], ids) for n in pages], obj, len(ids))

    ring = restore_ring.RestoreRing(max(o.nbytes for o in objects), device, slots=2)
    _, copied = ring.restore([o.nbytes for o in objects], _reader(objects), place, done_now)
    restore_ring.order_current_stream_after(copied, device)
    _sync(device)
    pairs = [(n, s, d) for n in pages for s, d in zip(src_ids, dst_ids)]
    pairs += [(n, src_state, dst_state) for n in states]
    wrong = [p for p in pairs if not _blocks(src[p[0]], nb)[p[1]].view(torch.uint8).equal(
        _blocks(dst[p[0]], nb)[p[2]].view(torch.uint8))]
    outside = ~_mask(dst_raw, dst, nb, placed)
    return {"layout": desc["layout"], "ratio": desc["ratio"], "hybrid": desc["hybrid"],
            "blocks_compared": len(pairs), "blocks_wrong": len(wrong),
            "outside_unchanged": bool(dst_raw[outside].equal(before[outside])),
            "ok": not wrong and bool(dst_raw[outside].equal(before[outside]))}


def _reader(objects: list[memoryview]):
    """A ring's ``read_into`` over objects in memory: what a verified read from the page cache
    leaves in the slot."""
    def read_into(k: int, buffer: memoryview) -> None:
        buffer[:] = objects[k]
    return read_into


def _kv_70b(tokens: int, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    block, layers, heads, head = 16, 80, 2, 128
    blocks = tokens // block
    caches = {f"l{i}": torch.empty((blocks + 1, heads, block, 2 * head), dtype=torch.bfloat16, device=device)
              for i in range(layers)}  # [B, H, N, C]: K and V of a head side by side
    for t in caches.values():
        t.view(torch.int16).random_()
    return caches, blocks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(tokens: int, device: torch.device) -> dict:
    caches, blocks = _kv_70b(tokens, device)
    views = {n: kv_copy.block_view(n, t, blocks + 1) for n, t in caches.items()}
    nbytes = blocks * sum(v.block_bytes for v in views.values())
    pinned = device.type == "cuda"
    host = kv_copy.host_buffer(nbytes, pinned)
    host_t = torch.frombuffer(host, dtype=torch.uint8)
    flat = [t[:blocks].reshape(-1).view(torch.uint8) for t in caches.values()]
    ids = list(range(blocks))
    random.Random(0).shuffle(ids)
    out = {"tokens": tokens, "bytes": nbytes, "pinned_host": pinned}
    for name, run in (
        ("raw_device_to_host", lambda: _raw(flat, host_t, to_host=True)),
        ("capture", lambda: kv_copy.gather([(v, ids) for v in views.values()], 256, host,
                                           after=kv_copy.copy_marker([(v, ids) for v in views.values()]))),
        ("raw_host_to_device", lambda: _raw(flat, host_t, to_host=False)),
        ("place", lambda: _place_all(views, host, ids)),
        ("restore", lambda: _ring_all(views, host, ids, device)),
    ):
        _sync(device)
        t = time.perf_counter()
        run()
        _sync(device)
        out[name + "_s"] = time.perf_counter() - t
        out[name + "_gb_per_s"] = nbytes / out[name + "_s"] / 1e9
    out["capture_of_raw"] = out["raw_device_to_host_s"] / out["capture_s"]
    out["place_of_raw"] = out["raw_host_to_device_s"] / out["place_s"]
    out["restore_of_raw"] = out["raw_host_to_device_s"] / out["restore_s"]
    return out


def _raw(flat: list[torch.Tensor], host: torch.Tensor, to_host: bool) -> None:
    at = 0
    for part in flat:
        n = part.numel()
        if to_host:
            host[at:at + n].copy_(part, non_blocking=True)
        else:
            part.copy_(host[at:at + n], non_blocking=True)
        at += n


def _place_all(views: dict, host: memoryview, ids: list[int], page_blocks: int = 256) -> None:
    per_block = sum(v.block_bytes for v in views.values())
    for k in range(0, len(ids), page_blocks):
        part = ids[k:k + page_blocks]
        page = host[k * per_block:(k + len(part)) * per_block]
        kv_copy.place([(v, part) for v in views.values()], page, len(part))


def _ring_all(views: dict, host: memoryview, ids: list[int], device: torch.device,
              page_blocks: int = 256) -> None:
    per_block = sum(v.block_bytes for v in views.values())
    starts = range(0, len(ids), page_blocks)
    pages = [host[k * per_block:min(k + page_blocks, len(ids)) * per_block] for k in starts]

    def place(k: int, obj: torch.Tensor) -> int:
        part = ids[starts[k]:starts[k] + page_blocks]
        return kv_copy.place([(v, part) for v in views.values()], obj, len(part))

    ring = restore_ring.RestoreRing(page_blocks * per_block, device)
    with ThreadPoolExecutor(4) as readers:
        _, copied = ring.restore([p.nbytes for p in pages], _reader(pages), place, readers.submit)
    restore_ring.order_current_stream_after(copied, device)


def stall(device: torch.device) -> dict:
    """The model thread's time in a capture and a restore call with ``STALL_SECONDS`` of work
    queued ahead of them on the compute stream."""
    caches, blocks = _kv_70b(1024, device)
    views = [(kv_copy.block_view(n, t, blocks + 1), list(range(blocks))) for n, t in caches.items()]
    page = memoryview(bytes(blocks * sum(v.block_bytes for v, _ in views)))
    ring = restore_ring.RestoreRing(page.nbytes, device)  # made before: the worker's is made at its start
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)  # how many of _sleep's cycles make a second here
    end.record()
    end.synchronize()
    cycles_per_s = CALIBRATION_CYCLES / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(STALL_SECONDS * cycles_per_s))  # queued, not waited for
    t = time.perf_counter()
    marker = kv_copy.copy_marker(views)
    copier = threading.Thread(target=kv_copy.gather, args=(views, 16, None, marker))
    copier.start()
    capture_s = time.perf_counter() - t
    t = time.perf_counter()
    _, copied = ring.restore([page.nbytes], _reader([page]),
                             lambda k, obj: kv_copy.place(views, obj, blocks), done_now)
    restore_ring.order_current_stream_after(copied, device)
    restore_s = time.perf_counter() - t
    copier.join()
    torch.cuda.synchronize(device)
    return {"capture_call_s": capture_s, "restore_call_s": restore_s,
            "capture_under_1ms": capture_s < 1e-3, "restore_under_1ms": restore_s < 1e-3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--views", type=Path, required=True, help="python -m testing.vllm_kv_caches --out FILE")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=32768, help="C's conversation length (default 32768)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cases = [layout_case(desc, device) for desc in json.loads(args.views.read_text())]
    print(f"A layouts: {sum(c['ok'] for c in cases)}/{len(cases)} cases byte for byte", flush=True)
    result = {"bench": "gpu_copy", "device": str(device), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "layouts": cases, "all_layouts_ok": all(c["ok"] for c in cases)}
    result["stall"] = stall(device) if device.type == "cuda" else "not applicable: no CUDA stream"
    print(f"B stall: {result['stall']}", flush=True)
    result["throughput"] = throughput(args.tokens, device)
    c = result["throughput"]
    print(f"C {args.tokens} tokens, {c['bytes'] / 2**30:.2f} GiB: capture {c['capture_gb_per_s']:.2f} GB/s "
          f"({c['capture_of_raw']:.2f} of raw), place {c['place_gb_per_s']:.2f} GB/s "
          f"({c['place_of_raw']:.2f} of raw), restore through the ring {c['restore_gb_per_s']:.2f} GB/s "
          f"({c['restore_of_raw']:.2f} of raw)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0 if result["all_layouts_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
