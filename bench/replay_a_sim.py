"""One arm of Replay A, run in its own interpreter against one vLLM tree.

    python -m bench.replay_a_sim CONFIG.json RESULT.json

The ``vllm`` first on ``sys.path`` (pristine or the transformed tree) provides the real
``Scheduler``, KV cache manager, block pool and hybrid coordinator. The model is synthetic:
each scheduled request that reaches its end samples the next token of its turn's plan
(reasoning tokens, then the reply). Time is a simulated clock advanced by a modelled cost
per step; captures and restores finish on that clock (see ``bench.replay_a_connector``, or
``bench.replay_a_worker`` with ``"connector": "sparkcache"``: the real connector's scheduler side).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from bench import replay_a_connector as rc
from bench import replay_a_worker

# arm -> (connector mode, kv_connector_extra_config keys, needs the transformed tree)
ALL_KEYS = {
    "sparkcache_prefer_local_prefix": True,
    "sparkcache_retain_decode_checkpoint": True,
    "sparkcache_drop_superseded_checkpoint": True,
}


def arm_spec(arm: str, lease_seconds: float) -> tuple[str, dict, bool]:
    lease = {"sparkcache_gpu_lease_seconds": float(lease_seconds)}
    specs = {
        "read-write": ("read-write", {**lease, **ALL_KEYS}, True),
        "read-write-untransformed": ("read-write", {}, False),
        "read-write-transformed-off": ("read-write", {}, True),
        "restore-only": ("restore-only", {**lease, **ALL_KEYS}, True),
        "restore-only-untransformed": ("restore-only", {}, False),
        "read-write-no-lease": ("read-write", dict(ALL_KEYS), True),
        "read-write-no-prefer-local": ("read-write", {**lease, "sparkcache_retain_decode_checkpoint": True,
                                                      "sparkcache_drop_superseded_checkpoint": True}, True),
        "read-write-no-checkpoint": ("read-write", {**lease, "sparkcache_prefer_local_prefix": True}, True),
    }
    if arm not in specs:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(specs)}")
    return specs[arm]


ARMS = ("read-write", "read-write-untransformed", "read-write-transformed-off", "restore-only",
        "restore-only-untransformed", "read-write-no-lease", "read-write-no-prefer-local",
        "read-write-no-checkpoint")


def make_scheduler(cfg: dict, extra: dict, store_root: Path):
    from testing.vllm_scheduler import make_scheduler as make_vllm_scheduler

    bs = cfg["block_size"]
    num_blocks = cfg["kv_pool_tokens"] // bs
    groups = None  # the replay's own: full attention + one Mamba "align" group
    if cfg.get("layout", "hybrid") == "glm5next":
        from testing.field_layouts import scheduler_config_at

        groups = scheduler_config_at("glm5next", bs, num_blocks)
    scheduler = make_vllm_scheduler(connector_config(cfg, extra, store_root), num_blocks=num_blocks,
                                    block_size=bs, max_model_len=cfg["max_model_len"],
                                    max_num_batched_tokens=cfg["max_num_batched_tokens"],
                                    kv_cache_config=groups,  # hybrid, retention 0
                                    model=multimodal_model() if cfg["image_every"] else None)
    leases = getattr(scheduler, "sparkcache_leases", None)  # None: untransformed, or no lease key
    if leases is not None:
        leases.now = lambda: rc.CONTEXT.now  # leases run on the simulated clock
    if cfg.get("connector") == "sparkcache":
        replay_a_worker.attach(scheduler, rc.CONTEXT)
    pool = scheduler.kv_cache_manager.block_pool
    evict = pool._maybe_evict_cached_block

    def counted_evict(block):  # diagnostic only: how many hashed blocks the workload's pressure evicted
        evicted = evict(block)
        rc.CONTEXT.evicted_cached_blocks += int(evicted)
        return evicted

    pool._maybe_evict_cached_block = counted_evict
    preempt = scheduler._preempt_request

    def counted_preempt(request, *args, **kwargs):  # diagnostic only: the pool could not hold the running requests
        rc.CONTEXT.preemptions += 1
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted_preempt
    return scheduler


def multimodal_model() -> str:
    """A multimodal model config (the tiny Qwen2-VL), so the scheduler has an encoder budget and
    schedules each image's encoder input as for the field's model (this process imports
    torchvision through ``testing.torchvision_shim.site_dir``: ``bench.replay_a.run_arm``)."""
    from testing.tinyvlm import make_tiny_vlm

    return make_tiny_vlm()


def connector_config(cfg: dict, extra: dict, store_root: Path) -> dict:
    if cfg.get("connector") == "sparkcache":
        return replay_a_worker.connector_config(rc.CONTEXT, extra, store_root / "sparkcache")
    return {"kv_connector": "ReplayConnector", "kv_connector_module_path": "bench.replay_a_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": dict(extra)}


class Agent:
    """One agent's conversation: each turn's prompt is the previous prompt + reply + tool result
    (+ an image every ``image_every``-th turn: ``image_tokens`` placeholder tokens and its
    ``mm_features`` entry, an identifier of its own and its offset, as vLLM's processor makes
    them); reasoning is never repeated."""

    def __init__(self, idx: int, cfg: dict) -> None:
        self.idx, self.cfg = idx, cfg
        self.rng = random.Random(f"{cfg['seed']}/agent{idx}")
        self.counter = 0
        self.conv = -1
        self.turn = 0
        self.new_conversation()
        lo, hi = cfg["turn_gap"]
        self.next_arrival = self.rng.uniform(0, hi)
        self.request = None
        self.plan: list[int] = []

    def fresh(self, n: int) -> list[int]:
        base = (self.idx + 1) * 100_000_000
        out = list(range(base + self.counter, base + self.counter + n))
        self.counter += n
        return out

    def new_conversation(self) -> None:
        lo, hi = self.cfg["start_tokens"]
        self.conv += 1
        self.turn_in_conv = 0
        self.history = self.fresh(self.rng.randint(lo, hi))
        self.start_len = len(self.history)
        self.images: list[tuple[str, int, int]] = []  # (identifier, offset, length) in the history

    def make_request(self):
        from testing.vllm_scheduler import make_request

        cfg = self.cfg
        reasoning, reply = self.fresh(cfg["reasoning_tokens"]), self.fresh(cfg["reply_tokens"])
        # Default: the reply, then reasoning the next prompt drops (a trailing thinking block);
        # --reasoning-first generates the reasoning before the reply.
        self.plan = reasoning + reply if cfg.get("reasoning_first") else reply + reasoning
        self.reply = reply
        rid = f"a{self.idx}-t{self.turn}"
        self.request = make_request(rid, self.history, len(self.plan), block_size=cfg["block_size"],
                                    mm_features=image_features(self.images) or None)
        return self.request

    def finish_turn(self, now: float) -> None:
        cfg = self.cfg
        reply = self.reply
        tool = self.fresh(max(0, cfg["growth_tokens"] - cfg["reply_tokens"]))
        self.turn += 1
        self.turn_in_conv += 1
        self.history = self.history + reply + tool
        if cfg["image_every"] and self.turn % cfg["image_every"] == 0:
            n = cfg["image_tokens"]
            self.images.append((f"agent{self.idx}-image{self.turn}", len(self.history), n))
            self.history += [3] * n  # its placeholder tokens
        if len(self.history) - self.start_len >= cfg["new_conversation_after"]:
            self.new_conversation()
        self.request = None
        lo, hi = cfg["turn_gap"]
        self.next_arrival = now + self.rng.uniform(lo, hi)


def image_features(images: list[tuple[str, int, int]]) -> list:
    """vLLM's ``MultiModalFeatureSpec`` of each (identifier, offset, length): what the scheduler
    and the connector see of an image (its pixels only reach the encoder, which is synthetic here)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                  mm_position=PlaceholderRange(offset=offset, length=length))
            for ident, offset, length in images]


def run(cfg: dict) -> dict:
    from vllm.v1.request import RequestStatus

    from sparkcache.store import Identity, PageStore
    from testing.vllm_scheduler import step

    arm = cfg["arm"]
    mode, extra, _ = arm_spec(arm, cfg["lease_seconds"])
    bs, scale = cfg["block_size"], cfg["token_scale"]
    store_root = Path(tempfile.mkdtemp(prefix=f"replay-a-{arm}-", dir=cfg.get("store_dir")))
    store = PageStore(str(store_root), max_bytes=1 << 40, low_watermark_bytes=1 << 39, lease_seconds=300.0)
    identity = Identity("replay-a-hybrid", "attn+mamba-align", bs, 0, "vllm-0.32.0")
    context = replay_a_worker.WorkerContext if cfg.get("connector") == "sparkcache" else rc.ReplayContext
    ctx = context(store=store, identity=identity, mode=mode, block_size=bs,
                  kv_bytes_per_block=bs * scale * cfg["kv_bytes_per_token"],
                  restore_bps=cfg["restore_bytes_per_s"], capture_bps=cfg["capture_bytes_per_s"])
    rc.CONTEXT = ctx
    scheduler = make_scheduler(cfg, extra, store_root)
    ctx.scheduler = scheduler
    agents = [Agent(i, cfg) for i in range(cfg["agents"])]
    by_rid: dict[str, Agent] = {}
    admitted: dict[str, dict] = {}
    rows: list[dict] = []
    prefill_s = scale * cfg["prefill_s_per_token"]
    decode_step_s = scale * cfg["decode_s_per_token"]
    restart_at = cfg.get("restart_at")
    restarts, steps, peak_usage = 0, 0, 0.0
    peak_live = sum(len(a.history) for a in agents)  # the agents' current contexts, summed
    idle_steps = 0
    stalled = None

    cost = {"prefill_tokens": 0, "decoding": False}  # the last step's, for its modelled time

    def on_scheduled(out) -> None:
        for rid, agent in by_rid.items():
            if rid in admitted:
                continue
            stats = agent.request.prefill_stats
            if stats is None or stats.num_prompt_tokens == 0:
                continue
            admitted[rid] = {"local": stats.num_local_cached_tokens, "external": stats.num_external_cached_tokens,
                             "at": ctx.now}
        prefill_tokens, decoding = step_cost(scheduler, out)
        cost.update(prefill_tokens=prefill_tokens, decoding=decoding)

    def sample(req) -> int:  # the synthetic model: the turn's plan, token by token
        return by_rid[req.request_id].plan[req.num_output_tokens]

    while True:
        if restart_at is not None and ctx.now >= restart_at:
            # A simulated engine restart: drain, then a fresh Scheduler (empty GPU cache), same store.
            if not scheduler.has_requests() and ctx.next_event() is None and not by_rid:
                scheduler = make_scheduler(cfg, extra, store_root)
                ctx.scheduler = scheduler
                restart_at, restarts = None, restarts + 1
        draining = restart_at is not None and ctx.now >= restart_at
        if not draining:
            for agent in agents:
                if agent.request is None and agent.next_arrival <= ctx.now and agent.next_arrival < cfg["duration"]:
                    request = agent.make_request()
                    by_rid[request.request_id] = agent
                    scheduler.add_request(request)
                    agent.arrived = agent.next_arrival
        sending, recving = ctx.due()
        report = ctx.connector_output(sending, recving)  # None: the workers report nothing this step
        if not (scheduler.has_requests() or report):
            upcoming = [a.next_arrival for a in agents if a.request is None and a.next_arrival < cfg["duration"]]
            event = ctx.next_event()
            candidates = upcoming + ([event] if event is not None else [])
            if not candidates:
                break
            ctx.now = max(ctx.now, min(candidates))
            continue
        out = step(scheduler, sample=sample, on_scheduled=on_scheduled, **(report or {}))
        prefill_tokens, decoding = cost["prefill_tokens"], cost["decoding"]
        steps += 1
        peak_usage = max(peak_usage, scheduler.kv_cache_manager.usage)
        step_s = prefill_tokens * prefill_s + (decode_step_s if decoding else 0.0)
        upcoming = [] if draining else [a.next_arrival for a in agents
                                        if a.request is None and a.next_arrival < cfg["duration"]]
        acted = bool(sending or recving or out.preempted_req_ids)
        after = clock_after_step(ctx.now, step_s, acted, ctx.next_event(), upcoming)
        idle_steps = idle_steps + 1 if after == ctx.now and not (sending or recving) else 0
        stuck = (after is None and scheduler.has_requests()) or idle_steps > 100  # 100: a livelock, not a wait
        ctx.now = ctx.now if after is None else after
        for rid in [r for r, a in by_rid.items() if RequestStatus.is_finished(a.request.status)]:
            agent = by_rid.pop(rid)
            rows.append(turn_row(cfg, arm, agent, rid, admitted.pop(rid), ctx, prefill_s, decode_step_s))
            agent.finish_turn(ctx.now)
            peak_live = max(peak_live, sum(len(a.history) for a in agents))
        if stuck:  # reported with the arm's results so far, never raised (bench.replay_a prints it)
            stalled = stuck_message(scheduler, ctx.now, cfg, idle_steps > 100)
            break
    shutil.rmtree(store_root, ignore_errors=True)
    return {"arm": arm, "rows": rows, "steps": steps, "restarts": restarts, "peak_kv_usage": peak_usage,
            "captures": ctx.captures, "captured_bytes": ctx.captured_bytes,
            "publish_failures": ctx.publish_failures, "sim_seconds": ctx.now,
            "evicted_cached_blocks": ctx.evicted_cached_blocks, "peak_live_context_tokens": peak_live,
            "preemptions": ctx.preemptions, "stalled": stalled}


def step_cost(scheduler, out) -> tuple[int, bool]:
    """(prefill tokens, whether any request decodes) of the step ``out`` scheduled, for its
    modelled time; called after ``schedule()``, before ``update_from_output``.

    ``schedule()`` has already advanced each request's ``num_computed_tokens`` by its chunk, so
    the progress the step started from is that minus the chunk. A chunk is decode when it is one
    token past the prompt; any other (a prompt's chunks, the one that completes it included; a
    preempted request recomputing its outputs) is prefill."""
    prefill_tokens, decoding = 0, False
    for rid, n in out.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        if req.num_computed_tokens - n < req.num_prompt_tokens or n > 1:
            prefill_tokens += n
        else:
            decoding = True
    return prefill_tokens, decoding


def clock_after_step(now: float, step_s: float, acted: bool, event: float | None,
                     upcoming: list[float]) -> float | None:
    """The simulated time after one scheduler step; None when nothing is left to wait for.

    A step that ran tokens takes its modelled time. A step that ran nothing but changed what
    vLLM will do (``acted``) takes none, and the loop steps again at once, as vLLM's engine
    core does: vLLM acts on finished_sending/finished_recving at its next ``schedule()`` (a
    restored request leaves WAITING_FOR_REMOTE_KVS there; freed blocks admit a waiting one),
    and a step that preempted a request admits no waiting request (``schedule()`` skips the
    waiting queue when it preempted), so the blocks it freed are used at the next step.
    Otherwise the clock jumps to the next restore or capture completion or agent arrival
    (an event due now is delivered next step).
    """
    if step_s > 0.0:
        return now + step_s
    if acted:
        return now
    nxt = min([t for t in [event, *upcoming] if t is not None], default=None)
    return None if nxt is None else max(now, nxt)


def stuck_message(scheduler, now: float, cfg: dict, livelock: bool = False) -> str:
    """Why the arm stopped: requests vLLM holds but will not schedule, with nothing pending."""
    pool = scheduler.kv_cache_manager.block_pool
    held = ", ".join(f"{rid} ({r.status.name}, prompt {r.num_prompt_tokens}, computed {r.num_computed_tokens})"
                     for rid, r in scheduler.requests.items())
    what = ("ran 100 steps in a row without a token or a report" if livelock else
            "schedules nothing, and no restore, capture or arrival is pending")
    return (f"scheduler stuck at t={now:.1f} s: vLLM holds {held or 'no request'} but {what} "
            f"({pool.get_num_free_blocks()} of {pool.num_gpu_blocks} blocks free, --kv-pool-tokens "
            f"{cfg['kv_pool_tokens']}); the arm's numbers cover the turns that finished before it. A request "
            "that cannot fit in the pool waits forever in vLLM: rerun with a larger --kv-pool-tokens to tell "
            "pool pressure from a replay-loop or connector bug")


def turn_row(cfg, arm, agent, rid, adm, ctx, prefill_s, decode_step_s) -> dict:
    bs = cfg["block_size"]
    prompt = agent.request.num_prompt_tokens
    local, ext = adm["local"], adm["external"]
    snap = ctx.residency.pop(rid, {"attn_tokens": 0, "mamba_blocks": set()})
    load = ctx.loads.pop(rid, {"seconds": 0.0, "read_ok": True})
    end = local + ext
    attn = snap["attn_tokens"]
    avoidable = max(0, min(end, attn) - local) if ext else 0
    if ext and end <= attn and end // bs not in snap["mamba_blocks"]:
        # vLLM 0.32.0 cannot load a recurrent state without its block: the last block is needed.
        avoidable = max(0, avoidable - bs)
    rescued = bool(ext) and attn < end
    recomputed = prompt - local - ext
    decode_s = len(agent.plan) * decode_step_s
    return {
        "arm": arm, "agent": agent.idx, "conversation": agent.conv, "turn": agent.turn,
        "turn_in_conversation": agent.turn_in_conv, "continuation": agent.turn_in_conv > 0,
        "images": len(agent.images),
        "arrival_s": round(agent.arrived, 3), "admitted_s": round(adm["at"], 3),
        "prompt_tokens": prompt, "local_tokens": local, "external_tokens": ext, "recomputed_tokens": recomputed,
        "resident_attention_tokens": attn, "avoidable_external_tokens": avoidable, "rescued": rescued,
        "state_reload": bool(ext) and not rescued, "restore_read_ok": load["read_ok"],
        "latency_s": round(load["seconds"] + recomputed * prefill_s + decode_s, 3),
        "recompute_latency_s": round(prompt * prefill_s + decode_s, 3),
        "sim_latency_s": round(ctx.now - agent.arrived, 3),
    }


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    result = run(config)
    import vllm.v1.core.sched.scheduler as sched_mod

    result["scheduler_file"] = sched_mod.__file__
    Path(sys.argv[2]).write_text(json.dumps(result))
