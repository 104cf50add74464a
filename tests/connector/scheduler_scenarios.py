"""Scenarios that drive vLLM 0.32.0's real Scheduler (hybrid full attention + Mamba "align",
retention 0) with sparkcache's real connector (scheduler side) and synthetic model outputs.

The store is a real PageStore on disk; the worker's reports (finished_recving,
failed_recving) are synthetic, like the model's sampled tokens (``testing.vllm_scheduler``).
Import only inside a process that may import vLLM.
"""

from __future__ import annotations

from typing import Iterable

from testing.vllm_scheduler import BLOCK_SIZE as BS
from testing.vllm_scheduler import make_request as request  # noqa: F401 (the tests' request factory)
from testing.vllm_scheduler import sparkcache_connector
from testing.vllm_scheduler import make_scheduler as make_vllm_scheduler
from testing.vllm_scheduler import step as vllm_step


def make_scheduler(root: str, num_blocks: int = 200, max_num_batched_tokens: int = 8192,
                   extra: dict | None = None, hybrid: bool = True, tensor_parallel_size: int = 1,
                   model: str | None = None, data_parallel_size: int = 1):
    settings = {"root": root, "min_span_tokens": BS,
                "weights_fingerprint": "scenario:config-only",  # a config directory, no weight files
                **(extra or {})}
    return make_vllm_scheduler(sparkcache_connector(settings), num_blocks=num_blocks, hybrid=hybrid,
                               max_model_len=8192, max_num_batched_tokens=max_num_batched_tokens,
                               tensor_parallel_size=tensor_parallel_size, model=model,
                               data_parallel_size=data_parallel_size)


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
    """``testing.vllm_scheduler.step`` with the worker's reports: ``recving``, ``failed`` (loads),
    ``sending`` (captures), ``settled`` (captures settled, published or skipped, in its worker meta).
    Returns the SchedulerOutput; the engine-core outputs are in ``scheduler.last_engine_outputs``."""
    from sparkcache.connector.connector import SparkcacheWorkerMetadata

    settled = list(settled)
    return vllm_step(scheduler, token_id, finished_sending=sending, finished_recving=recving,
                     failed_recving=failed,
                     kv_connector_worker_meta=SparkcacheWorkerMetadata(settled) if settled else None)


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
