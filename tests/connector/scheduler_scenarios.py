"""Scenarios that drive vLLM 0.32.0's real Scheduler (hybrid full attention + Mamba "align",
retention 0) with sparkcache's real connector (scheduler side) and synthetic model outputs.

The store is a real PageStore on disk; the worker's reports (finished_recving,
failed_recving) are synthetic, like the model's sampled tokens. Each ``run_*`` returns
plain data for the tests to assert on. Import only inside a process that may import vLLM.
"""

from __future__ import annotations

from typing import Any, Iterable

from testing.vllm_scheduler import make_request, tiny_model_config_dir

BS = 16


def make_scheduler(root: str, num_blocks: int = 200, max_num_batched_tokens: int = 8192,
                   extra: dict | None = None, hybrid: bool = True, tensor_parallel_size: int = 1):
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=tiny_model_config_dir(), dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=8192)
    kvt = KVTransferConfig(kv_connector="SparkcacheConnector", kv_connector_module_path="sparkcache.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"root": root, "min_span_tokens": BS,
                                                      # a config directory, no weight files
                                                      "weights_fingerprint": "scenario:config-only",
                                                      **(extra or {})})
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=8192, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, watermark=0.0),
        model_config=model_config,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True,
                                 mamba_cache_mode="align" if hybrid else "none"),
        kv_transfer_config=kvt,
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                           dtype=torch.float32))]
    if hybrid:
        groups.append(KVCacheGroupSpec(["mamba"], MambaSpec(block_size=BS, shapes=((1, 1),),
                                                            dtypes=(torch.float32,), mamba_cache_mode="align")))
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=0)
    register_all_kvcache_specs(vllm_config)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BS, hash_block_size=BS, log_stats=True)


def store_prefix(scheduler, tokens: list[int], ranks: Iterable[int] | None = None) -> int:
    """Publish the whole blocks of ``tokens`` into the connector's store as every rank's
    worker would (``ranks``: only these ranks' shards; page and state bytes are irrelevant to
    the scheduler side; a hybrid layout's entry carries a state, as its worker publishes it).
    Returns the stored tokens."""
    from sparkcache.connector.keys import BlockKeys

    side = scheduler.connector._sched
    n = len(tokens) // BS
    keys = BlockKeys(BS).upto(tokens, n)
    bpp = side.bpp
    pages = [bytes([p % 251]) * 64 for p in range(-(-n // bpp))]
    state = b"\x00" * 8 if side.hybrid else None
    for rank in range(len(side.identities)) if ranks is None else ranks:
        assert side.stores[rank].publish(side.identities[rank], keys, pages, state=state).ok
    return n * BS


def step(scheduler, recving: Iterable[str] = (), failed: Iterable[str] = (), sending: Iterable[str] = (),
         token_id: int = 7, settled: Iterable[str] = ()):
    """One schedule + synthetic model output; ``settled``: captures the worker reports settled
    (published or skipped) in its worker meta. Returns the SchedulerOutput; the engine-core
    outputs (with the step's stats) are in ``scheduler.last_engine_outputs``."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from sparkcache.connector.connector import SparkcacheWorkerMetadata

    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        # schedule() has already advanced num_computed_tokens by this step's tokens
        req = scheduler.requests[rid]
        sampled.append([token_id] if req.num_computed_tokens >= req.num_tokens else [])
    recving, failed, sending = set(recving), set(failed), set(sending)
    settled = list(settled)
    kv_out = None
    if recving or failed or sending or settled:
        kv_out = KVConnectorOutput(finished_sending=sending or None, finished_recving=(recving | failed) or None,
                                   failed_recving=failed,
                                   kv_connector_worker_meta=SparkcacheWorkerMetadata(settled) if settled else None)
    scheduler.last_engine_outputs = scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
        logprobs=None, prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out))
    return out


def finish_all(scheduler, max_steps: int = 2000, pending_sends: bool = True) -> None:
    """Step until nothing is left; delayed frees (captures) are reported done each step."""
    for _ in range(max_steps):
        sending = set(scheduler.connector._sched.awaiting_send) if pending_sends else set()
        if not scheduler.requests and not sending:
            return
        step(scheduler, sending=sending)
    raise RuntimeError("scheduler did not drain")


def record_of(scheduler, request_id: str) -> dict:
    for rec in scheduler.connector._sched.records:
        if rec.request_id == request_id:
            return rec.public()
    raise KeyError(request_id)


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Any:
    return make_request(rid, prompt, max_tokens, block_size=BS)
