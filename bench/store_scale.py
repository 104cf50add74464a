"""A store of 1,000 to 100,000 entries: lookup latency on the scheduler's path while a publisher
and maintenance run, the time to open it (a writer, a reader), ``sparkcache status`` and
``sparkcache verify``, and resident memory.

    python -m bench.store_scale --out DIR [--sizes 1000,10000,100000] [--lookups 4000]

Per size: a store of N entries is written with the store's own formats (manifests encoded by
``manifests.encode``, objects named by their BLAKE3, one object of ``--page-bytes`` per entry of
``--blocks`` chained block keys, every manifest with its own last access), without the
per-publication fsyncs (publication's own speed is ``bench.store_throughput``'s). Then, each in
its own process:

- open without a snapshot: ``PageStore(root, read_only=True)``, every manifest read and decoded;
- snapshot: the process a writer's maintenance starts for a store of 1,000 entries or more
  (``sparkcache.store.snapshot``), seconds;
- open: ``PageStore(root)`` as a writer (recovery and the listing of every manifest, headers
  checked against the snapshot) and as a reader (``read_only``), the seconds and the process's
  peak resident memory after it;
- status: ``python -m sparkcache status --root R``, wall seconds;
- verify: ``python -m sparkcache verify --root R``, wall seconds, beside a raw read of the same
  files (every object and manifest read whole, no hashing) in the same page-cache state;
- lookups: ``PageStore.lookup(identity, keys, with_state=False)`` as the scheduler half calls it
  (no lease, no verification; the hit's access recorded), on this process's thread, while one
  process publishes new entries (``PageStore.publish``, as a worker's publisher thread does) and
  another runs maintenance (``MaintenanceThread`` with the settings' default budget and
  interval, the store at its cap so that passes evict), both at niceness 10 as a worker's
  background threads run.
  Keys are drawn at random from the stored entries (a hit) and from never-stored ones (a miss),
  nine hits to one miss. p50, p99 and max in microseconds. Once the store is open the heap is
  frozen out of the garbage collector, as vLLM's engine core does after building its scheduler.

Targets (issue 43): lookup p99 under 1 ms at 100,000 entries; open and status under 5 s.
Writes DIR/store_scale.json and DIR/store_scale.png.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IDENTITY = dict(model="bench-scale", kv_layout="bf16:L8:H4:D64", block_size=16, tp_rank=0,
                runtime_lock_hash="bench")


def chained_keys(conv: int, n: int) -> list[str]:
    out, digest = [], hashlib.sha256(f"conv {conv}".encode()).digest()
    for _ in range(n):
        digest = hashlib.sha256(digest).digest()
        out.append(digest.hex()[:40])
    return out


def build(root: Path, n: int, blocks: int, page_bytes: int) -> int:
    """Write a store of ``n`` entries under ``root`` (see the module docstring); its bytes."""
    from sparkcache.store import Identity
    from sparkcache.store.identity import entry_id_for
    from sparkcache.store.layout import StoreLayout
    from sparkcache.store.manifests import Manifest, PageRef, encode
    from sparkcache.store.objects import digest_of

    identity = Identity(**IDENTITY)
    layout = StoreLayout.create(str(root))
    idd = identity.digest()
    os.makedirs(layout.identity_dir(idd), exist_ok=True)
    total = 0
    now = time.time()
    for conv in range(n):
        keys = chained_keys(conv, blocks)
        page = hashlib.sha256(str(conv).encode()).digest() * (page_bytes // 32)
        digest = digest_of(page)
        path = layout.object_path(digest)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(page)
        entry_id = entry_id_for(idd, keys[-1])
        body = encode(Manifest(entry_id, identity, tuple(keys), blocks, (PageRef(digest, len(page)),), now))
        mpath = layout.manifest_path(idd, entry_id)
        with open(mpath, "wb") as f:
            f.write(body)
        when = now - (n - conv)  # older conversations were used longer ago
        os.utime(mpath, (when, when))
        total += len(page) + len(body)
    return total


_OPEN = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from sparkcache.store import PageStore
t = time.perf_counter()
store = PageStore(sys.argv[2], read_only=sys.argv[3] == "reader", max_bytes=int(sys.argv[4]),
                  low_watermark_bytes=int(sys.argv[4]) * 95 // 100, page_blocks=int(sys.argv[5]))
took = time.perf_counter() - t
print(json.dumps({"seconds": took, "entries": store.capacity().entries,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

_LOAD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from sparkcache.store import Identity, MaintenanceThread, PageStore, PassBudget
from bench.store_scale import IDENTITY, chained_keys
role, root, cap, blocks, page_bytes = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
os.nice(10)  # background work, as a worker's publisher and maintenance threads run (cpus.py)
store = PageStore(root, max_bytes=cap, low_watermark_bytes=cap * 95 // 100, page_blocks=blocks)
print("ready", flush=True)
if role == "maintenance":  # as a writing worker runs it, with the settings' defaults
    from sparkcache.settings import load_settings
    settings = load_settings(env={"SPARKCACHE_ROOT": root})
    thread = MaintenanceThread(store, PassBudget.from_settings(settings),
                               settings.maintenance_interval_seconds).start()
    sys.stdin.read()
    thread.stop()
else:
    identity, conv = Identity(**IDENTITY), 10_000_000
    while True:
        page = os.urandom(page_bytes)
        store.publish(identity, chained_keys(conv, blocks), [page])
        conv += 1
        time.sleep(0.02)
"""


def _python(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=1800, **kw)


def _timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    done = _python(*args)
    return time.perf_counter() - t, done


def raw_read(root: Path) -> tuple[float, int]:
    """Every file of the store read whole (no hashing): seconds and bytes."""
    t, total = time.perf_counter(), 0
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                total += len(fh.read())
    return time.perf_counter() - t, total


def lookups(root: Path, n: int, count: int, cap: int, blocks: int, page_bytes: int) -> dict:
    from sparkcache.store import Identity, PageStore

    loads = [subprocess.Popen([sys.executable, "-c", _LOAD, str(REPO), role, str(root), str(cap),
                               str(blocks), str(page_bytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
             for role in ("maintenance", "publisher")]
    try:
        for p in loads:
            assert p.stdout.readline().strip() == "ready"
        store = PageStore(str(root), max_bytes=cap, low_watermark_bytes=cap * 95 // 100, page_blocks=blocks)
        freeze_gc_heap()
        identity = Identity(**IDENTITY)
        rng = random.Random(n)
        times, hits = [], 0
        for i in range(count):
            conv = rng.randrange(n) if i % 10 else 50_000_000 + i  # nine hits to one miss
            keys = chained_keys(conv, blocks)
            t = time.perf_counter_ns()
            found = store.lookup(identity, keys, with_state=False)
            times.append((time.perf_counter_ns() - t) / 1e3)
            hits += found.hit
            time.sleep(0.001)  # a scheduler step between lookups
        entries = store.capacity().entries
    finally:
        for p in loads:
            p.stdin.close() if p.stdin else None
            p.terminate()
            p.wait(timeout=60)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"count": count, "hits": hits, "p50_us": q(0.5), "p99_us": q(0.99), "max_us": times[-1],
            "entries_after": entries,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def freeze_gc_heap() -> None:
    """What vLLM's ``EngineCore`` does once its scheduler (and with it the connector and its
    store) is built (``vllm.utils.gc_utils.freeze_gc_heap``): the startup heap is left out of
    the garbage collector's later passes."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.store_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--lookups", type=int, default=4000)
    p.add_argument("--blocks", type=int, default=16, help="blocks per entry (one page)")
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--keep", action="store_true", help="keep the stores (DIR/store-N)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {"blocks": args.blocks, "page_bytes": args.page_bytes, "load_average_before": os.getloadavg(),
               "sizes": []}
    for n in (int(s) for s in args.sizes.split(",")):
        root = out / f"store-{n}"
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        total = build(root, n, args.blocks, args.page_bytes)
        built_s = time.perf_counter() - t
        cap = int(total * 0.98)  # just over: every pass evicts a little while the publisher adds
        row = {"entries": n, "bytes": total, "build_s": built_s}
        done = _python("-c", _OPEN, str(REPO), str(root), "reader", str(cap), str(args.blocks))
        assert done.returncode == 0, done.stderr
        row["open_reader_without_snapshot"] = json.loads(done.stdout)
        row["snapshot_s"], done = _timed("-c", "import sys; from sparkcache.store.snapshot import main; "
                                         "sys.exit(main())", str(root))
        assert done.returncode == 0, done.stderr
        for role in ("writer", "reader"):
            done = _python("-c", _OPEN, str(REPO), str(root), role, str(cap), str(args.blocks))
            assert done.returncode == 0, done.stderr
            row[f"open_{role}"] = json.loads(done.stdout)
        env_cap = ["--config", json.dumps({"max_bytes": cap, "low_watermark_bytes": cap * 95 // 100})]
        row["status_s"], done = _timed("-m", "sparkcache", "status", "--root", str(root), *env_cap)
        assert done.returncode == 0, done.stdout + done.stderr
        raw_s, raw_bytes = raw_read(root)
        row["verify_s"], done = _timed("-m", "sparkcache", "verify", "--root", str(root), *env_cap)
        assert done.returncode == 0, done.stdout + done.stderr
        row["raw_read_s"], row["raw_read_bytes"] = raw_s, raw_bytes
        row["verify_over_raw_read"] = row["verify_s"] / raw_s
        row["lookups"] = lookups(root, n, args.lookups, cap, args.blocks, args.page_bytes)
        results["sizes"].append(row)
        print(json.dumps(row), flush=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    last = results["sizes"][-1]
    results["load_average_after"] = os.getloadavg()
    results["targets"] = {
        "lookup_p99_under_1ms_at_largest": last["lookups"]["p99_us"] < 1000,
        "open_under_5s_at_largest": max(last["open_writer"]["seconds"], last["open_reader"]["seconds"]) < 5,
        "status_under_5s_at_largest": last["status_s"] < 5,
    }
    (out / "store_scale.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / "store_scale.png")
    print(json.dumps(results["targets"]))
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["sizes"]
    n = [r["entries"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(n, [r["lookups"]["p50_us"] for r in rows], "o-", label="lookup p50")
    a.plot(n, [r["lookups"]["p99_us"] for r in rows], "o-", label="lookup p99")
    a.axhline(1000, color="grey", ls="--", label="target p99 1 ms")
    a.set(xscale="log", yscale="log", xlabel="entries", ylabel="microseconds",
          title="lookup on the scheduler's path\n(publisher and maintenance running)")
    a.legend()
    for key, label in (("open_writer", "open (writer)"), ("open_reader", "open (reader)")):
        b.plot(n, [r[key]["seconds"] for r in rows], "o-", label=label)
    b.plot(n, [r["open_reader_without_snapshot"]["seconds"] for r in rows], "o:", label="open without a snapshot")
    b.plot(n, [r["status_s"] for r in rows], "o-", label="sparkcache status")
    b.plot(n, [r["verify_s"] for r in rows], "o-", label="sparkcache verify")
    b.plot(n, [r["raw_read_s"] for r in rows], "o--", label="raw read of the same files")
    b.axhline(5, color="grey", ls="--", label="target 5 s")
    b.set(xscale="log", yscale="log", xlabel="entries", ylabel="seconds", title="whole-store work")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
