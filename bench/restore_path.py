"""Where a capture's and a restore's time go, without an engine: the worker half capturing
one prompt out of KV tensors laid out as vLLM's CPU backend hands them over, publishing it
with its default capture settings, and restoring it, each split into its parts.

    python -m bench.restore_path --out bench-out/restore_path.json [--prompt-tokens 8192,32768,131072]
        [--shape bench|70b-tp4] [--reps 5] [--cold] [--dest-order ascending|descending|shuffled]
        [--capture-only]

Shapes: ``bench`` is ``testing.tinymodel.BENCH`` (8 layers, 4 KV heads of 64, bf16: 8 KiB per
token); ``70b-tp4`` is one rank of a 70B-class GQA model at tensor parallel 4 (80 layers, 2 of
its 8 KV heads of 128, bf16: 80 KiB per token, 10 GiB at 128K tokens). Blocks of 32 tokens
(vLLM's CPU backend).

Real parts: sparkcache's worker half (``WorkerSide``) with its default
``SPARKCACHE_CAPTURE_SLOTS`` and ``SPARKCACHE_CAPTURE_SLOT_BYTES``, its store on disk, vLLM
0.32.0's KV cache config types. Per size, the capture (once):

- ``capture_call``: the time ``WorkerSide.capture`` keeps the calling (model) thread;
- ``copied``: until the worker reports the request in ``finished_sending`` (every page
  copied out of the KV cache: vLLM may free its blocks);
- ``published``: until the entry is published (copied, hashed, written, durable);
- ``raw_copy``: the same bytes copied from the KV tensors into one host buffer (no index,
  no store; at most ``bench.page_cache.BUFFER_CAP``, reused in turn): what a copy alone costs;
- ``peak_rss_added``: the process's peak resident memory during the capture above what it
  was before (sampled every 2 ms), against the bound ``slots x slot bytes``.

Then, in a second worker on the same store and KV bytes (as after a restart: the first's
capture slots gone), ``--reps`` times each (not with ``--capture-only``), timed on this thread:

- ``raw_read``: every stored object of the prompt read whole into one buffer (``readinto``)
  faulted in and out of the CPU's caches, as the restore's blocks are
  (``bench.page_cache.read_rate``): what the disk or page cache gives, no hashing, no
  placement; warm, also ``raw_read_hot_destination``: the same read again into that buffer,
  now in the CPU's caches;
- ``verify``: the objects read into buffers and verified against their manifests' XXH3-128
  (``LocalBackend.read_many_verified``), nothing placed: the first half of what a restore
  through the ring (a device, split kernel blocks) does per object, here over the entry in
  runs of at most ``bench.page_cache.BUFFER_CAP`` bytes;
- ``place``: those verified pages copied into the destination blocks (``kv_copy.place``, the
  ring's second half);
- ``load``: the worker's whole restore (``WorkerSide.load``; on these KV tensors, whose blocks
  are runs in page order as vLLM's CPU backend lays them out, each page read straight into its
  blocks and verified there), checked block by block (XXH3-128 of each restored block against
  the captured one's).

The restore's destination is the captured blocks themselves, zeroed first (then the raw read
runs, which takes them out of the CPU's caches, then the load: both after the same zeroing), in the order
``--dest-order`` gives (ascending, descending or shuffled: vLLM hands out both after churn),
so one KV cache of the prompt's size is enough. With ``--cold`` the objects are evicted from
the page cache before each timed part that reads them. Medians in the JSON, with the bytes
and GB/s of each part.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.page_cache import BUFFER_CAP
from bench.restore_ttft import _median, _sizes

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int  # on this rank
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # K and V, bf16


SHAPES = {"bench": Shape(8, 4, 64), "70b-tp4": Shape(80, 2, 128)}


def _worker(root: str, num_blocks: int, shape: Shape):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from sparkcache.connector.connector import _open_store
    from sparkcache.connector.kv_layout import describe_kv_layout
    from sparkcache.connector.worker_side import WorkerSide
    from sparkcache.settings import load_settings
    from sparkcache.store import Identity

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=shape.kv_heads, head_size=shape.head_dim,
                             dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    settings = load_settings(env={}, extra_config={"root": root, "access_mode": "read-write",
                                                    "min_span_tokens": BLOCK, "max_bytes": "60GiB",
                                                    "low_watermark_bytes": "50GiB"})
    identity = Identity("restore-path-bench", f"bf16-{shape.layers}x{shape.kv_heads}x{shape.head_dim}",
                        BLOCK, 0, "untransformed")
    worker = WorkerSide(settings, identity, _open_store(settings), config,
                        describe_kv_layout(config))
    kv_shape = (num_blocks, 2, BLOCK, shape.kv_heads, shape.head_dim)  # vLLM CPU: blocks at dim 0
    gen = torch.Generator().manual_seed(0)
    worker.register_kv_caches({n: torch.randint(-2**15, 2**15, kv_shape, generator=gen, dtype=torch.int16)
                              .view(torch.bfloat16) for n in layers})
    return worker


def _block_hashes(worker, ids: list[int]) -> list[list[str]]:
    """XXH3-128 of each of ``ids``'s blocks, per layer."""
    import torch
    import xxhash

    return [[xxhash.xxh3_128_hexdigest(kv[b].view(torch.uint8).numpy()) for b in ids]
            for kv in worker.kv.values()]


class _PeakRss:
    """The process's peak resident memory above its level at the start, sampled every 2 ms."""

    def __init__(self) -> None:
        import threading

        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.base


def _capture(worker, keys: list[str], blocks: int) -> dict:
    """Capture blocks 0..blocks-1 as a finished request's pages (the engine's path)."""
    import torch

    from sparkcache.connector.capture_plans import CapturePlan

    nbytes = blocks * sum(v.block_bytes for v in worker.views.values())
    host = torch.empty(min(nbytes, BUFFER_CAP), dtype=torch.uint8)
    t = time.perf_counter()
    at = 0
    for kv in worker.kv.values():  # the same bytes, one plain copy per layer
        part = kv[:blocks].reshape(-1).view(torch.uint8)
        at = 0 if at + part.numel() > host.numel() else at
        host[at:at + part.numel()].copy_(part)
        at += part.numel()
    raw_copy = time.perf_counter() - t
    del host
    rss = _PeakRss()
    t = time.perf_counter()
    worker.capture(CapturePlan("store", keys, 0, [list(range(blocks))]))
    call = time.perf_counter() - t
    copied = None
    deadline = time.monotonic() + 1800
    stats = worker.slots.stats
    while stats.published + stats.publish_failed + stats.skipped_too_large + stats.skipped_slots_full < 1:
        if copied is None and "store" in worker.take_results()[0]:
            copied = time.perf_counter() - t
        if time.monotonic() > deadline:
            raise RuntimeError(f"{blocks} blocks: the capture was not published in 30 minutes")
        time.sleep(0.001)
    published = time.perf_counter() - t
    if copied is None and "store" in worker.take_results()[0]:
        copied = published
    peak = rss.stop()
    if stats.published != 1:
        raise RuntimeError(f"{blocks} blocks: the capture was not published: {stats}")
    bound = worker.slots.n_slots * worker.slots.slot_bytes
    return {"bytes": nbytes, "capture_call_s": call, "copied_s": copied, "published_s": published,
            "raw_copy_s": raw_copy, "gb_per_s": {"copied": nbytes / copied / 1e9,
                                                 "published": nbytes / published / 1e9,
                                                 "raw_copy": nbytes / raw_copy / 1e9},
            "peak_rss_added": peak, "slot_buffer_bytes": worker.slots.buffer_bytes(),
            "in_flight_bound": bound, "within_bound": peak <= bound,
            "skipped_too_large": stats.skipped_too_large}


def _chunks(pages: list) -> list[list]:
    """``pages`` in runs of at most ``BUFFER_CAP`` bytes (at least one page each)."""
    out: list[list] = [[]]
    held = 0
    for page in pages:
        if out[-1] and held + page.size > BUFFER_CAP:
            out.append([])
            held = 0
        out[-1].append(page)
        held += page.size
    return out


DEST_ORDERS = ("ascending", "descending", "shuffled")


def point(tokens: int, reps: int, cold: bool, work: Path, dest_order: str = "ascending",
          shape: Shape = SHAPES["bench"], capture_only: bool = False) -> dict:
    import random

    import torch

    from bench.page_cache import evict, read_rate
    from sparkcache.connector.keys import BlockKeys
    from sparkcache.connector.scheduler_side import LoadPlan, StoredPages

    blocks = tokens // BLOCK
    worker = _worker(str(work / f"store-{tokens}"), blocks + 1, shape)
    try:
        keys = BlockKeys(BLOCK).upto(list(range(1, tokens + 1)), blocks)
        capture = _capture(worker, keys, blocks)
        out = {"prompt_tokens": tokens, "bytes": capture["bytes"], "capture": capture}
        if capture_only:
            return out
        # the restore in a worker of its own, as after a restart: the capture's slot buffers
        # are gone with the first (the same seed gives the second the same KV bytes)
        worker.close()
        worker = None
        gc.collect()  # its KV cache too, before the second's
        worker = _worker(str(work / f"store-{tokens}"), blocks + 1, shape)
        found = worker.store.lookup(worker.identity, keys)
        stored = StoredPages.of(found.handle, 0, blocks)
        paths = [worker.store.objects.path(p.digest) for p in stored.pages]
        nbytes = sum(p.size for p in stored.pages)
        dest = list(range(blocks))  # the captured blocks themselves, zeroed before each restore
        if dest_order == "descending":
            dest.reverse()
        elif dest_order == "shuffled":
            random.Random(0).shuffle(dest)
        reference = _block_hashes(worker, list(range(blocks)))
        times: dict[str, list[float]] = {"raw_read": [], "verify": [], "place": [], "load": []}
        for _ in range(reps):
            plan = LoadPlan("r", keys, 0, [dest], sync=True, stored=stored)
            if cold:
                evict(paths)
            verify = place = 0.0
            spans = iter(worker._page_spans(plan, stored))
            for chunk in _chunks(list(stored.pages)):  # in turn, so no second copy of a large entry
                t = time.perf_counter()
                pages = worker.store.objects.read_many_verified(chunk, parallel=worker.read_in_parallel)
                verify += time.perf_counter() - t
                t = time.perf_counter()
                for page in pages:
                    worker._place_page(plan, page, next(spans))
                place += time.perf_counter() - t
                del pages
            times["verify"].append(verify)
            times["place"].append(place)
            for kv in worker.kv.values():
                kv[:blocks] = 0
            # the raw read and the load one after the other, in the same state (the zeroing's
            # OpenMP threads spinning down beside the first, not the second)
            raw = read_rate(paths, cold=cold)  # it also takes the zeroed blocks out of the CPU's caches
            times["raw_read"].append(raw["seconds"])
            if "hot_destination_seconds" in raw:
                times.setdefault("raw_read_hot_destination", []).append(raw["hot_destination_seconds"])
            if cold:
                evict(paths)
            t = time.perf_counter()
            worker.load(plan)
            times["load"].append(time.perf_counter() - t)
            if worker.take_sync_outcomes() != (["r"], []):
                raise RuntimeError(f"{tokens} tokens: the restore was refused")
            if _block_hashes(worker, dest) != reference:
                raise RuntimeError(f"{tokens} tokens: the restore placed other bytes than were captured")
        med = {k: _median(v) for k, v in times.items()}
        out.update({"pages": len(stored.pages), "dest_order": dest_order, "median_s": med,
                    "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
                    "load_of_raw_read": med["raw_read"] / med["load"], "all_s": times})
        return out
    finally:
        if worker is not None:
            worker.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restore_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "restore_path.json")
    p.add_argument("--prompt-tokens", type=_sizes, default=[8192, 32768, 131072],
                   help="sizes in tokens, comma-separated (default 8192,32768,131072)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size (medians reported)")
    p.add_argument("--cold", action="store_true", help="evict the stored objects before each timed read")
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                   help="the KV cache of one rank: the bench model's, or a 70B GQA model's at TP 4")
    p.add_argument("--capture-only", action="store_true", help="measure the capture alone (no restore)")
    p.add_argument("--dest-order", choices=DEST_ORDERS, default="ascending",
                   help="the order of the destination block ids (default ascending)")
    p.add_argument("--work-dir", default=None, help="where the stores live (default: the system temp dir)")
    args = p.parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: at least one rep")
    sizes = args.prompt_tokens
    import shutil

    # imported here, not in the first _worker: the import keeps the importing frame alive (a
    # vLLM base class's creation holds the stack), and that frame's worker with it
    import sparkcache.connector.connector  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="restore_path-", dir=args.work_dir))
    try:
        points = []
        for n in sizes:
            points.append(point(n, args.reps, args.cold, work, args.dest_order, SHAPES[args.shape],
                                args.capture_only))
            c = points[-1]["capture"]
            line = (f"{n:>7} tokens {points[-1]['bytes'] / 1e6:>7.0f} MB: capture call "
                    f"{c['capture_call_s'] * 1e3:.2f} ms, copied {c['copied_s']:.2f} s "
                    f"({c['gb_per_s']['copied']:.2f} GB/s; raw copy {c['gb_per_s']['raw_copy']:.2f}), "
                    f"published {c['published_s']:.2f} s ({c['gb_per_s']['published']:.2f} GB/s), "
                    f"peak RSS added {c['peak_rss_added'] / 2**20:.0f} MiB of {c['in_flight_bound'] / 2**20:.0f}")
            if "median_s" in points[-1]:
                m, g = points[-1]["median_s"], points[-1]["gb_per_s"]
                line += "\n" + " " * 8 + "  ".join(f"{k} {m[k] * 1e3:.1f} ms ({g[k]:.2f} GB/s)" for k in m)
            print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": "restore_path", "shape": args.shape, "page_cache": "cold" if args.cold else "warm", "reps": args.reps,
              "threads": {"torch": __import__("torch").get_num_threads(), "cpus": os.cpu_count()},
              "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
