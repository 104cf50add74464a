"""Where a restore's time goes, without an engine: the worker's restore of one stored prompt
into KV tensors laid out as vLLM's CPU backend hands them over, split into its parts.

    python -m bench.restore_path --out bench-out/restore_path.json [--prompt-tokens 2048,8192,32768,65536]
        [--reps 5] [--cold] [--dest-order ascending|descending|shuffled]

Real parts: sparkcache's worker half (``WorkerSide``) and store on disk, vLLM 0.32.0's KV
cache config types, torch tensors of ``testing.tinymodel.BENCH``'s shape (8 layers, 4 KV
heads of 64, bf16, 32-token blocks: 8 KiB per token). Per size one prompt is captured and
published through the worker (as the engine does), then, ``--reps`` times each, timed on
this thread:

- ``raw_read``: every stored object of the prompt read whole into one buffer (``readinto``):
  what the disk or page cache gives, no hashing, no placement;
- ``verify``: the objects read and verified against their manifests' XXH3-128 (``ObjectStore.read_many_verified``, as
  the worker calls it), nothing placed;
- ``place``: the verified pages copied into the destination blocks (the worker's placement
  loop on pages already in memory);
- ``load``: the worker's whole restore (``WorkerSide.load``: verify then place), checked
  byte for byte against the captured KV.

With ``--cold`` the objects are evicted from the page cache before each timed part that
reads them. ``--dest-order``: the destination block ids in ascending order (the default), in
descending order or shuffled (vLLM hands out both after churn). Medians in the JSON, with the
bytes and GB/s of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.restore_ttft import _median, _sizes

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32


def _worker(root: str, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from sparkcache.connector.connector import _open_store
    from sparkcache.connector.kv_layout import describe_kv_layout
    from sparkcache.connector.worker_side import WorkerSide
    from sparkcache.settings import load_settings
    from sparkcache.store import Identity
    from testing.tinymodel import BENCH

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(BENCH.num_layers)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=BENCH.num_kv_heads, head_size=BENCH.head_dim,
                             dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    settings = load_settings(env={}, extra_config={"root": root, "access_mode": "read-write",
                                                    "min_span_tokens": BLOCK, "capture_slot_bytes": "4GiB"})
    identity = Identity("restore-path-bench", "bf16-8x4x64", BLOCK, 0, "untransformed")
    worker = WorkerSide(settings, identity, _open_store(settings), config,
                        describe_kv_layout(config))
    shape = (num_blocks, 2, BLOCK, BENCH.num_kv_heads, BENCH.head_dim)  # vLLM CPU: blocks at dim 0
    torch.manual_seed(0)
    worker.register_kv_caches({n: torch.randn(shape).to(torch.bfloat16) for n in layers})
    return worker


DEST_ORDERS = ("ascending", "descending", "shuffled")


def point(tokens: int, reps: int, cold: bool, work: Path, dest_order: str = "ascending") -> dict:
    import random

    import torch

    from bench.page_cache import evict, read_rate
    from sparkcache.connector.keys import BlockKeys
    from sparkcache.connector.capture_plans import CapturePlan
    from sparkcache.connector.scheduler_side import LoadPlan, StoredPages

    blocks = tokens // BLOCK
    worker = _worker(str(work / f"store-{tokens}"), 2 * blocks + 1)
    try:
        keys = BlockKeys(BLOCK).upto(list(range(1, tokens + 1)), blocks)
        worker.capture(CapturePlan("store", keys, 0, [list(range(blocks))]))
        deadline = time.monotonic() + 600
        while worker.slots.stats.published < 1:
            if worker.slots.stats.publish_failed or time.monotonic() > deadline:
                raise RuntimeError(f"{tokens} tokens: the capture was not published")
            time.sleep(0.05)
        found = worker.store.lookup(worker.identity, keys)
        stored = StoredPages.of(found.handle, 0, blocks)
        paths = [worker.store.objects.path(p.digest) for p in stored.pages]
        nbytes = sum(p.size for p in stored.pages)
        dest = list(range(blocks, 2 * blocks))  # the second half of the cache
        if dest_order == "descending":
            dest.reverse()
        elif dest_order == "shuffled":
            random.Random(0).shuffle(dest)
        reference = {n: kv[:blocks].clone() for n, kv in worker.kv.items()}
        times: dict[str, list[float]] = {"raw_read": [], "verify": [], "place": [], "load": []}
        for _ in range(reps):
            times["raw_read"].append(read_rate(paths, cold=cold)["seconds"])
            if cold:
                evict(paths)
            plan = LoadPlan("r", keys, 0, [dest], sync=True, stored=stored)
            t = time.perf_counter()
            pages = worker.store.objects.read_many_verified(list(stored.pages),
                                                            parallel=worker.read_in_parallel)
            times["verify"].append(time.perf_counter() - t)
            t = time.perf_counter()
            worker._place_pages(plan, list(zip(pages, worker._page_spans(plan, stored))))
            times["place"].append(time.perf_counter() - t)
            del pages
            for kv in worker.kv.values():
                kv[dest] = 0
            if cold:
                evict(paths)
            t = time.perf_counter()
            worker.load(plan)
            times["load"].append(time.perf_counter() - t)
            if worker.take_sync_outcomes() != (["r"], []):
                raise RuntimeError(f"{tokens} tokens: the restore was refused")
            if not all(torch.equal(worker.kv[n][dest], reference[n]) for n in worker.kv):
                raise RuntimeError(f"{tokens} tokens: the restore placed other bytes than were captured")
        med = {k: _median(v) for k, v in times.items()}
        return {"prompt_tokens": tokens, "bytes": nbytes, "pages": len(stored.pages), "dest_order": dest_order,
                "median_s": med, "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
                "load_of_raw_read": med["raw_read"] / med["load"], "all_s": times}
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restore_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "restore_path.json")
    p.add_argument("--prompt-tokens", type=_sizes, default=[2048, 8192, 32768, 65536],
                   help="sizes in tokens, comma-separated (default 2048,8192,32768,65536)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size (medians reported)")
    p.add_argument("--cold", action="store_true", help="evict the stored objects before each timed read")
    p.add_argument("--dest-order", choices=DEST_ORDERS, default="ascending",
                   help="the order of the destination block ids (default ascending)")
    p.add_argument("--work-dir", default=None, help="where the stores live (default: the system temp dir)")
    args = p.parse_args(argv)
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: at least one rep")
    sizes = args.prompt_tokens
    import shutil

    work = Path(tempfile.mkdtemp(prefix="restore_path-", dir=args.work_dir))
    try:
        points = []
        for n in sizes:
            points.append(point(n, args.reps, args.cold, work, args.dest_order))
            m, g = points[-1]["median_s"], points[-1]["gb_per_s"]
            print(f"{n:>7} tokens {points[-1]['bytes'] / 1e6:>7.0f} MB: " +
                  "  ".join(f"{k} {m[k] * 1e3:.1f} ms ({g[k]:.2f} GB/s)" for k in m), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": "restore_path", "page_cache": "cold" if args.cold else "warm", "reps": args.reps,
              "threads": {"torch": __import__("torch").get_num_threads(), "cpus": os.cpu_count()},
              "points": points}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
