"""vLLM 0.32.0's real Scheduler in-process, with a synthetic model: the one factory, request and step
that the scheduler scenarios (``testing.scenarios``), the connector's scheduler tests
(``tests/connector/test_*_scheduler.py``) and Replay A (``bench/replay_a_sim.py``) drive it with.

The scheduler, the KV cache manager, the block pool and the hybrid coordinator are vLLM's own
(pristine or transformed, whichever ``vllm`` is first on ``sys.path``). Only the model is
synthetic: :func:`step` samples one token for every scheduled request whose chunk reaches its end
(``token_id``, or what ``sample`` picks), and reports whatever the caller says the workers
finished. The KV connector is any plugin (:func:`make_scheduler`'s ``kv_transfer``):
:func:`probe_connector` (:class:`ProbeConnector`, whose scheduler side answers from a token-prefix
"store" the caller fills) or :func:`sparkcache_connector` (sparkcache's real connector).

Import only inside a process that may import vLLM (nothing here imports it at module level).
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable

BLOCK_SIZE = 16

_TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


@lru_cache(maxsize=1)
def tiny_model_config_dir() -> str:
    """A local HF config directory (no weights, no tokenizer) for ModelConfig."""
    path = Path(tempfile.mkdtemp(prefix="sparkcache-tiny-config-"))
    (path / "config.json").write_text(json.dumps(_TINY_LLAMA_CONFIG))
    return str(path)


def probe_connector(extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``kv_transfer`` for :class:`ProbeConnector` (its keys: ``probe_delay_free``, ``probe_divergent``,
    ``probe_async_load``, and any transform option)."""
    return {
        "kv_connector": "ProbeConnector",
        "kv_connector_module_path": "testing.vllm_scheduler",
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra_config or {}),
    }


def sparkcache_connector(extra_config: dict[str, Any]) -> dict[str, Any]:
    """``kv_transfer`` for sparkcache's real connector (a failed load is recomputed)."""
    return {
        "kv_connector": "SparkcacheConnector",
        "kv_connector_module_path": "sparkcache.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra_config),
    }


def make_scheduler(
    kv_transfer: dict[str, Any] | None,
    *,
    num_blocks: int = 100,
    block_size: int = BLOCK_SIZE,
    hybrid: bool = True,
    retention_interval: int | None = 0,
    max_model_len: int = 65536,
    max_num_batched_tokens: int = 8192,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    kv_cache_config: Any = None,
    speculative: dict[str, Any] | None = None,
    model: str | None = None,
):
    """vLLM's Scheduler over ``num_blocks`` blocks: full attention, plus a Mamba ("align") group
    when ``hybrid``; ``retention_interval`` 0 is production's prefix-cache retention (None: dense).
    ``kv_transfer``: ``KVTransferConfig`` fields (:func:`probe_connector`, :func:`sparkcache_connector`),
    None for no connector. ``kv_cache_config``: instead of those groups, the scheduler's
    ``KVCacheConfig`` vLLM built for a real model (``testing.field_layouts``), whose block size
    and block count then win. ``speculative``: ``SpeculativeConfig`` fields with the ``model``
    directory of the target whose drafter it configures (a field recipe's model: ``{"model":
    ..., "method": "mtp", "num_speculative_tokens": 1}``); the scheduler's own model config
    stays the tiny one (a GLM model config would make the CPU platform change the cache).
    ``model``: another model directory for the scheduler's model config (a multimodal model
    gives the scheduler its encoder budget; its process needs ``import torchvision``:
    ``testing.torchvision_shim.install_for_vllm``)."""
    import torch
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if kv_cache_config is not None:
        num_blocks = int(kv_cache_config.num_blocks)
        block_size = int(kv_cache_config.hash_block_size)
    model_config = ModelConfig(
        model=model or tiny_model_config_dir(), dtype="float32", seed=0, skip_tokenizer_init=model is None,
        max_model_len=max_model_len
    )
    parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
    drafter = None
    if speculative is not None:
        spec = dict(speculative)
        target = ModelConfig(model=spec.pop("model"), seed=0, skip_tokenizer_init=True, max_model_len=max_model_len)
        drafter = SpeculativeConfig(**spec, target_model_config=target, target_parallel_config=parallel_config)
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align" if hybrid else "none"
        ),
        kv_transfer_config=None if kv_transfer is None else KVTransferConfig(**kv_transfer),
        parallel_config=parallel_config,
        speculative_config=drafter,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    groups = [
        KVCacheGroupSpec(
            ["attn"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        )
    ]
    if hybrid:
        groups.append(
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"),
            )
        )
    if kv_cache_config is None:
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention_interval,
        )
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=True,
    )


_hasher_ready = False


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 3,
    block_size: int = BLOCK_SIZE,
    *,
    mm_features: list | None = None,
    prompt_embeds: Any = None,
):
    """A vLLM Request with real block hashes (sha256 chain) for prefix caching; greedy to
    ``max_tokens`` (no EOS). ``mm_features``, ``prompt_embeds``: as vLLM's Request takes them."""
    global _hasher_ready
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _hasher_ready:
        init_none_hash(sha256)
        _hasher_ready = True
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    params.update_from_generation_config({}, 2)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        mm_features=mm_features,
        prompt_embeds=prompt_embeds,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def step(
    scheduler,
    token_id: int = 7,
    *,
    sample: Callable[[Any], int | list[int]] | None = None,
    on_scheduled: Callable[[Any], dict | None] | None = None,
    drafts: Callable[[Any], list[int]] | None = None,
    finished_sending: Iterable[str] | None = (),
    finished_recving: Iterable[str] | None = (),
    failed_recving: Iterable[str] | None = (),
    invalid_block_ids: Iterable[int] | None = (),
    kv_connector_worker_meta: Any = None,
):
    """One ``schedule()`` and ``update_from_output()`` with a synthetic model output.

    Every scheduled request whose chunk reaches its last known token samples one token:
    ``sample(request)`` if given, else ``token_id``; a request mid-prefill samples nothing. With
    draft tokens scheduled (speculative decoding), ``sample`` may return a list: the accepted
    drafts and the token after them, as a model runner's rejection sampler does. After the
    update, ``drafts(request)`` (if given) proposes each running request's next draft tokens
    (``Scheduler.update_draft_token_ids``, as the drafter's output reaches it).
    The workers' report (a ``KVConnectorOutput``, only when something is reported) carries
    ``finished_sending``, ``finished_recving`` (with ``failed_recving`` added: a failed load is
    finished too), ``failed_recving``, ``invalid_block_ids`` and ``kv_connector_worker_meta``.

    ``on_scheduled(output)`` runs between the two, while per-request prefill stats are still on
    the requests; a dict it returns replaces those report fields. Returns the SchedulerOutput;
    the engine-core outputs (with the step's stats) are left in ``scheduler.last_engine_outputs``.
    """
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    report = {
        "finished_sending": finished_sending,
        "finished_recving": finished_recving,
        "failed_recving": failed_recving,
        "invalid_block_ids": invalid_block_ids,
        "kv_connector_worker_meta": kv_connector_worker_meta,
    }
    if on_scheduled is not None:
        report.update(on_scheduled(out) or {})
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        # schedule() has already advanced num_computed_tokens by this step's chunk. A request
        # whose chunk does not reach its last known token is mid-prefill and samples nothing.
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        token = token_id if sample is None else sample(req)
        sampled.append((token if isinstance(token, list) else [token]) if done else [])
    sending, recving, failed, invalid = (
        set(report[k] or ()) for k in ("finished_sending", "finished_recving", "failed_recving", "invalid_block_ids")
    )
    meta = report["kv_connector_worker_meta"]
    kv_out = None
    if sending or recving or failed or invalid or meta is not None:
        kv_out = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=(recving | failed) or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=meta,
        )
    runner_out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )
    scheduler.last_engine_outputs = scheduler.update_from_output(out, runner_out)
    if drafts is not None:
        from vllm.v1.outputs import DraftTokenIds

        running = [r for r in req_ids if r in scheduler.requests and not scheduler.requests[r].is_finished()]
        scheduler.update_draft_token_ids(DraftTokenIds(running, [drafts(scheduler.requests[r]) for r in running]))
    return out


def run_to_completion(scheduler, request, token_id: int = 7, max_steps: int = 10_000) -> list:
    """Add request (if new) and step until it finishes; returns each step's SchedulerOutput."""
    from vllm.v1.request import RequestStatus

    outputs = []
    if request.request_id not in scheduler.requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        outputs.append(step(scheduler, token_id))
        if RequestStatus.is_finished(request.status):
            return outputs
    raise RuntimeError(f"request {request.request_id} did not finish in {max_steps} steps")


def per_group_hits(scheduler, request) -> tuple[int, ...]:
    """Each KV cache group's longest local hit for request's prompt (vLLM's coordinator)."""
    coordinator = scheduler.kv_cache_manager.coordinator
    _, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
    return tuple(hits)


def prefill_hit(request, out) -> dict:
    """request's hit in the SchedulerOutput ``out`` that admitted it, as vLLM's own prefill stats
    record it: read after ``schedule()``, before ``update_from_output`` consumes the stats."""
    stats = request.prefill_stats
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    return {
        "num_computed_tokens": new[request.request_id].num_computed_tokens if request.request_id in new else None,
        "local": getattr(stats, "num_local_cached_tokens", None),
        "external": getattr(stats, "num_external_cached_tokens", None),
    }


def admit(scheduler, request) -> dict:
    """Add request and schedule once, without a model output; its :func:`prefill_hit`."""
    scheduler.add_request(request)
    return prefill_hit(request, scheduler.schedule())


def first_schedule_hit(scheduler, request, token_id: int = 7) -> dict:
    """Add request and run one :func:`step`; its :func:`prefill_hit` in that step."""
    seen: dict = {}
    scheduler.add_request(request)
    step(scheduler, token_id, on_scheduled=lambda out: seen.update(prefill_hit(request, out)))
    return seen


# --------------------------------------------------------------------------
# KV connector plugins for scheduler-only runs.
# --------------------------------------------------------------------------


def lazy_attribute(namespace: dict[str, Any], name: str, build: Callable[[], object]) -> Callable[[str], object]:
    """A module ``__getattr__`` (PEP 562) that builds ``name`` on first use and keeps it in
    ``namespace``, so that importing the module does not import vLLM."""

    def module_getattr(attr: str) -> object:
        if attr != name:
            raise AttributeError(attr)
        value = namespace[name] = build()
        return value

    return module_getattr


__getattr__ = lazy_attribute(globals(), "ProbeConnector", lambda: _build_probe_connector())


@lru_cache(maxsize=1)
def scheduler_side_connector() -> type:
    """The base of a KV connector plugin for a scheduler-only run (``ProbeConnector``, Replay A's
    ``ReplayConnector``): empty metadata, and a worker side that is never called (no model runs).
    Subclasses answer the scheduler-side calls."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class SchedulerSideConnector(KVConnectorBase_V1, SupportsHMA):
        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    return SchedulerSideConnector


def _build_probe_connector():
    class ProbeConnector(scheduler_side_connector()):
        """Scheduler-side connector whose store holds whatever token prefixes the caller puts there.

        extra config:
          probe_delay_free (bool): hold a finished request's blocks until the
            caller reports finished_sending (as an asynchronous capture does).
          probe_divergent (bool): supports_divergent_local_hybrid_hits.
          probe_async_load (bool): loads are asynchronous (the request waits in
            WAITING_FOR_REMOTE_KVS until the caller reports finished_recving).
        """

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = self._kv_transfer_config.kv_connector_extra_config or {}
            self.delay_free = bool(extra.get("probe_delay_free", False))
            self.divergent = bool(extra.get("probe_divergent", False))
            self.async_load = bool(extra.get("probe_async_load", False))
            self.stored: list[tuple[int, ...]] = []
            self.block_size = vllm_config.cache_config.block_size
            self.queries: list[tuple[str, int, int]] = []  # (request id, local tokens, answered)

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return self.divergent

        def store_prefix(self, tokens: Iterable[int]) -> None:
            self.stored.append(tuple(tokens))

        def stored_prefix_tokens(self, request) -> int:
            prompt = tuple(request.prompt_token_ids)
            best = 0
            for seq in self.stored:
                n = 0
                for a, b in zip(seq, prompt):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            # Block-aligned, and never the whole prompt (the last token is recomputed).
            best = min(best, len(prompt) - 1)
            return best - best % self.block_size

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ext = max(0, self.stored_prefix_tokens(request) - num_computed_tokens)
            self.queries.append((request.request_id, num_computed_tokens, ext))
            return ext, self.async_load and ext > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def request_finished(self, request, block_ids):
            return self.delay_free, None

        def request_finished_all_groups(self, request, block_ids):
            return self.delay_free, None

    return ProbeConnector
