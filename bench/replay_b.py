"""Replay B (Report B's shape, scaled): a store driven past its cap by continuous
growing-conversation publication, while a foreground loop measures its own step latency.

    python -m bench.replay_b --out DIR [--phase-seconds 10 --cycles 5 --max-bytes 256MiB]

A child process (the "rank") runs a capture generator, a publisher thread (bounded capture
slots, backlog gauges) and the store's MaintenanceThread. Capture and publication (the
CPU-heavy part) run at ``--nice`` (10); the maintenance thread at ``--maintenance-nice``
(0, the rank's own), since its budget is wall time and its CPU use is a few ms per pass. The parent is the foreground
("serving lane"): each step does fixed CPU work plus a small file write/read, and records
its latency. Phases alternate store-on / store-off (the child's capture, publication and
maintenance stop entirely) so machine noise hits both modes alike.

Writes DIR/summary.json (and DIR/replay_b.png when matplotlib is importable). Targets:
foreground median and p99 within 5% of store-off; no pass longer than its budget + 20%;
used bytes <= max + one publication.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import threading
import time

from sparkcache.settings import parse_bytes
from sparkcache.store import Identity, MaintenanceThread, PageStore, PassBudget

IDENT = Identity("replay-b-hybrid", "bf16:attn+mamba", 16, 0, "vllm-0.32.0-lock")


# ----------------------------------------------------------------------------- workload

class Conversation:
    """A growing agent conversation: each turn adds tool result + reply (kept by the next
    prompt) and reasoning tokens (published with the turn, not repeated next turn)."""

    def __init__(self, cid: int, start_blocks: int) -> None:
        self.cid = cid
        self.blocks = start_blocks  # shared chain length (prompt of the next turn)
        self.turn = 0

    def next_turn(self, grow_blocks: int, reasoning_blocks: int) -> tuple[list[str], int]:
        """This turn's published keys, and how many leading blocks the previous turn's
        entry already holds (those pages need no capture: copy-on-write)."""
        keys = [f"v{self.cid}-{i}" for i in range(self.blocks)]
        keys += [f"v{self.cid}-t{self.turn}-r{i}" for i in range(reasoning_blocks)]
        stored = self.blocks - grow_blocks if self.turn else 0
        self.blocks += grow_blocks
        self.turn += 1
        return keys, stored


def page_for(key_first: str, n_blocks: int, block_bytes: int) -> bytes:
    seed = hashlib.sha256(f"{key_first}:{n_blocks}".encode()).digest()
    return seed * (n_blocks * block_bytes // 32)


def pages_for(keys: list[str], bpp: int, block_bytes: int) -> list[bytes]:
    return [page_for(keys[i], min(bpp, len(keys) - i), block_bytes)
            for i in range(0, len(keys), bpp)]


# ----------------------------------------------------------------------------- the rank (child)

def _nice_this_thread(nice: int) -> None:
    """Capture and publication (the CPU-heavy part: page copies, hashing) run niced, as a
    serving process would run them; the maintenance thread keeps ``--maintenance-nice``."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def rank_main(args: argparse.Namespace, control: "mp.Queue", results: "mp.Queue") -> None:
    store_root = os.path.join(args.out, "store")
    store = PageStore(store_root, max_bytes=args.max_bytes, low_watermark_bytes=args.low_bytes,
                      page_blocks=args.page_blocks)
    # the publication backlog, as the connector's capture slots report it: queued -> (when, bytes)
    pending: dict[int, tuple[float, int]] = {}
    pending_lock = threading.Lock()
    budget = PassBudget(args.pass_entries, args.pass_bytes, args.pass_ms)
    reports: list = []
    samples: list = []
    pubs: list = []
    slots: "queue.Queue" = queue.Queue(maxsize=args.capture_slots)
    active = threading.Event()
    stop = threading.Event()
    dropped = [0]
    t_origin = time.time()

    def generator() -> None:
        _nice_this_thread(args.nice)
        convs = [Conversation(i, args.start_blocks + 97 * i) for i in range(4)]
        next_id = 4
        while not stop.is_set():
            if not active.wait(0.1):
                continue
            i = (next_id + len(pubs)) % 4
            conv = convs[i]
            if conv.turn >= args.turns_per_conversation:  # a new conversation (Report A: +160K)
                convs[i] = conv = Conversation(next_id, args.start_blocks)
                next_id += 1
            keys, stored = conv.next_turn(args.grow_blocks, args.reasoning_blocks)
            item = (keys, stored, time.monotonic())
            try:
                with pending_lock:
                    pending[id(item)] = (time.monotonic(), len(keys) * args.block_bytes)
                slots.put_nowait(item)
            except queue.Full:
                with pending_lock:
                    pending.pop(id(item), None)
                dropped[0] += 1
            time.sleep(args.turn_interval)

    def publisher() -> None:
        _nice_this_thread(args.nice)
        while not stop.is_set():
            try:
                item = slots.get(timeout=0.1)
            except queue.Empty:
                continue
            keys, stored, _ = item
            bpp = args.page_blocks
            # capture only pages the previous turn's entry does not hold (copy-on-write)
            pages = [None if i + bpp <= stored else page_for(keys[i], min(bpp, len(keys) - i),
                                                              args.block_bytes)
                     for i in range(0, len(keys), bpp)]
            result = store.publish(IDENT, keys, pages)
            if result.reason == "base_absent":  # the previous turn was evicted: capture all
                pages = pages_for(keys, bpp, args.block_bytes)
                result = store.publish(IDENT, keys, pages)
            with pending_lock:
                pending.pop(id(item), None)
            pubs.append((time.time() - t_origin, result.ok, result.reason, result.bytes_written,
                         result.duration_s, len(keys) * args.block_bytes))
            if not result.ok:
                maint_holder[0] and maint_holder[0].trigger()

    def sampler() -> None:
        while not stop.is_set():
            cap = store.capacity()
            with pending_lock:
                backlog = list(pending.values())
            now = time.monotonic()
            samples.append({
                "t": round(time.time() - t_origin, 3), "active": active.is_set(),
                "used_bytes": cap.used_bytes, "entries": cap.entries,
                "pending_slots": len(backlog),
                "pending_bytes": sum(n for _, n in backlog),
                "oldest_pending_age_s": round(now - min(t for t, _ in backlog), 3) if backlog else 0.0,
                "remaining_entries": reports[-1].remaining_entries if reports else 0,
            })
            time.sleep(0.25)

    maint_holder: list = [None]
    threads = [threading.Thread(target=f, daemon=True) for f in (generator, publisher, sampler)]
    for t in threads:
        t.start()
    while True:
        cmd = control.get()
        if cmd == "on":
            maint_holder[0] = MaintenanceThread(
                store, budget, args.interval, sweep_every_s=30.0, nice=args.maintenance_nice,
                on_report=lambda r: reports.append(r)).start()
            active.set()
        elif cmd == "off":
            active.clear()
            while not slots.empty():
                time.sleep(0.01)
            time.sleep(0.2)  # let the publication in flight finish
            if maint_holder[0] is not None:
                maint_holder[0].stop()
                maint_holder[0] = None
        elif cmd == "quit":
            break
        results.put(("ack", cmd))
    stop.set()
    for t in threads:
        t.join(2)
    results.put(("done", {
        "passes": [r.__dict__ if hasattr(r, "__dict__") else _asdict(r) for r in reports],
        "samples": samples, "publications": pubs, "dropped_captures": dropped[0],
        "t_origin": t_origin, "final": _asdict(store.capacity()),
    }))


def _asdict(obj) -> dict:
    import dataclasses
    return dataclasses.asdict(obj)


# ----------------------------------------------------------------------------- foreground

def foreground_phase(seconds: float, scratch: str, cpu_iters: int) -> list[float]:
    """Fixed work per step: a pure-Python loop (scheduler-like bookkeeping) plus a 128 KiB
    write and read-back of a scratch file. Returns step latencies in seconds."""
    payload = os.urandom(128 << 10)
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        acc = 0
        for i in range(cpu_iters):
            acc = (acc * 31 + i) & 0xFFFFFFFF
        with open(scratch, "wb") as f:
            f.write(payload)
        with open(scratch, "rb") as f:
            f.read()
        lat.append(time.perf_counter() - t0)
    return lat


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay_b", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--phase-seconds", type=float, default=10.0)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("256MiB"))
    p.add_argument("--low-bytes", type=parse_bytes, default=parse_bytes("204MiB"))
    p.add_argument("--block-bytes", type=parse_bytes, default=parse_bytes("16KiB"))
    p.add_argument("--page-blocks", type=int, default=16)
    p.add_argument("--start-blocks", type=int, default=400, help="conversation start (blocks)")
    p.add_argument("--grow-blocks", type=int, default=128, help="~2K tokens a turn at 16/block")
    p.add_argument("--reasoning-blocks", type=int, default=32)
    p.add_argument("--turns-per-conversation", type=int, default=20)
    p.add_argument("--turn-interval", type=float, default=0.15)
    p.add_argument("--capture-slots", type=int, default=2)
    p.add_argument("--pass-ms", type=float, default=50.0)
    p.add_argument("--pass-entries", type=int, default=64)
    p.add_argument("--pass-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument("--interval", type=float, default=0.5, help="idle gap between passes (s)")
    p.add_argument("--nice", type=int, default=10,
                   help="niceness of the rank's capture and publisher threads")
    p.add_argument("--maintenance-nice", type=int, default=0,
                   help="niceness of the maintenance thread (the rank's own: 0)")
    p.add_argument("--cpu-iters", type=int, default=60000)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(os.path.join(args.out, "store"), ignore_errors=True)

    ctx = mp.get_context("fork")
    control, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=rank_main, args=(args, control, results), daemon=True)
    child.start()
    scratch = os.path.join(args.out, "foreground.scratch")
    lat = {"on": [], "off": []}
    phases = []
    t_origin = time.time()
    foreground_phase(1.0, scratch, args.cpu_iters)  # warm-up
    for cycle in range(args.cycles):
        order = ("on", "off") if cycle % 2 == 0 else ("off", "on")
        for mode in order:
            control.put(mode)
            assert results.get(timeout=30) == ("ack", mode)
            t0 = time.time() - t_origin
            step = foreground_phase(args.phase_seconds, scratch, args.cpu_iters)
            lat[mode] += step
            phases.append({"mode": mode, "t0": round(t0, 3), "t1": round(time.time() - t_origin, 3),
                           "steps": len(step), "median_ms": statistics.median(step) * 1e3,
                           "p99_ms": pct(step, 0.99) * 1e3})
            print(f"cycle {cycle} {mode:3s}: {len(step)} steps, median "
                  f"{statistics.median(step) * 1e3:.2f} ms, p99 {pct(step, 0.99) * 1e3:.2f} ms",
                  flush=True)
    control.put("off")
    results.get(timeout=60)
    control.put("quit")
    tag, child_data = results.get(timeout=60)
    child.join(10)
    os.unlink(scratch)

    passes = child_data["passes"]
    pubs = child_data["publications"]
    ok_pubs = [x for x in pubs if x[1]]
    max_pub = max((x[5] for x in ok_pubs), default=0)
    max_used = max((s["used_bytes"] for s in child_data["samples"]), default=0)
    durations = [x["duration_s"] * 1e3 for x in passes]
    evicting = [x for x in passes if x["entries_evicted"] + x["entries_expired"] > 0]
    fg = {m: {"steps": len(v), "median_ms": statistics.median(v) * 1e3,
              "p99_ms": pct(v, 0.99) * 1e3, "mean_ms": statistics.fmean(v) * 1e3}
          for m, v in lat.items()}
    summary = {
        "config": {k: v for k, v in vars(args).items()},
        "foreground": fg,
        "foreground_ratio_on_over_off": {
            "median": fg["on"]["median_ms"] / fg["off"]["median_ms"],
            "p99": fg["on"]["p99_ms"] / fg["off"]["p99_ms"]},
        "phases": phases,
        "maintenance": {
            "passes": len(passes), "evicting_passes": len(evicting),
            "budget_ms": args.pass_ms,
            "max_pass_ms": max(durations, default=0.0),
            "median_pass_ms": statistics.median(durations) if durations else 0.0,
            "median_evicting_pass_ms": statistics.median(
                [x["duration_s"] * 1e3 for x in evicting]) if evicting else 0.0,
            "passes_over_budget_plus_20pct": sum(d > args.pass_ms * 1.2 for d in durations),
            "max_pass_cpu_ms": max((x["cpu_ms"] for x in passes), default=0.0),
            "max_pass_runqueue_wait_ms": max((x["runqueue_wait_ms"] for x in passes), default=0.0),
            "pass_ms_p50_p90_p99": [pct(durations, q) for q in (0.5, 0.9, 0.99)] if durations else [],
            "median_pass_cpu_ms": statistics.median([x["cpu_ms"] for x in passes]) if passes else 0.0,
            "entries_evicted_total": sum(x["entries_evicted"] + x["entries_expired"] for x in passes),
            "bytes_reclaimed_total": sum(x["bytes_reclaimed"] for x in passes),
            "stopped_by": {k: sum(1 for x in passes if x["stopped_by"] == k)
                           for k in ("done", "entries", "bytes", "time", "lock")},
            "max_remaining_entries": max((x["remaining_entries"] for x in passes), default=0),
        },
        "capacity": {"max_bytes": args.max_bytes, "low_watermark_bytes": args.low_bytes,
                     "max_used_bytes_sampled": max_used, "largest_publication_bytes": max_pub,
                     "within_max_plus_one_publication": max_used <= args.max_bytes + max_pub,
                     "final": child_data["final"]},
        "publications": {"ok": len(ok_pubs),
                         "refused_over_capacity": sum(1 for x in pubs if x[2] == "over_capacity"),
                         "failed_other": sum(1 for x in pubs if not x[1] and x[2] != "over_capacity"),
                         "bytes_written": sum(x[3] for x in ok_pubs),
                         "median_publish_ms": statistics.median([x[4] * 1e3 for x in ok_pubs]) if ok_pubs else 0,
                         "dropped_captures_slots_full": child_data["dropped_captures"]},
        "pass_log": [{k: x[k] for k in ("started_at", "duration_s", "entries_evicted",
                                        "entries_expired", "bytes_reclaimed", "remaining_entries",
                                        "stopped_by", "used_bytes_before", "used_bytes_after",
                                        "deferred_objects", "lock_wait_ms", "cpu_ms", "plan_ms",
                                        "fsync_ms", "units", "longest_unit_ms",
                                        "runqueue_wait_ms")}
                     for x in passes],
        "gauges": child_data["samples"],
        "t_origin_child": child_data["t_origin"],
    }
    summary["targets"] = {
        "foreground_median_within_5pct": summary["foreground_ratio_on_over_off"]["median"] <= 1.05,
        "foreground_p99_within_5pct": summary["foreground_ratio_on_over_off"]["p99"] <= 1.05,
        "no_pass_over_budget_plus_20pct": summary["maintenance"]["passes_over_budget_plus_20pct"] == 0,
        "store_within_max_plus_one_publication": summary["capacity"]["within_max_plus_one_publication"],
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = plot(summary, os.path.join(args.out, "replay_b.png"))
    print(json.dumps({k: summary[k] for k in ("foreground", "foreground_ratio_on_over_off",
                                               "targets")}, indent=1))
    m = summary["maintenance"]
    print(f"maintenance: {m['passes']} passes ({m['evicting_passes']} evicting), max "
          f"{m['max_pass_ms']:.1f} ms / budget {m['budget_ms']:g} ms (max CPU {m['max_pass_cpu_ms']:.1f} ms), "
          f"{m['passes_over_budget_plus_20pct']} over budget+20%, evicted "
          f"{m['entries_evicted_total']} entries / {m['bytes_reclaimed_total'] / 2**20:.1f} MiB, "
          f"stopped_by {m['stopped_by']}")
    c = summary["capacity"]
    print(f"capacity: max used {c['max_used_bytes_sampled'] / 2**20:.1f} MiB of "
          f"{c['max_bytes'] / 2**20:.0f} MiB (largest publication "
          f"{c['largest_publication_bytes'] / 2**20:.1f} MiB); publications {summary['publications']}")
    print(f"wrote {os.path.join(args.out, 'summary.json')}"
          + (f" and {png}" if png else " (matplotlib not installed: no PNG)"))
    return 0


def plot(summary: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    g = summary["gauges"]
    t = [s["t"] for s in g]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    axes[0].plot(t, [s["used_bytes"] / 2**20 for s in g], label="used MiB")
    axes[0].axhline(summary["capacity"]["max_bytes"] / 2**20, color="r", ls="--", label="max")
    axes[0].axhline(summary["capacity"]["low_watermark_bytes"] / 2**20, color="g", ls="--", label="low")
    axes[0].legend(loc="lower right")
    axes[0].set_ylabel("store")
    axes[1].plot(t, [s["pending_slots"] for s in g], label="pending slots")
    axes[1].plot(t, [s["remaining_entries"] for s in g], label="remaining entries")
    axes[1].plot(t, [s["oldest_pending_age_s"] for s in g], label="oldest pending age s")
    axes[1].legend(loc="upper right")
    t0 = summary["t_origin_child"]
    passes = summary["pass_log"]
    axes[2].bar([x["started_at"] - t0 for x in passes], [x["duration_s"] * 1e3 for x in passes],
                width=0.2, label="pass ms")
    axes[2].axhline(summary["maintenance"]["budget_ms"], color="r", ls="--", label="budget")
    axes[2].set_ylabel("pass duration ms")
    axes[2].set_xlabel("seconds")
    axes[2].legend(loc="upper right")
    for ax in axes:
        for ph in summary["phases"]:
            if ph["mode"] == "on":
                ax.axvspan(ph["t0"], ph["t1"], color="orange", alpha=0.08)
    fig.suptitle("replay B: store on (shaded) vs off; foreground ratio median "
                 f"{summary['foreground_ratio_on_over_off']['median']:.3f}, p99 "
                 f"{summary['foreground_ratio_on_over_off']['p99']:.3f}")
    fig.savefig(path, dpi=90)
    return path


if __name__ == "__main__":
    sys.exit(main())
