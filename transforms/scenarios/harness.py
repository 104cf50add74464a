"""Drive vLLM 0.32.0's real Scheduler in-process with synthetic model outputs.

The scheduler, the KV cache manager, the block pool and the hybrid
coordinator are vLLM's own (pristine or transformed, whichever ``vllm`` is
first on ``sys.path``). Only the model is synthetic: every scheduled request
samples ``token_id`` each step. The KV connector is :class:`ProbeConnector`,
a real ``KVConnectorBase_V1`` + ``SupportsHMA`` plugin whose scheduler side
answers from a token-prefix "store" the scenario controls.
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


def make_hybrid_scheduler(
    num_blocks: int = 100,
    block_size: int = BLOCK_SIZE,
    extra_config: dict[str, Any] | None = None,
    retention_interval: int | None = 0,
    with_connector: bool = True,
    max_model_len: int = 65536,
    max_num_batched_tokens: int = 8192,
):
    """Full attention + Mamba ("align") hybrid Scheduler, production retention (0) by default."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=tiny_model_config_dir(), dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len
    )
    kv_transfer_config = None
    if with_connector:
        kv_transfer_config = KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path="transforms.scenarios.harness",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config or {}),
        )
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
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align"),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attn"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"),
            ),
        ],
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


def make_request(request_id: str, prompt: list[int], max_tokens: int, block_size: int = BLOCK_SIZE):
    """A vLLM Request with real block hashes (sha256 chain) for prefix caching."""
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
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def step(
    scheduler,
    token_id: int = 7,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    on_scheduled=None,
):
    """One scheduler step with a synthetic model: every request that reaches its end samples token_id.

    on_scheduled(output) runs between schedule() and update_from_output(), while
    per-request prefill stats are still on the requests.
    """
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    if on_scheduled is not None:
        on_scheduled(out)
    req_ids = list(out.num_scheduled_tokens)
    # schedule() has already advanced num_computed_tokens by this step's chunk. A request
    # whose chunk does not reach its last known token is mid-prefill and samples nothing.
    sampled = [
        [token_id] if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens else []
        for rid in req_ids
    ]
    sending, recving = set(finished_sending), set(finished_recving)
    kv_out = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None) if (sending or recving) else None
    runner_out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )
    scheduler.update_from_output(out, runner_out)
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
    coordinator = scheduler.kv_cache_manager.coordinator
    _, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
    return tuple(hits)


def first_schedule_hit(scheduler, request, token_id: int = 7) -> dict:
    """Admit request for one step; its local and external hit as vLLM's own prefill stats record them."""
    seen: dict = {}

    def read_stats(out) -> None:
        stats = request.prefill_stats
        new = {r.req_id: r for r in out.scheduled_new_reqs}
        seen["num_computed_tokens"] = new[request.request_id].num_computed_tokens if request.request_id in new else None
        seen["local"] = getattr(stats, "num_local_cached_tokens", None)
        seen["external"] = getattr(stats, "num_external_cached_tokens", None)

    scheduler.add_request(request)
    step(scheduler, token_id, on_scheduled=read_stats)
    return seen


def option_readings(configs: list[dict[str, Any]], read: Callable[[Any], Any], **kwargs: Any) -> dict:
    """How the Scheduler reads a transform's options: built once per ``configs`` entry (added to
    kv_connector_extra_config), each reading is ``{"error": str | None, "read": read(scheduler)}``.

    First a Scheduler without any of the options: on the transformed tree it must not import
    sparkcache (the injected code imports ``sparkcache.settings`` only for a key that is present).
    """
    import sys

    def reading(extra: dict[str, Any]) -> dict[str, Any]:
        try:
            scheduler = make_hybrid_scheduler(extra_config=extra, **kwargs)
        except ValueError as exc:
            return {"error": str(exc), "read": None}
        return {"error": None, "read": read(scheduler)}

    # Another scenario in this interpreter may have imported it already: take it out of
    # sys.modules, so that only an import by this Scheduler puts it back.
    earlier = sys.modules.pop("sparkcache.settings", None)
    absent = reading({})
    imported = "sparkcache.settings" in sys.modules
    if earlier is not None and not imported:
        sys.modules["sparkcache.settings"] = earlier
    return {
        "absent": absent,
        "sparkcache_imported_without_options": imported,
        "readings": [reading(extra) for extra in configs],
    }


# --------------------------------------------------------------------------
# ProbeConnector: a real vLLM KV connector plugin for scheduler scenarios.
# --------------------------------------------------------------------------


def _connector_base():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    return KVConnectorBase_V1, SupportsHMA


def __getattr__(name: str):
    # Built lazily so that importing this module does not import vLLM.
    if name == "ProbeConnector":
        cls = _build_probe_connector()
        globals()["ProbeConnector"] = cls
        return cls
    raise AttributeError(name)


def _build_probe_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    KVConnectorBase_V1, SupportsHMA = _connector_base()

    class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
        """Scheduler-side connector whose store holds whatever token prefixes the scenario puts there.

        extra config:
          probe_delay_free (bool): hold a finished request's blocks until the
            scenario reports finished_sending (as an asynchronous capture does).
          probe_divergent (bool): supports_divergent_local_hybrid_hits.
        """

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = self._kv_transfer_config.kv_connector_extra_config or {}
            self.delay_free = bool(extra.get("probe_delay_free", False))
            self.divergent = bool(extra.get("probe_divergent", False))
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
            return ext, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            return self.delay_free, None

        def request_finished_all_groups(self, request, block_ids):
            return self.delay_free, None

        # Worker side is never used in scheduler scenarios.
        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    return ProbeConnector
