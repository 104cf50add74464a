"""A restore from the shared tier (issue 44): what a replica with an empty local store pays to
resume a conversation another replica published, against recomputing it and against a local
restore, and how fast the tier reads the bucket against a raw GET of the same objects.

    python -m bench.remote_restore --out DIR [--prompt-tokens 8192,32768] [--reps 3]
                                   [--prompts 2] [--parts store,engine]

One ``weed mini`` (``testing.seaweedfs``) on 127.0.0.1 under DIR, the bucket's keys in the standard
AWS variables, and per prompt size two parts:

- **store**: an entry of the bench model's pages (random bytes, the size its KV cache gives that
  many tokens) published in a local store and uploaded by its tier; then, ``--reps`` times,
  each first in turn, (a) ``RemoteTier.fetch`` of it into a fresh, empty local store (the
  pointer search, the manifest, every object GET and verified, written into the local store
  with its fsyncs), (b) a raw GET of the same objects with the same client and as many in
  flight (``SPARKCACHE_REMOTE_REQUESTS_IN_FLIGHT``), nothing checked or written, and (c) the
  raw GET with each object written to a new file as it arrives (no hash, no sync): the least
  any fetch that keeps the bytes locally does; then a local verified read of the fetched entry.
  Rates are the objects' bytes over each one's wall time.
- **engine** (vLLM on CPU, the bench model, ``bench.restore_ttft``'s engine life): life A with an
  empty local root serves the prompts (its TTFT is the recompute), publishes them and uploads
  them before it stops; per rep, life B with another empty local root and the same bucket
  restores them from the tier (its TTFT is the remote restore), then life C on B's root restores
  them from B's local store. Every restoring life must give the same greedy tokens per prompt
  (they place the same bytes and compute the same suffix); whether the storing life's match
  them is reported beside (it computed the whole prompt in one forward, whose bf16 sums may
  differ from a forward over the suffix alone).

Writes DIR/remote_restore.json and DIR/remote_restore.png. Machines are noisy: the store part's
two reads alternate within each rep and are compared as medians of one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE_BLOCKS = 16      # the connector's default pages
BLOCK_TOKENS = 32     # vLLM's CPU block size for the bench model (bench.restore_ttft.LLAMA_SHAPE)
RATE_TARGET = 0.8     # the remote read rate against a raw GET (issue 44)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _chain(n: int, seed: str) -> list[str]:
    """``n`` chained block keys (40 hex, as the connector's)."""
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(f"{prev}\n{i}".encode()).hexdigest()[:40]
        keys.append(prev)
    return keys


# ---------------------------------------------------------------------- the store part

def store_point(server, prompt_tokens: int, reps: int, work: Path) -> dict:
    """Upload one entry of ``prompt_tokens`` tokens of the bench model, then fetch it ``reps``
    times into fresh stores, alternating with raw GETs of its objects."""
    import obstore

    from sparkcache.store import PageStore
    from sparkcache.store.identity import Identity
    from sparkcache.store.remote_tier import RemoteTier
    from sparkcache.store.s3_location import S3Location, open_client
    from testing.tinymodel import BENCH

    kv_bytes_per_token = 2 * BENCH.num_layers * BENCH.num_kv_heads * BENCH.head_dim * 2  # K and V, bf16
    page_bytes = PAGE_BLOCKS * BLOCK_TOKENS * kv_bytes_per_token
    blocks = (prompt_tokens - 1) // BLOCK_TOKENS
    pages = -(-blocks // PAGE_BLOCKS)
    identity = Identity("bench-remote", f"bf16:L{BENCH.num_layers}", BLOCK_TOKENS, 0, "bench")
    keys = _chain(blocks, f"remote-{prompt_tokens}")
    sizes = [min(PAGE_BLOCKS, blocks - p * PAGE_BLOCKS) * BLOCK_TOKENS * kv_bytes_per_token for p in range(pages)]
    prefix = f"bench/{os.urandom(6).hex()}"
    location = S3Location(server.endpoint.bucket, prefix, server.endpoint.url, timeout_s=120.0)
    limits = {"max_bytes": 8 << 30, "low_watermark_bytes": 6 << 30, "page_blocks": PAGE_BLOCKS}

    source = PageStore(str(work / f"a-{prompt_tokens}"), **limits)
    published = source.publish(identity, keys, [os.urandom(n) for n in sizes])
    if not published.ok:
        raise RuntimeError(f"publishing the bench entry failed: {published.reason}: {published.detail}")
    upload_tier = RemoteTier(location, source, deadline_s=600.0)
    t = time.monotonic()
    upload_tier.upload(published.entry_id)
    if not upload_tier.uploads.wait_idle(600.0):
        raise RuntimeError("the bench entry's upload did not end within 600 s")
    upload_s = time.monotonic() - t
    manifest = source.entry(published.entry_id).manifest
    object_keys = [upload_tier.bucket.shard(source.namespace, identity).objects.location.key(ref.digest)
                   for ref in manifest.objects]
    total = sum(ref.size for ref in manifest.objects)
    upload_tier.close()
    source.close()

    client = open_client(location)
    pool = ThreadPoolExecutor(location.requests_in_flight)

    def raw_get(write_to: Path | None = None) -> float:
        """The objects GET, as many in flight as the tier's; with ``write_to``, each one's bytes
        also written to a new file there as it arrives (no hash, no sync, no rename)."""
        def one(key: str) -> int:
            data = obstore.get(client, key).bytes()
            if write_to is not None:
                with open(write_to / key.rsplit("/", 1)[-1], "wb", buffering=0) as f:
                    view = memoryview(data)
                    while view:
                        view = view[f.write(view[:1 << 20]):]  # as the store writes: 1 MiB a call
            return len(data)

        t = time.monotonic()
        got = sum(pool.map(one, object_keys))
        if got != total:
            raise RuntimeError(f"raw GET read {got} bytes of {total}")
        return time.monotonic() - t

    fetch_s, raw_s, written_s, local_s = [], [], [], []
    for rep in range(reps):
        def raw_get_written() -> float:
            (work / f"w-{prompt_tokens}-{rep}").mkdir()
            return raw_get(work / f"w-{prompt_tokens}-{rep}")

        def fetch() -> float:
            store = PageStore(str(work / f"b-{prompt_tokens}-{rep}"), **limits)
            tier = RemoteTier(location, store, deadline_s=600.0)
            try:
                result = tier.fetch(identity, keys)
                if not result.hit or result.bytes_fetched != total:
                    raise RuntimeError(f"the fetch missed: {result.reason}: {result.detail}")
                t = time.monotonic()
                found = store.lookup(identity, keys)
                store.read_pages(found.handle.pages)
                local_s.append(time.monotonic() - t)
                store.release(found.lease_id)
                return result.duration_s
            finally:
                tier.close()
                store.close()
        arms = [(fetch, fetch_s), (raw_get, raw_s), (raw_get_written, written_s)]
        for run, times in arms[rep % 3:] + arms[:rep % 3]:  # each arm first in turn
            times.append(run())
    pool.shutdown()
    fetch_rate, raw_rate, written_rate = (total / _median(s) / 1e9 for s in (fetch_s, raw_s, written_s))
    return {"prompt_tokens": prompt_tokens, "bytes": total, "objects": len(object_keys), "upload_s": upload_s,
            "fetch_s": fetch_s, "raw_get_s": raw_s, "raw_get_written_s": written_s, "local_read_s": local_s,
            "fetch_gb_per_s": fetch_rate, "raw_get_gb_per_s": raw_rate, "raw_get_written_gb_per_s": written_rate,
            "local_read_gb_per_s": total / _median(local_s) / 1e9,
            "fetch_over_raw_get": fetch_rate / raw_rate, "raw_get_written_over_raw_get": written_rate / raw_rate,
            "met": fetch_rate / raw_rate >= RATE_TARGET}


# ---------------------------------------------------------------------- the engine part

def engine_point(server, prompt_tokens: int, prompts: int, reps: int, work: Path) -> dict:
    """Life A stores and uploads; per rep, life B restores from the bucket into an empty root and
    life C from B's root."""
    import random

    from dataclasses import asdict

    from bench.restore_ttft import LLAMA_SHAPE, model_figures, run_life
    from testing.tinymodel import BENCH, make_tiny_model

    model = make_tiny_model(BENCH)
    rng = random.Random(prompt_tokens)
    texts = [[rng.randrange(3, BENCH.vocab_size) for _ in range(prompt_tokens)] for _ in range(prompts)]
    max_model_len = max(4096, prompt_tokens + 64)
    fig = model_figures(model, BENCH, prompt_tokens)
    base = {"model": model, "dtype": BENCH.dtype, "prompts": texts, "warmup": None,
            "shape": asdict(LLAMA_SHAPE), "check_tokens": 8, "max_model_len": max_model_len,
            "cold": False, "warm": False, "arm": "sparkcache",
            "kv_cache_bytes": max(1 << 30, 2 * max_model_len * fig.kv_bytes_per_token)}
    env = {**server.endpoint.aws_env(), "SPARKCACHE_REMOTE_BUCKET": server.endpoint.bucket,
           "SPARKCACHE_REMOTE_ENDPOINT": server.endpoint.url,
           "SPARKCACHE_REMOTE_PREFIX": f"bench/{os.urandom(6).hex()}",
           "SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS": "600"}

    def life(root: Path) -> dict:
        return run_life({**base, "root": str(root)}, 3600, env)

    stored = life(work / f"engine-{prompt_tokens}-a")
    lives = []
    for rep in range(reps):
        root = work / f"engine-{prompt_tokens}-b{rep}"
        lives.append({"remote": life(root), "local": life(root)})

    def ttfts(result: dict) -> list[float]:
        return [r["ttft_s"] for r in result["requests"]]

    def tokens(result: dict) -> list[list[int]]:
        return [r["check_tokens"] for r in result["requests"]]

    restored = [tokens(one[kind]) for one in lives for kind in ("remote", "local")]
    # every restore places the same bytes and computes the same suffix: one output per prompt;
    # the storing life computed the whole prompt in one forward, whose bf16 sums may differ
    identical = all(t == restored[0] for t in restored)
    remote = [t for one in lives for t in ttfts(one["remote"])]
    local = [t for one in lives for t in ttfts(one["local"])]
    recompute = ttfts(stored)
    cached = min(r["num_cached_tokens"] for one in lives for kind in ("remote", "local")
                 for r in one[kind]["requests"])
    return {"prompt_tokens": prompt_tokens, "prompts": prompts, "reps": reps,
            "ttft_recompute_s": recompute, "ttft_remote_s": remote, "ttft_local_s": local,
            "recompute_median_s": _median(recompute), "remote_median_s": _median(remote),
            "local_median_s": _median(local), "recompute_over_remote": _median(recompute) / _median(remote),
            "cached_tokens_min": cached, "identical_outputs": identical,
            "recompute_identical_to_restores": tokens(stored) == restored[0],
            "tokens": {"recompute": tokens(stored), "restores": restored}}


# ---------------------------------------------------------------------- report

def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("store", "engine") if result.get(p)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, part in zip(axes[0], panels):
        points = result[part]
        x = list(range(len(points)))
        if part == "store":
            for key, label in (("fetch_gb_per_s", "tier fetch (GET, verify, local write)"),
                               ("raw_get_gb_per_s", "raw GET, same objects and client"),
                               ("raw_get_written_gb_per_s", "raw GET, each object written to a new file"),
                               ("local_read_gb_per_s", "local verified read after")):
                ax.plot(x, [p[key] for p in points], marker="o", label=label)
            ax.set_ylabel("GB/s")
            ax.set_title("reading the bucket")
        else:
            for key, label in (("recompute_median_s", "recompute"), ("remote_median_s", "restore from the bucket"),
                               ("local_median_s", "restore from the local store")):
                ax.plot(x, [p[key] for p in points], marker="o", label=label)
            ax.set_yscale("log")
            ax.set_ylabel("time to first token, s (median)")
            ax.set_title("vLLM on CPU, the bench model")
        ax.set_xticks(x, [f"{p['prompt_tokens']:,}" for p in points])
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.remote_restore", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for remote_restore.json and .png")
    p.add_argument("--prompt-tokens", default="8192,32768", help="comma-separated prompt sizes")
    p.add_argument("--reps", type=int, default=3, help="fetches (store part) and restarts (engine part) per size")
    p.add_argument("--prompts", type=int, default=2, help="prompts per engine life")
    p.add_argument("--parts", default="store,engine", help="store, engine or both")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.prompt_tokens.split(",") if s]
    parts = set(args.parts.split(","))
    if not sizes or parts - {"store", "engine"} or args.reps < 1 or args.prompts < 1:
        p.error("--prompt-tokens needs sizes, --parts store and/or engine, --reps and --prompts at least 1")
    from testing.seaweedfs import SeaweedFS

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="remote_restore-"))  # the bucket's and the stores' files, removed after
    result: dict = {"bench": "remote_restore", "argv": sys.argv[1:], "cpu_count": os.cpu_count(),
                    "machine": platform.machine(), "rate_target": RATE_TARGET}
    with SeaweedFS(work / "weed") as server:
        os.environ.update(server.endpoint.aws_env())  # where the tier's client reads its keys
        if "store" in parts:
            result["store"] = []
            for n in sizes:
                point = store_point(server, n, args.reps, work)
                result["store"].append(point)
                print(f"[{n}] store: tier fetch {point['fetch_gb_per_s']:.2f} GB/s, raw GET "
                      f"{point['raw_get_gb_per_s']:.2f} GB/s ({point['fetch_over_raw_get']:.2f}), raw GET written "
                      f"{point['raw_get_written_gb_per_s']:.2f} GB/s ({point['raw_get_written_over_raw_get']:.2f}), "
                      "local read "
                      f"{point['local_read_gb_per_s']:.2f} GB/s, {point['bytes'] / 1e6:.0f} MB", flush=True)
        if "engine" in parts:
            result["engine"] = []
            for n in sizes:
                point = engine_point(server, n, args.prompts, args.reps, work)
                result["engine"].append(point)
                print(f"[{n}] engine: TTFT recompute {point['recompute_median_s']:.2f} s, from the bucket "
                      f"{point['remote_median_s']:.3f} s, local {point['local_median_s']:.3f} s, restores identical "
                      f"{point['identical_outputs']} (to the storing life: "
                      f"{point['recompute_identical_to_restores']}), cached {point['cached_tokens_min']}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    result["met"] = {}
    if "store" in result:
        result["met"]["remote_read_rate_at_least_target"] = all(p["met"] for p in result["store"])
    if "engine" in result:
        result["met"].update(restores_identical=all(p["identical_outputs"] for p in result["engine"]),
                             remote_faster_than_recompute=all(p["recompute_over_remote"] > 1 for p in result["engine"]))
    (args.out / "remote_restore.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "remote_restore.png")
    print(f"wrote {args.out / 'remote_restore.json'} and {args.out / 'remote_restore.png'}; met: {result['met']}")
    return 0 if all(result["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
