"""Report B on the real engine: does a store at its cap slow vLLM's decode or first token?

    python -m bench.replay_b_engine --out bench-out/replay_b_engine [--cycles 3] [--phase-seconds 90]
        [--max-bytes 64MiB] [--agents 2] [--probe-tokens 256] [--probe-output 128]

One ``vllm serve`` (the OpenAI server on 127.0.0.1, vLLM's own engine-core and worker
processes, compiled, as operators run it) per phase, all on one store root, with the bench
model (``testing.tinymodel.BENCH``: hidden 1024, 8 layers, bf16, 8 KiB of KV per token).
Phases alternate the connector's access mode, the order flipped every cycle (read-write,
restore-only | restore-only, read-write | ...), so drift of a shared machine hits both alike:

- ``read-write``: every finished request is captured and published; the store sits at its
  ``--max-bytes`` cap, so maintenance evicts while the engine serves (Report B's state);
- ``restore-only``: the same requests, the connector still looks up and restores, but
  captures, publishes and runs maintenance not at all: the baseline.

In each phase ``--agents`` background conversations grow (each turn's prompt is the previous
one plus ``--turn-tokens`` new tokens, ``--agent-output`` tokens out; past
``--conversation-tokens`` a conversation starts over), so the captures keep coming and, in
read-write, the store stays at its cap. The agents take their turns together; then, during
their tool calls, a probe (Report B's idle probe, scaled: a fresh ``--probe-tokens`` prompt,
``--probe-output`` tokens out, streamed) runs alone on the engine while the agents' captures
publish and the evictions they need run: the store's background work overlaps every probe,
and the agents' prefills overlap none (when they did, which agent step fell into which probe
decided more than the mode did). After ``--warm-seconds`` (and in read-write once the store
holds its low watermark, 80% of the cap: the first phase fills an empty store) the probes
count for ``--phase-seconds``: time to first token (request sent to first streamed token),
decode rate ((tokens - 1) / (last - first token)) and every gap between streamed tokens (the
decode step time as a client sees it), and before each probe whether publications were
pending and the store at its cap. Every 2 s the server's ``/metrics`` is read: the store's
used bytes and cap, maintenance passes (count, the last one's duration, the passes over 1.2x
their budget), evictions, the publication backlog.

Writes DIR/replay_b_engine.json and DIR/replay_b_engine.png (probe decode tok/s and TTFT per
phase, store used bytes against the cap, maintenance pass durations, publication backlog).
Targets (issue 23): the probe's median decode tok/s and TTFT in read-write within 5% of
restore-only (medians over phases), p99 of the decode gaps within 10%, no maintenance pass
over 1.2x its budget, the store at its cap for most of the read-write phases.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from sparkcache.settings import format_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]
MODES = ("read-write", "restore-only")
AT_CAP = 0.8  # used bytes at or above the low watermark (80% of the cap): maintenance's regime


# ----------------------------------------------------------------------------- server

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm serve`` life in its own process group (SIGKILLed on ``stop``)."""

    def __init__(self, args: argparse.Namespace, model: str, root: Path, mode: str, log_path: Path) -> None:
        self.port = _free_port()
        kvt = {"kv_connector": "SparkcacheConnector", "kv_connector_module_path": "sparkcache.connector",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"root": str(root), "access_mode": mode,
                                             "max_bytes": args.max_bytes,
                                             "low_watermark_bytes": args.low_watermark_bytes,
                                             "min_span_tokens": 64}}
        # ``vllm serve`` is vllm.entrypoints.cli.main, which needs vLLM's package metadata
        # only for --version; the server it starts is this module's
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", str(args.max_model_len),
               "--enable-prefix-caching", "--seed", "0", "--max-num-batched-tokens", "2048",
               "--kv-transfer-config", json.dumps(kvt)]
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout_s: float = 900.0) -> float:
        t = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited rc={self.proc.returncode}; its log: {self.log_path}")
            try:
                if _request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return time.monotonic() - t
            except OSError:
                pass
            if time.monotonic() - t > timeout_s:
                raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s; its log: {self.log_path}")
            time.sleep(1.0)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 600.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def complete(port: int, prompt: list[int], max_tokens: int) -> None:
    status, text = _request(port, "POST", "/v1/completions",
                            {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0.0, "ignore_eos": True})
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {text[:400]}")


def probe(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request: TTFT, decode tok/s and the gaps between streamed tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"/v1/completions answered {r.status}: {r.read()[:400]!r}")
    times, tokens = [], None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            times.append(time.monotonic())
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    if tokens != max_tokens or len(times) != max_tokens:
        raise RuntimeError(f"probe: {tokens} tokens in usage and {len(times)} streamed chunks, "
                           f"asked for {max_tokens} (a chunk per token is what the gaps assume)")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "gaps_s": gaps, "at": t0}


# ----------------------------------------------------------------------------- metrics

WATCHED = ("vllm:sparkcache_capacity_used_bytes", "vllm:sparkcache_capacity_limit_bytes",
           "vllm:sparkcache_entries", "vllm:sparkcache_maintenance_passes_total",
           "vllm:sparkcache_maintenance_passes_overrun_total",
           "vllm:sparkcache_maintenance_last_pass_duration_seconds", "vllm:sparkcache_evictions_total",
           "vllm:sparkcache_publication_pending_slots", "vllm:sparkcache_publication_pending_bytes",
           "vllm:sparkcache_captures_total", "vllm:sparkcache_publish_failures_total")
# the connector's own time per engine step, on the model's thread and on the scheduler's
STEP_HISTOGRAMS = ("vllm:sparkcache_worker_step_seconds", "vllm:sparkcache_scheduler_step_seconds")
# vLLM's own split of a request's first token: frontend arrival to first token, waiting in the
# scheduler's queue, scheduled to first token (a probe runs alone: its own, from the deltas)
REQUEST_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                      "vllm:request_prefill_time_seconds")


def scrape(port: int) -> dict[str, float]:
    """The watched metrics, summed over their labels (one rank here)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = _request(port, "GET", "/metrics", timeout=10)
    out: dict[str, float] = {}
    if status != 200:
        return out
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = f"{s.name}:{s.labels['le']}" if s.name.endswith("_bucket") else s.name
            if s.name in WATCHED or s.name.startswith(STEP_HISTOGRAMS) or \
                    s.name.endswith(("_sum", "_count")) and s.name.startswith(REQUEST_HISTOGRAMS):
                out[name] = out.get(name, 0.0) + s.value
    return out


def split_key(histogram: str) -> str:
    return histogram.split(":", 1)[1].replace("sparkcache_", "connector_")


def request_split(before: dict, after: dict) -> dict:
    """The probe's own share of vLLM's request histograms and of the connector's per-step
    time, from scrapes right before and right after it (seconds; None where another request
    was counted between)."""
    out: dict[str, float | None] = {}
    for h in REQUEST_HISTOGRAMS + STEP_HISTOGRAMS:
        count = after.get(h + "_count", 0.0) - before.get(h + "_count", 0.0)
        total = after.get(h + "_sum", 0.0) - before.get(h + "_sum", 0.0)
        out[split_key(h)] = total if h in STEP_HISTOGRAMS or count == 1 else None
    return out


def step_figures(last: dict) -> dict:
    """Per step histogram: steps, mean seconds, and the upper bound of the bucket holding p99."""
    out = {}
    for h in STEP_HISTOGRAMS:
        key = h.split("sparkcache_")[1].replace("_seconds", "")
        count = last.get(h + "_count", 0.0)
        buckets = sorted((float(k.rsplit(":", 1)[1]), v) for k, v in last.items() if k.startswith(h + "_bucket:"))
        out[key] = {"steps": count, "mean_s": last.get(h + "_sum", 0.0) / max(1.0, count),
                    "p99_at_most_s": next((le for le, n in buckets if n >= 0.99 * count), None) if count else None}
    return out


# ----------------------------------------------------------------------------- a phase

def run_phase(args: argparse.Namespace, model: str, root: Path, mode: str, index: int, out_dir: Path) -> dict:
    server = Server(args, model, root, mode, out_dir / f"server-{index}-{mode}.log")
    try:
        startup_s = server.wait_healthy()
        rng = random.Random(1000 + index)
        complete(server.port, [rng.randrange(3, 1000) for _ in range(64)], 4)  # first-forward costs
        stop = threading.Event()
        errors: list[str] = []
        conversations = [Conversation(args, random.Random(index * 100 + a)) for a in range(args.agents)]
        samples: list[dict] = []
        t0 = time.monotonic()

        def sampler() -> None:
            while not stop.wait(2.0):
                try:
                    samples.append({"t": time.monotonic() - t0, **scrape(server.port)})
                except OSError as exc:
                    errors.append(f"metrics: {exc}")

        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        probes: list[dict] = []
        probing_from = None
        end = None
        while end is None or time.monotonic() < end:
            agents_take_a_turn(server.port, conversations, args.agent_output, errors)
            if errors:
                break
            # the agents' tool calls: the probe runs now, while their turns' captures publish and
            # the evictions those publications need happen (read-write), so the background work
            # the store adds overlaps every probe and the agents' prefills overlap none
            at_start = scrape(server.port)
            run = probe(server.port, [rng.randrange(3, 1000) for _ in range(args.probe_tokens)], args.probe_output)
            if end is None and time.monotonic() - t0 >= args.warm_seconds and (mode != "read-write" or _at_cap(at_start)):
                probing_from, end = time.monotonic() - t0, time.monotonic() + args.phase_seconds
                continue  # the probe that found the store full is warm-up; the next one counts
            if end is not None:
                probes.append({**run, "publication_pending_at_start":
                               at_start.get("vllm:sparkcache_publication_pending_slots", 0.0),
                               "store_at_cap_at_start": _at_cap(at_start),
                               **request_split(at_start, scrape(server.port))})
            elif time.monotonic() - t0 > args.warm_seconds + args.fill_timeout:
                raise RuntimeError(f"phase {index}: the store did not reach its low watermark in "
                                   f"{args.fill_timeout:.0f} s; lower --max-bytes")
        stop.set()
        watcher.join(timeout=30)
        if errors:
            raise RuntimeError(f"phase {index} ({mode}): {errors[0]}; server log: {server.log_path}")
        last = scrape(server.port)
    finally:
        server.stop()
    return summarize_phase(mode, index, startup_s, probes, samples, last, probing_from or 0.0)


class Conversation:
    """One agent's conversation: each turn is the previous prompt plus ``--turn-tokens`` new
    tokens; past ``--conversation-tokens`` it starts over with ``--start-tokens``."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.args, self.rng, self.prompt = args, rng, []

    def next_prompt(self) -> list[int]:
        a = self.args
        if len(self.prompt) + a.turn_tokens > a.conversation_tokens:
            self.prompt = []
        self.prompt = self.prompt + [self.rng.randrange(3, 1000)
                                     for _ in range(a.turn_tokens if self.prompt else a.start_tokens)]
        return self.prompt


def agents_take_a_turn(port: int, conversations: list[Conversation], max_tokens: int, errors: list[str]) -> None:
    """Every agent's next turn, sent together; returns when all are answered."""

    def turn(a: int, prompt: list[int]) -> None:
        try:
            complete(port, prompt, max_tokens)
        except Exception as exc:  # the bench fails in run_phase, with what the server said
            errors.append(f"agent {a}: {exc}")

    threads = [threading.Thread(target=turn, args=(a, c.next_prompt()), daemon=True)
               for a, c in enumerate(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)


def _at_cap(sample: dict) -> bool:
    return sample.get("vllm:sparkcache_capacity_used_bytes", 0.0) >= \
        AT_CAP * sample.get("vllm:sparkcache_capacity_limit_bytes", float("inf"))


def summarize_phase(mode: str, index: int, startup_s: float, probes: list[dict], samples: list[dict],
                    last: dict, probing_from: float) -> dict:
    gaps = sorted(g for p in probes for g in p["gaps_s"])
    cap = max((s.get("vllm:sparkcache_capacity_limit_bytes", 0.0) for s in samples), default=0.0)
    used = [s.get("vllm:sparkcache_capacity_used_bytes", 0.0) for s in samples if s["t"] >= probing_from]
    return {
        "mode": mode, "index": index, "startup_s": startup_s, "probes": len(probes),
        "probing_from_s": probing_from,
        "decode_tok_s": statistics.median(p["decode_tok_s"] for p in probes) if probes else None,
        "ttft_s": statistics.median(p["ttft_s"] for p in probes) if probes else None,
        # where the probes' first token went, by vLLM's own histograms (medians; request_split)
        "ttft_split_s": {k: statistics.median(v) for k in map(split_key, REQUEST_HISTOGRAMS + STEP_HISTOGRAMS)
                         if (v := [p[k] for p in probes if p.get(k) is not None])},
        "gap_p50_s": _quantile(gaps, 0.5), "gap_p99_s": _quantile(gaps, 0.99),
        "store_cap_bytes": cap,
        # while the probes ran: the share of samples with the store at or over its low watermark
        "at_cap_fraction": (sum(u >= AT_CAP * cap for u in used) / len(used)) if used and cap else 0.0,
        # the probes that started with publications pending / with the store at its cap
        "probes_publication_pending": sum(p["publication_pending_at_start"] > 0 for p in probes),
        "probes_at_cap": sum(p["store_at_cap_at_start"] for p in probes),
        "maintenance_passes": last.get("vllm:sparkcache_maintenance_passes_total", 0.0),
        "passes_over_budget": last.get("vllm:sparkcache_maintenance_passes_overrun_total", 0.0),
        "evictions": last.get("vllm:sparkcache_evictions_total", 0.0),
        "captures": last.get("vllm:sparkcache_captures_total", 0.0),
        "publish_failures": last.get("vllm:sparkcache_publish_failures_total", 0.0),
        # the connector's own work per engine step (restores aside), the phase's whole life
        "connector_per_step": step_figures(last),
        "probe_runs": [{k: v for k, v in p.items() if k != "gaps_s"} for p in probes],
        "samples": samples,
    }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------- the run

RATIO_KEYS = ("decode_tok_s", "ttft_s", "gap_p99_s")


def mode_ratios(rw_phases: list[dict], ro_phases: list[dict]) -> dict[str, float]:
    """Read-write over restore-only: the median over each mode's phases of each phase's median."""
    return {key: statistics.median(p[key] for p in rw_phases) / statistics.median(p[key] for p in ro_phases)
            for key in RATIO_KEYS}


def ratio_targets(ratios: dict[str, float]) -> dict[str, bool]:
    """The bounds on the probe's figures (the rest of the targets are the store's)."""
    return {"decode_within_5pct": ratios["decode_tok_s"] >= 0.95,
            "ttft_within_5pct": ratios["ttft_s"] <= 1.05,
            "decode_gap_p99_within_10pct": ratios["gap_p99_s"] <= 1.10}


def summarize(phases: list[dict], args: argparse.Namespace) -> dict:
    by = {m: [p for p in phases if p["mode"] == m] for m in MODES}

    def med(mode: str, key: str) -> float:
        return statistics.median(p[key] for p in by[mode])

    rw, ro = "read-write", "restore-only"
    ratios = mode_ratios(by[rw], by[ro])
    rw_phases = by[rw]
    targets = {
        **ratio_targets(ratios),
        "no_pass_over_1_2x_budget": sum(p["passes_over_budget"] for p in rw_phases) == 0,
        "evictions_happened": sum(p["evictions"] for p in rw_phases) > 0,
    }
    return {"ratios_read_write_over_restore_only": ratios,
            "medians": {m: {k: med(m, k) for k in ("decode_tok_s", "ttft_s", "gap_p50_s", "gap_p99_s")}
                        for m in MODES},
            "read_write_at_cap_fraction": statistics.mean(p["at_cap_fraction"] for p in rw_phases),
            # of the read-write probes: those that started with the store at its cap, and with
            # publications pending (the background work the probe shares the machine with)
            "read_write_probes_at_cap_fraction": _share(rw_phases, "probes_at_cap"),
            "read_write_probes_publication_pending_fraction": _share(rw_phases, "probes_publication_pending"),
            "targets": targets, "met": all(targets.values())}


def _share(phases: list[dict], key: str) -> float:
    return sum(p[key] for p in phases) / max(1, sum(p["probes"] for p in phases))


def plot(result: dict, png: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    phases = result["phases"]
    fig, ax = plt.subplots(4, 1, figsize=(10, 11))
    colors = {"read-write": "tab:red", "restore-only": "tab:blue"}
    for m in MODES:
        xs = [p["index"] for p in phases if p["mode"] == m]
        ax[0].plot(xs, [p["decode_tok_s"] for p in phases if p["mode"] == m], "o", color=colors[m], label=m)
        ax[1].plot(xs, [p["ttft_s"] for p in phases if p["mode"] == m], "o", color=colors[m], label=m)
    ax[0].set_ylabel("probe decode tok/s\n(median per phase)")
    ax[1].set_ylabel("probe TTFT s\n(median per phase)")
    offset = 0.0
    for p in phases:
        s = p["samples"]
        t = [offset + x["t"] for x in s]
        if p["mode"] == "read-write" and s:
            ax[2].plot(t, [x.get("vllm:sparkcache_capacity_used_bytes", 0) / 2**20 for x in s], color="tab:red")
            ax[2].plot(t, [x.get("vllm:sparkcache_capacity_limit_bytes", 0) / 2**20 for x in s], "--", color="gray")
            ax[3].plot(t, [1000 * x.get("vllm:sparkcache_maintenance_last_pass_duration_seconds", 0) for x in s],
                       ".", color="tab:purple")
            ax[3].plot(t, [x.get("vllm:sparkcache_publication_pending_slots", 0) for x in s], "-", color="tab:green")
        offset += (s[-1]["t"] if s else 0.0) + 5.0
    ax[2].set_ylabel("store used MiB\n(read-write phases; cap dashed)")
    ax[3].set_ylabel("last pass ms (dots),\npending slots (line)")
    ax[3].set_xlabel("seconds of read-write phases, end to end")
    for a in ax[:2]:
        a.set_xlabel("phase")
        a.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return png


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay_b_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON, the plot and the server logs")
    p.add_argument("--cycles", type=int, default=3, help="pairs of phases (one read-write, one restore-only)")
    p.add_argument("--phase-seconds", type=float, default=90.0, help="probing time per phase")
    p.add_argument("--warm-seconds", type=float, default=20.0, help="agents only, before the probes start")
    p.add_argument("--fill-timeout", type=float, default=600.0,
                   help="read-write phases probe once the store reached its low watermark; give up after this")
    p.add_argument("--max-bytes", default="64MiB", help="the store's cap (SPARKCACHE_MAX_BYTES)")
    p.add_argument("--agents", type=int, default=2, help="background conversations")
    p.add_argument("--start-tokens", type=int, default=512, help="an agent conversation's first prompt")
    p.add_argument("--turn-tokens", type=int, default=128, help="new tokens per agent turn")
    p.add_argument("--agent-output", type=int, default=32, help="output tokens per agent turn")
    p.add_argument("--conversation-tokens", type=int, default=1024, help="an agent conversation starts over past this")
    p.add_argument("--probe-tokens", type=int, default=256, help="the probe's prompt (fresh each time)")
    p.add_argument("--probe-output", type=int, default=128, help="the probe's output tokens")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cap = parse_bytes(args.max_bytes)
    args.max_bytes, args.low_watermark_bytes = format_bytes(cap), format_bytes(cap * 4 // 5)
    if args.cycles < 1 or args.agents < 0 or args.probe_output < 2:
        raise SystemExit("--cycles >= 1, --agents >= 0 and --probe-output >= 2 are needed")
    if args.conversation_tokens + args.agent_output > args.max_model_len or \
            args.probe_tokens + args.probe_output > args.max_model_len:
        raise SystemExit(f"--conversation-tokens / --probe-tokens plus their output exceed --max-model-len "
                         f"{args.max_model_len}")
    from testing.tinymodel import BENCH, make_tiny_model

    model = make_tiny_model(BENCH)
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.out / "store"
    if root.exists():
        raise SystemExit(f"{root} exists: give a fresh --out (the run starts from an empty store)")
    phases = []
    t0 = time.monotonic()
    for cycle in range(args.cycles):
        order = MODES if cycle % 2 == 0 else MODES[::-1]
        for mode in order:
            phase = run_phase(args, model, root, mode, len(phases), args.out)
            phases.append(phase)
            print(f"phase {phase['index']} {mode:>12}: decode {phase['decode_tok_s']:.2f} tok/s, TTFT "
                  f"{phase['ttft_s']:.3f} s, gap p99 {1000 * phase['gap_p99_s']:.1f} ms, {phase['probes']} probes, "
                  f"at cap {100 * phase['at_cap_fraction']:.0f}% (probes starting at cap {phase['probes_at_cap']}, "
                  f"with publications pending {phase['probes_publication_pending']}), passes {phase['maintenance_passes']:.0f} "
                  f"(over budget {phase['passes_over_budget']:.0f}), evictions {phase['evictions']:.0f}, "
                  + "TTFT split (ms) " + " ".join(f"{k} {1000 * v:.1f}" for k, v in phase["ttft_split_s"].items())
                  + ", " + "".join(f"{k} {1000 * v['mean_s']:.2f} ms/step (p99 <= {v['p99_at_most_s']}), "
                            for k, v in phase["connector_per_step"].items())
                  + f"[{time.monotonic() - t0:.0f} s]", flush=True)
    result = {"bench": "replay_b_engine", "args": {k: str(v) for k, v in vars(args).items()},
              "load": os.getloadavg(), "phases": phases, "summary": summarize(phases, args)}
    out = args.out / "replay_b_engine.json"
    out.write_text(json.dumps(result, indent=1))
    png = plot(result, args.out / "replay_b_engine.png")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}" + (f" and {png}" if png else " (matplotlib not installed: no plot)"))
    return 0 if result["summary"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
