"""Time to first token after an engine restart: recompute vs sparkcache vs vLLM's ExampleConnector vs LMCache.

    python -m bench.restore_ttft --out bench-out/restore_ttft.json [--prompt-tokens 2100] [--reps 3] [--prompts 4]
        [--recompute-reps 1] [--kv-cache-gib 1] [--cold | --warm] [--arms recompute,sparkcache,example,lmcache]
    python -m bench.restore_ttft --out bench-out/restore_curve.json --prompt-tokens 2048,8192,32768,65536 \
        [--recompute-max-tokens 8192] ...

Several sizes make a curve: one point per size (each as below), then per size the TTFT of each
arm, the load each restore arm added over a local hit and its GB/s (bytes placed / load
added), sparkcache's restore rate (its worker's own restore time, from the connector's
``restore_seconds`` and ``restore_bytes`` histograms) next to the raw read rate of the same
stored files in the same page-cache state (``bench.page_cache.read_rate``), in the JSON
(``curve``) and a PNG beside it. Sizes above ``--recompute-max-tokens`` get no timed
recompute life (a 64K-token prefill takes minutes on 2 cores): their recompute TTFT is the
sparkcache storing life's, a fresh engine computing the prompt. Each life's KV cache holds at
least two copies of the prompt's KV, so the local repeat still hits.

One run, four arms (``--arms`` picks some; sparkcache always among them), the same
``--prompts`` prompts (random token ids, 2,000+ tokens each, no shared prefix), greedy:

- ``recompute``: no connector; the prompts are computed;
- ``sparkcache``: one engine life publishes the prompts' KV (read-write), then each timed
  life is a fresh engine on the same root that restores them (verified read, then placed);
- ``example``: vLLM's own ``ExampleConnector`` (``shared_storage_path``, also KV on disk):
  one life stores, each timed life is a fresh engine that loads them;
- ``lmcache``: LMCache 0.5.6 through vLLM's ``LMCacheConnectorV1``, its ``fs://`` backend on
  the arm's root (the one that restores after a restart), 256-token chunks, no local CPU tier.
  LMCache has no CPU build: its copy between vLLM's KV cache and its chunks is this bench's
  torch copy (bench/lmcache_arm.py, which installs the wheel into .cache/bench-lmcache on
  first use, never into the venv), so this arm measures LMCache's storage, lookup and
  integration, not its CUDA kernels. It restores whole chunks up to all but the last prompt
  token (``restored_tokens``, not rounded to vLLM blocks), and its local repeat also loads the
  tokens after vLLM's last full block from LMCache (``notes``).

Every engine life is its own process in its own session, killed as a group with SIGKILL
afterwards (engine processes ignore SIGTERM). In a timed life the engine starts, serves
one short unrelated warm-up prompt (40 tokens) (so one-off first-forward costs are not billed to an
arm), then the timed requests, one prompt after the other (none of them is in the engine's
own prefix cache: distinct prompts), greedy with ``--check-tokens`` output tokens: TTFT is vLLM's
own ``RequestOutput.metrics.first_token_latency`` of each request (arrival to first token;
the wall time of its whole ``generate`` is kept as ``generate_s``). Right after each timed
request, the same prompt is sent again: a local prefix-cache hit on the same 2,080 tokens and
the same last tokens to compute, with no connector load. Its TTFT (``local_ttft_s``) is that
life's price of the rest of the request, so ``ttft_s - local_ttft_s`` is what the restore
itself added (``restore_overhead_s``), free of how fast that engine life happens to compute
(on a shared machine lives of one arm differ by more than the two restores do; docs/RESULTS.md).
The load is also timed where it runs, with no forward in it: every arm's connector is its own with
its lookup and load hooks timed (``bench.timed_hooks``), and ``connector_s`` is what a request
spent in them (``connector_median_s`` per arm, paired request by request against sparkcache).
Several prompts per life give each arm ``--reps`` x ``--prompts`` samples for the cost of
``--reps`` engine starts;
the JSON also keeps the median of the first request after each restart apart. The run fails
unless every arm's lives give one greedy output per prompt and the restore arms that restore the same
prefix give the same one (they place the same stored KV and prefill the same last tokens: sparkcache and
ExampleConnector always, LMCache where its chunks end where vLLM's blocks do, as at 256k + 1 tokens;
elsewhere ``lmcache_identical_to_sparkcache`` says). The recompute arm is compared
but not required to match: with this random-weight bf16 model, greedy tokens depend on how
the prompt's prefill was split (a 2,100-token prefill, a restored 2,080-token prefix plus 20,
and a locally cached 2,080-token prefix plus 20 gave three different outputs; docs/RESULTS.md).

The model is ``testing.tinymodel.BENCH``, a random-weight Llama made offline (hidden
1024, 8 layers, 16 query / 4 KV heads of 64, bf16): its compute per token against KV bytes
per token is that of a real small model, unlike the tiny test model, which recomputes
faster than any disk read. Both figures are in the JSON (``model``). The store's pages sit
in the OS page cache when read (both connectors alike), unless ``--cold`` takes the arm's stored
files out of it (``POSIX_FADV_DONTNEED``) right before each timed request; the fraction of the
stored files' pages in the page cache just before each request is measured (``mincore``) and
kept. Every life gets a KV cache of ``--kv-cache-gib`` (vLLM's ``kv_cache_memory_bytes``): by
default vLLM's CPU backend takes ~90% of the machine's memory for it, which pushes the stored
files out of the page cache at random, in either arm. ``--warm`` reads the arm's stored files
once right before each timed request instead, so both read from the page cache, as the raw read
of the same files (``restore_rate.raw_read``) does.
``--model hybrid`` runs ``testing.tinymodel.BENCH_HYBRID`` (NemotronH: 4 Mamba2 and 4
attention layers, hidden 1024, fp32; 8 KiB of KV per token, like ``BENCH``, plus 4.2 MiB of
recurrent state per entry) with ``mamba_cache_mode="align"``, the block size vLLM picks and prefill
chunks of one block (what vLLM's CPU Mamba2 kernels need; ``engine`` in the JSON), in two
arms: recompute and sparkcache, whose restore places the pages and the recurrent state
(vLLM's ExampleConnector cannot load a hybrid model, and the bench's copy for LMCache places
attention KV only; ``not_run`` says so). vLLM raises the
block size of this model to 576 tokens (``hybrid_shape``), so a prompt of 4 blocks + 20
tokens (``--prompt-tokens 2324``) restores 2,304 tokens and computes 20, as the Llama runs do.
Each peer arm (ExampleConnector, LMCache) is paired against sparkcache request by request (``ratios``;
the example arm's keys name no peer, the lmcache arm's end in ``_vs_lmcache``). Sizes of 256k + 16
tokens (2064, 8208, 32784) make all three restore the same prefix and compute the same 16 tokens:
LMCache restores whole 256-token chunks, and vLLM 0.32.0's ExampleConnector finds nothing at a
prompt of 32k + 1 tokens (it stores the first (n - 1) // 32 * 32 tokens and looks up the first
(n - 2) // 32 * 32).
Medians over ``--reps`` fresh restarts x ``--prompts`` requests per arm; the timed lives interleave the arms (a round
of one life per arm, ``--reps`` times), so drift of a shared machine hits every arm alike. The recompute arm,
far slower than either restore, has a timed life in the first ``--recompute-reps`` rounds only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.page_cache import evict, files_under, read_rate, resident_fraction
from bench.timed_hooks import LOG_ENV, HookLog
from contracts.engine_driver import RESULT_MARKER, load_cfg, run_in_fresh_process

REPO = Path(__file__).resolve().parents[1]
ARMS = ("recompute", "sparkcache", "example", "lmcache")
HYBRID_ARMS = ("recompute", "sparkcache")  # neither peer connector can load a hybrid model (HYBRID_NOT_RUN)
PEER_ARMS = ("example", "lmcache")  # the other connectors, each paired against sparkcache
RAW_READ_REPS = 5  # the raw read the restore rate is compared with: the median of this many
LMCACHE_NOTE = ("LMCache 0.5.6 (fs:// backend, 256-token chunks, no local CPU tier) with this bench's torch copy "
                "between vLLM's CPU KV cache and its chunks in place of its CUDA kernels (bench/lmcache_arm.py). "
                "It restores whole chunks up to all but the last prompt token (restored_tokens), not vLLM blocks; "
                "its local repeat is not load-free: vLLM's prefix cache holds the full blocks and LMCache loads "
                "the tokens after them from their chunk file, so its load added leaves out up to one chunk read")
HYBRID_NOT_RUN = {
    "example": "vLLM's ExampleConnector cannot load a hybrid model (docs/CONNECTOR.md)",
    "lmcache": "not run: the bench's CPU copy for LMCache (bench/lmcache_arm.py) places attention KV only, "
               "no Mamba2 recurrent state"}


@dataclass(frozen=True)
class EngineShape:
    """How the engine runs a model: its KV block size and prefill chunk. Hybrid (Mamba2)
    models run with ``mamba_cache_mode="align"`` and chunks of one block (vLLM's CPU Mamba2
    chunk scan needs prefill chunks that end on block boundaries)."""
    block_size: int
    max_num_batched_tokens: int | None  # None: the whole prompt in one step
    mamba_cache_mode: str | None


LLAMA_SHAPE = EngineShape(32, None, None)


def hybrid_shape(spec) -> EngineShape:
    """The engine shape of a NemotronH ``HybridSpec``. vLLM gives every layer the same page
    size, so it raises a hybrid model's attention block size until one attention layer's page
    (block x 2 x KV heads x head dim x dtype bytes) holds one Mamba layer's state, in steps of
    the kernel block (64 here; ``Platform._align_hybrid_block_size``): 576 tokens for
    ``BENCH_HYBRID``, as for real hybrid models (hundreds of tokens per block). The engine
    life checks vLLM's choice against this one."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * _DTYPE_BYTES[spec.dtype]
    block = 64 * -(-_mamba_layer_state_bytes(spec) // (64 * per_token))
    return EngineShape(block, block, "align")


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _mamba_conv_channels(spec) -> int:
    return spec.mamba_num_heads * spec.mamba_head_dim + 2 * spec.n_groups * spec.ssm_state_size


def _mamba_layer_state_bytes(spec) -> int:
    """One Mamba2 layer's state: conv state (kernel 4 - 1 columns) plus SSM state."""
    inner = spec.mamba_num_heads * spec.mamba_head_dim
    return (3 * _mamba_conv_channels(spec) + inner * spec.ssm_state_size) * _DTYPE_BYTES[spec.dtype]


@dataclass(frozen=True)
class ModelFigures:
    """Per-token cost of the model: matmul FLOPs (2 per weight) and KV bytes written."""
    path: str
    layers: str                     # e.g. "8 x attention" or a hybrid pattern ("M*M*": Mamba2, attention)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    params: int
    flops_per_token: int            # 2 x weights touched per token (embedding lookup excluded)
    attention_flops_per_token_at_prompt: int  # causal QK^T and AV, averaged over the prompt
    kv_bytes_per_token: int
    flops_per_kv_byte: float
    state_bytes_per_entry: int = 0  # a hybrid model's recurrent state, stored once per entry


@dataclass(frozen=True)
class Timed:
    """One timed request of a timed engine life."""
    arm: str
    rep: int
    prompt: int                     # index into the prompts; 0 is the first request after the restart
    ttft_s: float
    generate_s: float
    check_tokens: list[int]
    num_cached_tokens: int
    local_ttft_s: float             # the same prompt again right after: a local prefix hit, no load
    resident_fraction: float        # of the arm's stored files' pages, in the page cache before it
    restore_overhead_s: float       # ttft_s - local_ttft_s
    hooks_s: dict[str, float]       # the connector's load hooks during the request, by hook (bench.timed_hooks)

    @property
    def connector_s(self) -> float:
        """The time the request spent in the connector's load hooks, its lookup and its load: a
        sum over the processes that ran them (on this CPU engine, one worker), not a critical path."""
        return sum(self.hooks_s.values())


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    ttft_median_s: float            # over every timed request of the arm
    ttft_min_s: float
    first_after_restart_median_s: float  # prompt 0 of each life only
    local_ttft_median_s: float      # the repeats (a local hit: the same compute, no load)
    restore_overhead_median_s: float  # median of ttft_s - local_ttft_s (within one life)
    life_medians_s: list[float]     # median TTFT of each timed life, in round order
    resident_fraction_range: tuple[float, float]  # of the stored files in the page cache, before a request
    ttft_all_s: list[float]
    num_cached_tokens: int          # the fewest of any timed request
    external_hit_tokens: float      # vllm:external_prefix_cache_hits, summed over the timed lives
    startup_median_s: float
    populate_ttft_s: list[float] | None  # TTFT of each prompt in the storing life (no warm-up)
    connector_median_s: float       # median of Timed.connector_s: the load timed where it runs


def model_figures(path: str, spec, prompt_tokens: int) -> ModelFigures:
    h, hd, L = spec.hidden_size, spec.head_dim, spec.num_layers
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * spec.intermediate_size
    params = L * per_layer + 2 * spec.vocab_size * h
    flops = 2 * (L * per_layer + spec.vocab_size * h)  # lm_head counted, embedding lookup free
    # causal attention: each token attends to on average prompt/2 keys: QK^T + AV = 2 x 2 x q x keys
    attn = L * 4 * q * (prompt_tokens // 2)
    kv_bytes = L * 2 * kv * _DTYPE_BYTES[spec.dtype]
    return ModelFigures(path, f"{L} x attention", h, L, spec.num_heads, spec.num_kv_heads, hd, spec.dtype,
                        params, flops, attn, kv_bytes, round((flops + attn) / kv_bytes, 1))


def hybrid_figures(path: str, spec, prompt_tokens: int) -> ModelFigures:
    """``model_figures`` for a NemotronH ``HybridSpec``: per Mamba2 layer in_proj (z, x, B, C,
    dt) and out_proj (the scan itself, linear in the state, is left out), per attention layer
    q/k/v/o, per MLP layer up and down (intermediate 2 x hidden); KV bytes from the attention
    layers only; the recurrent state (conv + SSM) of every Mamba2 layer once per entry."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    inner = spec.mamba_num_heads * spec.mamba_head_dim
    weights = {"M": h * (inner + _mamba_conv_channels(spec) + spec.mamba_num_heads) + inner * h,
               "*": h * q + 2 * h * kv + q * h, "-": 2 * h * 2 * h}
    per_layers = sum(weights[c] for c in spec.pattern)
    n_attn = spec.pattern.count("*")
    flops = 2 * (per_layers + spec.vocab_size * h)
    attn = n_attn * 4 * q * (prompt_tokens // 2)
    kv_bytes = n_attn * 2 * kv * _DTYPE_BYTES[spec.dtype]
    state = spec.pattern.count("M") * _mamba_layer_state_bytes(spec)
    return ModelFigures(path, spec.pattern, h, len(spec.pattern), spec.num_heads, spec.num_kv_heads, hd,
                        spec.dtype, per_layers + 2 * spec.vocab_size * h, flops, attn, kv_bytes,
                        round((flops + attn) / kv_bytes, 1), state)


# ---------------------------------------------------------------------- one engine life (child)

def _engine_life(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg["arm"] == "lmcache":  # LMCache reads its settings from the environment, at import
        from bench.lmcache_arm import lmcache_env

        os.environ.update(lmcache_env(cfg["root"]))
    # beside the arm's root, not in it (its files are what is evicted and read raw); the
    # connector's processes inherit the variable (bench/timed_hooks.py)
    hooks = HookLog(f"{cfg['root']}.hooks-{os.getpid()}")
    os.environ[LOG_ENV] = hooks.path
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    # each arm's own connector, its load hooks timed (bench.timed_hooks)
    kvt = None
    if cfg["arm"] == "sparkcache":
        kvt = KVTransferConfig(kv_connector="TimedSparkcacheConnector",
                               kv_connector_module_path="bench.timed_hooks", kv_role="kv_both",
                               kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"root": cfg["root"], "min_span_tokens": 64})
    elif cfg["arm"] == "example":
        kvt = KVTransferConfig(kv_connector="TimedExampleConnector", kv_connector_module_path="bench.timed_hooks",
                               kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": cfg["root"]})
    elif cfg["arm"] == "lmcache":  # vLLM's LMCacheConnectorV1 with the bench's CPU copy (bench/lmcache_arm.py)
        kvt = KVTransferConfig(kv_connector="TimedLMCacheCPUConnector", kv_connector_module_path="bench.timed_hooks",
                               kv_role="kv_both")
    t0 = time.monotonic()
    shape = EngineShape(**cfg["shape"])
    hybrid = {"mamba_cache_mode": shape.mamba_cache_mode} if shape.mamba_cache_mode else {}
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enable_prefix_caching=True,
              max_model_len=cfg["max_model_len"], block_size=shape.block_size, kv_transfer_config=kvt,
              disable_log_stats=False, seed=0,
              max_num_batched_tokens=shape.max_num_batched_tokens or cfg["max_model_len"],
              kv_cache_memory_bytes=cfg["kv_cache_bytes"], **hybrid)
    startup_s = time.monotonic() - t0
    chosen = llm.llm_engine.vllm_config.cache_config.block_size
    if chosen != shape.block_size:
        raise RuntimeError(f"vLLM chose block size {chosen}, the bench planned {shape.block_size} "
                           "(bench.restore_ttft.hybrid_shape): fix hybrid_shape to vLLM's rule")
    greedy = dict(temperature=0.0, ignore_eos=True)

    def short_request(ids: list[int]) -> None:  # one token, untimed
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)

    if cfg.get("warmup"):
        short_request(cfg["warmup"])
    params = SamplingParams(max_tokens=max(1, cfg["check_tokens"]), **greedy)

    def ttft_of(out) -> float:  # vLLM's own per-request TTFT (frontend arrival -> first token)
        ttft_s = float(getattr(out.metrics, "first_token_latency", 0.0) or 0.0)
        if ttft_s <= 0.0:
            raise RuntimeError("RequestOutput.metrics.first_token_latency missing; fix: run with "
                               "disable_log_stats=False (vLLM fills it only when it logs stats)")
        return ttft_s

    # the arm's stored KV: not sparkcache's journal, which the running store appends to (its
    # last page can be dirty at any moment, and no eviction takes it out of the page cache)
    stored = ([p for p in files_under(cfg["root"]) if f"{os.sep}journal{os.sep}" not in p]
              if cfg["arm"] != "recompute" else [])
    requests = []
    for prompt in cfg["prompts"]:  # one at a time: each TTFT is its own request's alone
        if cfg.get("cold"):
            evict(stored)
        elif cfg.get("warm"):
            read_rate(stored, cold=False)  # every stored page in the page cache, as for the raw read
        resident = resident_fraction(stored)
        hooks.take()  # what came before this request
        t = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        generate_s = time.monotonic() - t
        request = {"ttft_s": ttft_of(out), "generate_s": generate_s, "resident_fraction": resident,
                   "check_tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0,
                   "hooks_s": hooks.take()}
        if cfg.get("repeat_local"):  # the same prompt again: a local prefix hit, nothing loaded
            again = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            request.update(local_ttft_s=ttft_of(again), local_cached_tokens=again.num_cached_tokens or 0)
        requests.append(request)
    if cfg.get("settle"):  # the storing life: a short request last, so the steps that copied the
        # prompts' captures out (steps of an otherwise idle engine) reach the metrics read below
        short_request(cfg["settle"])
    external = 0.0
    restore = {"seconds": 0.0, "bytes": 0.0, "count": 0}  # sparkcache's histograms (worker side)
    steps: dict[str, int] = {}  # worker_step_seconds: cumulative count by bucket bound, all ranks
    for m in llm.get_metrics():
        if m.name == "vllm:external_prefix_cache_hits":
            external += getattr(m, "value", 0) or 0
        elif m.name == "vllm:sparkcache_worker_step_seconds":
            for le, n in m.buckets.items():
                steps[le] = steps.get(le, 0) + n
        elif m.name == "vllm:sparkcache_restore_seconds":
            restore["seconds"] += m.sum
            restore["count"] += m.count
        elif m.name == "vllm:sparkcache_restore_bytes":
            restore["bytes"] += m.sum
    try:  # shut down: the connector drains its publications (the storing life needs this)
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {"startup_s": startup_s, "requests": requests, "external_hit_tokens": external, "restore": restore,
            "worker_step_buckets": steps}


def chosen_arms(requested: list[str] | None, model: str) -> tuple[str, ...]:
    """The arms a point runs, in ARMS order: ``--arms`` (default every arm of the model)."""
    available = HYBRID_ARMS if model == "hybrid" else ARMS
    if requested is None:
        return available
    missing = [arm for arm in requested if arm not in available]
    if missing:
        raise SystemExit(f"--arms {','.join(requested)}: {', '.join(missing)} cannot run with --model {model} "
                         f"({'; '.join(HYBRID_NOT_RUN.get(a, 'unknown arm') for a in missing)}); pick from "
                         f"{','.join(available)}")
    if "sparkcache" not in requested:
        raise SystemExit(f"--arms {','.join(requested)}: add sparkcache (the other arms are paired against it)")
    return tuple(arm for arm in available if arm in requested)


def not_run(arm_names: tuple[str, ...], model: str) -> dict[str, str]:
    """Each arm of ARMS this point left out, with the reason."""
    return {arm: HYBRID_NOT_RUN[arm] if model == "hybrid" and arm in HYBRID_NOT_RUN else "left out by --arms"
            for arm in ARMS if arm not in arm_names}


def lmcache_reusable(prompt_tokens: int) -> int:
    """The prefix LMCache restores: its full chunks (it stores no partial one, ``save_unfull_chunk``
    off by default), at most all but the last prompt token (vLLM computes at least one); not
    rounded to vLLM's block size, unlike the other two connectors."""
    from bench.lmcache_arm import CHUNK_TOKENS

    return min(prompt_tokens - 1, prompt_tokens // CHUNK_TOKENS * CHUNK_TOKENS)


def peer_ratios(peer: str, arms: dict, timed: list) -> dict:
    """``peer`` (example or lmcache) against sparkcache: TTFT ratios, request-by-request pairs
    (the same prompt of the same round) and the load each added over its own local repeat.
    The example arm's keys are unchanged from before the lmcache arm; the lmcache arm's
    unnamed ones carry ``_vs_lmcache``."""
    sc, sc_over = arms["sparkcache"].ttft_median_s, arms["sparkcache"].restore_overhead_median_s
    theirs, their_over = arms[peer].ttft_median_s, arms[peer].restore_overhead_median_s
    sfx = "" if peer == "example" else f"_vs_{peer}"
    pairs = {(t.rep, t.prompt): t for t in timed if t.arm == peer}
    mine = [t for t in timed if t.arm == "sparkcache"]
    paired = [pairs[(t.rep, t.prompt)].ttft_s / t.ttft_s for t in mine]
    # the load each added over its own local hit, request by request (seconds; > 0: sparkcache's is smaller)
    load_diffs = [pairs[(t.rep, t.prompt)].restore_overhead_s - t.restore_overhead_s for t in mine]
    # the same, timed in the connectors' own hooks (no forward in it)
    hook_diffs = [pairs[(t.rep, t.prompt)].connector_s - t.connector_s for t in mine]
    sc_hooks = arms["sparkcache"].connector_median_s
    rounds = list(zip(arms["sparkcache"].life_medians_s, arms[peer].life_medians_s))
    return {f"{peer}_over_sparkcache": theirs / sc,
            f"{peer}_over_sparkcache_paired_median": _median(paired),
            f"sparkcache_faster_in_pairs{sfx}": f"{sum(r >= 1 for r in paired)}/{len(paired)}",
            f"sparkcache_faster_in_rounds{sfx}": f"{sum(s <= e for s, e in rounds)}/{len(rounds)}",
            f"{peer}_over_sparkcache_restore_overhead": their_over / sc_over if sc_over > 0 else None,
            f"sparkcache_load_smaller_in_pairs{sfx}": f"{sum(d >= 0 for d in load_diffs)}/{len(load_diffs)}",
            f"{peer}_minus_sparkcache_load_paired_median_s": _median(load_diffs),
            f"sparkcache_connector_time_smaller_in_pairs{sfx}": f"{sum(d >= 0 for d in hook_diffs)}/{len(hook_diffs)}",
            f"{peer}_over_sparkcache_connector_time": arms[peer].connector_median_s / sc_hooks if sc_hooks > 0 else None}


def step_quantiles(buckets: dict[str, int]) -> dict:
    """The median and the largest of the steps' time in the connector's worker hooks, as the
    bucket bounds of ``worker_step_seconds`` they fall under (seconds; inf above the last)."""
    bounds = sorted((float(le), n) for le, n in buckets.items())
    count = bounds[-1][1] if bounds else 0

    def under(q: float) -> float | None:
        return next((le for le, n in bounds if n >= q * count), None) if count else None
    return {"steps": count, "median_at_most_s": under(0.5), "max_at_most_s": under(1.0)}


def median_step_at_most(steps: dict, bound_s: float) -> bool:
    """``step_quantiles``'s median at or under ``bound_s``; no step observed is no measurement,
    so it is not met."""
    return steps["median_at_most_s"] is not None and steps["median_at_most_s"] <= bound_s


# ---------------------------------------------------------------------- parent

def life_env(timeout_s: int) -> dict[str, str]:
    """The environment a life adds for vLLM: one step may take as long as the whole life.
    The bench prefills a prompt in one step, and vLLM's multiprocess executor gives one
    ``execute_model`` call ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s unless set): a long
    prompt's prefill on a small CPU would be killed as a hung worker."""
    return {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(timeout_s)}


def run_life(cfg: dict, timeout_s: int = 900, env: dict[str, str] | None = None) -> dict:
    """One engine life in its own process group (SIGKILLed afterwards); ``env`` adds to
    ``life_env``."""
    return run_in_fresh_process(cfg, REPO, timeout_s, command=("bench.restore_ttft", "--engine-life"),
                                env={**life_env(timeout_s), **(env or {})})


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run(args: argparse.Namespace) -> dict:
    """One point per ``--prompt-tokens`` size, smallest first; one size: that point alone.
    Each point is written to ``<out>.partial.json`` as it ends (a curve takes hours: the sizes
    measured survive a run stopped before the last)."""
    points = []
    for n in sorted(args.prompt_tokens):
        points.append(run_point(args, n))
        if len(args.prompt_tokens) > 1:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps({"points": points}, indent=1))
    if len(points) == 1:
        return points[0]
    return {"bench": "restore_ttft_curve", "sizes": [p["prompt_tokens"] for p in points],
            "curve": curve(points), "points": points}


def run_point(args: argparse.Namespace, prompt_tokens: int) -> dict:
    from testing.tinymodel import BENCH, BENCH_HYBRID, TINY, make_tiny_hybrid, make_tiny_model

    if args.model == "hybrid":
        spec = BENCH_HYBRID
        shape = hybrid_shape(spec)
        model, figures = make_tiny_hybrid(spec), hybrid_figures
    else:
        spec, shape = (TINY if args.model == "tiny" else BENCH), LLAMA_SHAPE
        model, figures = make_tiny_model(spec), model_figures
    arm_names = chosen_arms(args.arms, args.model)
    store_arms = [arm for arm in arm_names if arm != "recompute"]
    if "lmcache" in store_arms:
        from bench.lmcache_arm import ensure_installed

        ensure_installed()
    max_model_len = max(4096, prompt_tokens + 64)  # sizes checked against the model in main
    fig = figures(model, spec, prompt_tokens)
    # the KV of one prompt, twice over (the restored copy and vLLM's own blocks), at least
    # --kv-cache-gib: the repeat must find the prompt still in the engine's prefix cache
    kv_cache_bytes = max(int(args.kv_cache_gib * (1 << 30)), 2 * max_model_len * fig.kv_bytes_per_token)
    recompute_timed = "recompute" in arm_names and prompt_tokens <= args.recompute_max_tokens
    timed_arms = tuple(arm for arm in arm_names if arm != "recompute" or recompute_timed)
    dtype = args.dtype or spec.dtype
    rng = random.Random(args.seed)
    vocab = spec.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(args.prompts)]
    # shorter than the connector's min_span_tokens (64): sparkcache does not capture it, so no
    # background publication overlaps the timed requests (ExampleConnector stores it in-step)
    warmup = [rng.randrange(3, vocab) for _ in range(40)]
    reusable = (prompt_tokens - 1) // shape.block_size * shape.block_size
    restorable = {arm: lmcache_reusable(prompt_tokens) if arm == "lmcache" else reusable for arm in store_arms}
    base = {"model": model, "dtype": dtype, "prompts": prompts, "warmup": warmup, "shape": asdict(shape),
            "check_tokens": args.check_tokens, "max_model_len": max_model_len,
            "cold": args.cold, "warm": args.warm, "kv_cache_bytes": kv_cache_bytes}
    work = Path(tempfile.mkdtemp(prefix="restore_ttft-", dir=args.work_dir))
    timed: list[Timed] = []
    startups: dict[str, list[float]] = {arm: [] for arm in timed_arms}
    external: dict[str, float] = {arm: 0.0 for arm in timed_arms}
    restored = {"seconds": 0.0, "bytes": 0.0, "count": 0}  # sparkcache's worker, all timed lives
    populate: dict[str, list[float]] = {}
    for arm in store_arms:  # the restore arms store the prompts first, in a life of their own
        t = time.monotonic()
        stored = run_life({**base, "arm": arm, "root": str(work / arm), "warmup": None, "check_tokens": 1,
                           "repeat_local": False, "settle": warmup if arm == "sparkcache" else None},
                          args.life_timeout)
        populate[arm] = [r["ttft_s"] for r in stored["requests"]]
        if arm == "sparkcache":  # the life that captures: the model thread's time in the connector
            capture_steps = step_quantiles(stored["worker_step_buckets"])
        print(f"[{prompt_tokens}] [{arm}] stored {len(prompts)} prompts in {time.monotonic() - t:.0f} s "
              f"(ttft {' '.join(f'{x:.2f}' for x in populate[arm])} s)", flush=True)
    # Timed lives interleave the arms (rep 0 of each, then rep 1, ...), so a machine that gets
    # busier or quieter during the run shifts every arm alike.
    for rep in range(args.reps):
        for arm in timed_arms:
            if arm == "recompute" and rep >= args.recompute_reps:
                continue
            life = run_life({**base, "arm": arm, "root": str(work / arm), "repeat_local": True},
                            args.life_timeout)
            startups[arm].append(life["startup_s"])
            external[arm] += life["external_hit_tokens"]
            if arm == "sparkcache":
                for key in restored:
                    restored[key] += life["restore"][key]
            for i, r in enumerate(life["requests"]):
                if r["local_cached_tokens"] < reusable:
                    raise RuntimeError(f"[{arm}] rep {rep} prompt {i}: the repeat hit {r['local_cached_tokens']} "
                                       f"local tokens, not {reusable}; it is no baseline for the restore")
                request = Timed(arm, rep, i, r["ttft_s"], r["generate_s"], r["check_tokens"],
                                r["num_cached_tokens"], r["local_ttft_s"], r["resident_fraction"],
                                r["ttft_s"] - r["local_ttft_s"], r["hooks_s"])
                if arm != "recompute" and not request.connector_s > 0:
                    raise RuntimeError(f"[{arm}] rep {rep} prompt {i}: the connector's hooks recorded no time "
                                       f"(bench.timed_hooks); its load cannot be compared")
                timed.append(request)
            print(f"[{prompt_tokens}] [{arm}] rep {rep}: ttft " + " ".join(f"{r['ttft_s']:.3f}" for r in life["requests"]) +
                  " s, local repeat " + " ".join(f"{r['local_ttft_s']:.3f}" for r in life["requests"]) +
                  f" s (cached {min(r['num_cached_tokens'] for r in life['requests'])}, stored KV in page cache "
                  f"{min(r['resident_fraction'] for r in life['requests']):.0%}-"
                  f"{max(r['resident_fraction'] for r in life['requests']):.0%}, "
                  f"startup {life['startup_s']:.0f} s)", flush=True)
    arms = {}
    for arm in timed_arms:
        mine = [t for t in timed if t.arm == arm]
        ts = [t.ttft_s for t in mine]
        lives = sorted({t.rep for t in mine})
        arms[arm] = ArmSummary(arm, _median(ts), min(ts), _median([t.ttft_s for t in mine if t.prompt == 0]),
                               _median([t.local_ttft_s for t in mine]),
                               _median([t.restore_overhead_s for t in mine]),
                               [_median([t.ttft_s for t in mine if t.rep == r]) for r in lives],
                               (min(t.resident_fraction for t in mine), max(t.resident_fraction for t in mine)), ts,
                               min(t.num_cached_tokens for t in mine), external[arm], _median(startups[arm]),
                               populate.get(arm), _median([t.connector_s for t in mine]))

    def consistent(*names: str) -> bool:  # one greedy output per prompt across these arms' lives
        return all(len({tuple(t.check_tokens) for t in timed if t.arm in names and t.prompt == i}) == 1
                   for i in range(len(prompts)))
    # Above --recompute-max-tokens the recompute figure is the sparkcache storing life's TTFT: a
    # fresh engine computing each prompt (no warm-up: at these sizes a first forward's one-off
    # costs are noise against minutes of prefill)
    rec = arms["recompute"].ttft_median_s if recompute_timed else _median(populate["sparkcache"])
    sc = arms["sparkcache"].ttft_median_s
    sc_over = arms["sparkcache"].restore_overhead_median_s
    ratios = {"recompute_over_sparkcache": rec / sc}
    outputs = {"each_arm_consistent": all(consistent(a) for a in timed_arms),
               "recompute_identical_to_restore": consistent(*timed_arms) if recompute_timed else None}
    targets = {"sparkcache_faster_than_recompute": sc < rec,
               "sparkcache_restored_everything": arms["sparkcache"].num_cached_tokens == reusable}
    peers = [arm for arm in PEER_ARMS if arm in arms]
    for peer in peers:
        ratios.update(peer_ratios(peer, arms, timed))
        outputs[f"{peer}_identical_to_sparkcache"] = consistent("sparkcache", peer)
        targets.update({f"sparkcache_at_least_as_fast_as_{peer}": sc <= arms[peer].ttft_median_s,
                        f"sparkcache_restore_overhead_at_most_{peer}": sc_over <= arms[peer].restore_overhead_median_s,
                        f"sparkcache_connector_time_at_most_{peer}":
                            arms["sparkcache"].connector_median_s <= arms[peer].connector_median_s,
                        f"{peer}_restored_everything": arms[peer].num_cached_tokens == restorable[peer]})
    # every restore arm that restores the same prefix as sparkcache: the same greedy output (an
    # arm that restores another prefix prefills another split, which may change it; its
    # ``<peer>_identical_to_sparkcache`` says, without failing the run)
    same_split = [peer for peer in peers if restorable[peer] == reusable]
    if same_split:
        outputs["restore_arms_identical"] = consistent("sparkcache", *same_split)
    # The restore path's own rate (the worker's restore_seconds and restore_bytes histograms)
    # against a plain read of the same stored files in the same page-cache state (the median
    # of RAW_READ_REPS).
    raw = read_rate(files_under(str(work / "sparkcache")), cold=args.cold, reps=RAW_READ_REPS)
    rate = restored["bytes"] / restored["seconds"] / 1e9 if restored["seconds"] > 0 else 0.0
    restore_rate = {"restores": restored["count"], "bytes": restored["bytes"], "seconds": restored["seconds"],
                    "gb_per_s": rate, "raw_read": raw,
                    "of_raw_read": rate / raw["gb_per_s"] if raw["gb_per_s"] > 0 else None}
    targets["sparkcache_restore_rate_at_least_90pct_of_raw_read"] = (restore_rate["of_raw_read"] or 0) >= 0.9  # issue 41
    targets["capturing_life_median_worker_step_at_most_1ms"] = median_step_at_most(capture_steps, 0.001)
    result = {
        "bench": "restore_ttft",
        "prompt_tokens": prompt_tokens, "prompts": len(prompts), "engine": asdict(shape),
        "reusable_tokens": reusable, "reps": args.reps, "warmup_tokens": len(warmup),
        "check_tokens": args.check_tokens,
        "ttft": "RequestOutput.metrics.first_token_latency (median over reps x prompts)",
        "model": asdict(fig),
        "arms": {a: asdict(s) for a, s in arms.items()},
        "recompute": {"ttft_median_s": rec, "source": "timed lives" if recompute_timed else
                      "the sparkcache storing life (above --recompute-max-tokens)" if "recompute" in arm_names
                      else "the sparkcache storing life (recompute left out by --arms)"},
        "not_run": not_run(arm_names, args.model),
        "restored_tokens": restorable,
        "timed": [asdict(t) for t in timed],
        "restore_rate": restore_rate,
        "capturing_life_worker_steps": capture_steps,
        "ratios": ratios, "outputs": outputs, "targets": targets,
        "page_cache": ("cold (the arm's stored files evicted before each timed request)" if args.cold
                       else "warm (the arm's stored files read once before each timed request)" if args.warm
                       else "as left (the stored files were written by the previous life on this machine; "
                       "resident_fraction_range says how much stayed)"),
        "kv_cache_bytes": kv_cache_bytes,
        "cpu_count": os.cpu_count(),
        "notes": {"lmcache": LMCACHE_NOTE} if "lmcache" in arms else {},
    }
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def curve(points: list[dict]) -> list[dict]:
    """Per size: TTFT of each arm, the load each restore arm added over a local hit, its
    rate in GB/s (bytes placed / load added), sparkcache's own restore rate and the raw read."""
    rows = []
    for p in points:
        kv_bytes = p["reusable_tokens"] * p["model"]["kv_bytes_per_token"]
        restored = p.get("restored_tokens", {})
        row = {"prompt_tokens": p["prompt_tokens"], "restored_bytes_per_request": kv_bytes,
               "recompute_ttft_s": p["recompute"]["ttft_median_s"],
               "restore_gb_per_s": p["restore_rate"]["gb_per_s"],
               "raw_read_gb_per_s": p["restore_rate"]["raw_read"]["gb_per_s"],
               "pairs": p["ratios"].get("sparkcache_load_smaller_in_pairs"),
               "connector_pairs": p["ratios"].get("sparkcache_connector_time_smaller_in_pairs")}
        for arm in ("sparkcache", *PEER_ARMS):
            if arm in p["arms"]:
                added = p["arms"][arm]["restore_overhead_median_s"]
                placed = restored.get(arm, p["reusable_tokens"]) * p["model"]["kv_bytes_per_token"]
                row[f"{arm}_ttft_s"] = p["arms"][arm]["ttft_median_s"]
                row[f"{arm}_load_added_s"] = added
                row[f"{arm}_load_gb_per_s"] = placed / added / 1e9 if added > 0 else None
                row[f"{arm}_connector_s"] = p["arms"][arm]["connector_median_s"]
        rows.append(row)
    return rows


def plot(result: dict, png: Path) -> Path | None:
    """Load time and GB/s against prompt size, one line per arm (None without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["curve"]
    x = [r["prompt_tokens"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    for arm, style in (("sparkcache", "o-"), ("example", "s--"), ("lmcache", "d-.")):
        if all(f"{arm}_load_added_s" in r for r in rows):
            ax1.plot(x, [r[f"{arm}_load_added_s"] * 1e3 for r in rows], style, label=arm)
            ax2.plot(x, [r[f"{arm}_load_gb_per_s"] or 0 for r in rows], style, label=f"{arm} (bytes / load added)")
            ax3.plot(x, [r[f"{arm}_ttft_s"] for r in rows], style, label=arm)
    ax2.plot(x, [r["restore_gb_per_s"] for r in rows], "o:", label="sparkcache restore (worker's own time)")
    ax2.plot(x, [r["raw_read_gb_per_s"] for r in rows], "k-", label="raw read of the same files")
    ax3.plot(x, [r["recompute_ttft_s"] for r in rows], "^-", label="recompute")
    for ax, title, unit in ((ax1, "load added over a local hit", "ms"), (ax2, "rate", "GB/s"),
                            (ax3, "time to first token", "s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax3.set_yscale("log")
    cache = result["points"][0]["page_cache"].split(" (")[0]
    fig.suptitle(f"restore at conversation scale ({cache} page cache)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def table(result: dict) -> str:
    if result["bench"] == "restore_ttft_curve":
        return curve_table(result)
    m, arms = result["model"], result["arms"]
    rec = result["recompute"]["ttft_median_s"]
    lines = [f"model: {m['layers']}, hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']}/{m['num_kv_heads']} heads "
             f"of {m['head_dim']}, {m['dtype']}: {m['flops_per_token'] / 1e6:.0f} MFLOP/token "
             f"(+{m['attention_flops_per_token_at_prompt'] / 1e6:.0f} attention at this prompt), "
             f"{m['kv_bytes_per_token']} KV bytes/token, {m['flops_per_kv_byte']} FLOP per KV byte"
             + (f", {m['state_bytes_per_entry']} recurrent-state bytes per entry" if m["state_bytes_per_entry"] else ""),
             f"{result['prompts']} prompts of {result['prompt_tokens']} tokens, median of {result['reps']} "
             f"restarts x {result['prompts']} requests per arm",
             f"{'arm':<12}{'TTFT s':>9}{'min s':>9}{'1st s':>9}{'local s':>9}{'added s':>9}{'hooks s':>9}"
             f"{'cached':>8}{'vs recompute':>14}{'in page cache':>15}"]
    for arm, s in arms.items():
        lines.append(f"{arm:<12}{s['ttft_median_s']:>9.3f}{s['ttft_min_s']:>9.3f}"
                     f"{s['first_after_restart_median_s']:>9.3f}{s['local_ttft_median_s']:>9.3f}"
                     f"{s['restore_overhead_median_s']:>9.3f}"
                     + (f"{'-':>9}" if arm == "recompute" else f"{s['connector_median_s']:>9.3f}") +
                     f"{s['num_cached_tokens']:>8}"
                     f"{rec / s['ttft_median_s']:>13.2f}x{s['resident_fraction_range'][0]:>9.0%}-"
                     f"{s['resident_fraction_range'][1]:.0%}")
    if "recompute" not in arms:
        lines.append(f"recompute: {rec:.3f} s ({result['recompute']['source']})")
    r = result["restore_rate"]
    lines.append(f"sparkcache restore rate {r['gb_per_s']:.2f} GB/s ({r['restores']} restores, worker time), "
                 f"raw read of the same files {r['raw_read']['gb_per_s']:.2f} GB/s")
    for arm, note in result.get("notes", {}).items():
        lines.append(f"{arm}: {note}")
    lines.append(f"ratios: {result['ratios']}")
    lines.append(f"outputs: {result['outputs']}; targets: {result['targets']}")
    return "\n".join(lines)


def curve_table(result: dict) -> str:
    lines = [table(p) + "\n" for p in result["points"]]
    lines.append(f"{'tokens':>8}{'MB':>8}{'recompute s':>13}{'sc added ms':>13}{'ex added ms':>13}{'lm added ms':>13}"
                 f"{'sc GB/s':>9}{'ex GB/s':>9}{'lm GB/s':>9}{'restore GB/s':>14}{'raw GB/s':>10}{'sc<=ex pairs':>14}"
                 f"{'sc hooks ms':>13}{'ex hooks ms':>13}{'lm hooks ms':>13}{'hooks pairs':>13}")
    for r in result["curve"]:  # an arm a point did not run shows 0
        lines.append(f"{r['prompt_tokens']:>8}{r['restored_bytes_per_request'] / 1e6:>8.0f}{r['recompute_ttft_s']:>13.2f}"
                     + "".join(f"{r.get(f'{a}_load_added_s', 0) * 1e3:>13.1f}" for a in ("sparkcache", *PEER_ARMS))
                     + "".join(f"{r.get(f'{a}_load_gb_per_s') or 0:>9.2f}" for a in ("sparkcache", *PEER_ARMS))
                     + f"{r['restore_gb_per_s']:>14.2f}{r['raw_read_gb_per_s']:>10.2f}{r['pairs']!s:>14}"
                     + "".join(f"{r.get(f'{a}_connector_s', 0) * 1e3:>13.1f}" for a in ("sparkcache", *PEER_ARMS))
                     + f"{r['connector_pairs']!s:>13}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.restore_ttft", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--out", type=Path, default=REPO / "bench-out" / "restore_ttft.json")
    a("--prompt-tokens", type=_sizes, default=[2100], help="prompt size in tokens, or several, comma-separated "
      "(e.g. 2048,8192,32768,65536): one point each, and the curve (JSON and a PNG beside it)")
    a("--recompute-max-tokens", type=int, default=8192, help="sizes above this get no timed recompute life: "
      "their recompute TTFT is the sparkcache storing life's (a fresh engine computing the prompt); default 8192")
    a("--life-timeout", type=int, default=3600, help="seconds one engine life may take (default 3600)")
    a("--reps", type=int, default=3, help="timed fresh restarts per arm (median reported)")
    a("--prompts", type=int, default=4, help="distinct prompts, each restored once per timed life")
    a("--recompute-reps", type=int, default=1, help="rounds that include a timed life of the recompute arm "
      "(the first ones; default 1)")
    a("--check-tokens", type=int, default=8, help="greedy output tokens of the timed request, compared across arms")
    a("--model", choices=("bench", "tiny", "hybrid"), default="bench",
      help="bench: testing.tinymodel.BENCH (Llama); tiny: TINY; hybrid: BENCH_HYBRID (NemotronH, "
      "Mamba2 + attention; recompute and sparkcache only, ExampleConnector cannot load it)")
    a("--arms", type=_arm_list, default=None, help="comma-separated arms to run, sparkcache among them "
      f"(default: every arm of the model: {','.join(ARMS)}; hybrid: {','.join(HYBRID_ARMS)}), e.g. "
      "recompute,sparkcache,example to leave LMCache out")
    a("--dtype", default=None, help="override the model's dtype (default: the spec's)")
    a("--seed", type=int, default=0)
    a("--work-dir", default=None, help="where the stores live (default: the system temp dir)")
    a("--keep", action="store_true", help="keep the stores after the run")
    a("--kv-cache-gib", type=float, default=1.0, help="KV cache of every engine life, GiB (default 1; vLLM's "
      "CPU default, ~90%% of memory, evicts the stored files from the page cache at random)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cold", action="store_true", help="take the arm's stored files out of the page cache "
                       "right before each timed request, so both connectors read the stored KV from disk")
    cache.add_argument("--warm", action="store_true", help="read the arm's stored files once right before each "
                       "timed request, so both connectors read the stored KV from the page cache, as the "
                       "raw read it is compared with does (default: as the previous life left them)")
    a("--engine-life", default=None, help=argparse.SUPPRESS)
    return p


def _max_prompt_tokens(model: str) -> int:
    from testing.tinymodel import BENCH, BENCH_HYBRID, TINY

    return {"bench": BENCH, "tiny": TINY, "hybrid": BENCH_HYBRID}[model].max_position_embeddings - 64


def _arm_list(text: str) -> list[str]:
    arms = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"{text!r}: arms are {','.join(ARMS)}, comma-separated")
    return arms


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts, comma-separated (e.g. 2048,8192)")
    if not sizes or sizes[0] < 64:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 64 tokens")
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.engine_life:
        result = _engine_life(load_cfg(args.engine_life))
        print(RESULT_MARKER + json.dumps(result), flush=True)
        os._exit(0)  # do not wait for the engine's stray threads
    if args.reps < 1 or args.prompts < 1 or not 1 <= args.recompute_reps <= args.reps:
        raise SystemExit(f"--reps {args.reps} / --prompts {args.prompts} / --recompute-reps {args.recompute_reps}: "
                         "need >= 1, >= 1 and 1..--reps")
    chosen_arms(args.arms, args.model)  # before any life runs: a wrong --arms says so now
    limit = _max_prompt_tokens(args.model)
    if max(args.prompt_tokens) > limit:  # before any size runs: a curve takes hours
        raise SystemExit(f"--prompt-tokens {max(args.prompt_tokens)}: the {args.model} model takes at most "
                         f"{limit} (its max_position_embeddings less 64 for the output); pick smaller sizes")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.out}")
    if result["bench"] == "restore_ttft_curve":
        png = plot(result, args.out.with_suffix(".png"))
        print(f"wrote {png}" if png else "matplotlib not installed: no PNG")
    points = result.get("points", [result])
    if not all(p["outputs"]["each_arm_consistent"] and p["outputs"].get("restore_arms_identical", True)
               for p in points):
        print("FAIL: greedy outputs of a prompt differ between the lives of one arm or between the restore arms",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
