"""lease_accounting: a deadline on every delayed free, and the recurrent checkpoints held with it.

Upstream vLLM 0.32.0 lets a connector delay a finished request's free (``request_finished``
returns True) until its ``finished_sending``, with no deadline: a lost report leaks the blocks
and keeps the engine busy, a late one trips an assert, and usage metrics cannot tell held
blocks from running ones. Align-mode Mamba also retires the prompt's recurrent checkpoint on
the first decode step (of the synchronous scheduler) while the attention blocks stay held, so
when they are freed it sits ahead of them in the LRU free queue and is evicted first
(tests/transforms/test_lease_accounting.py asserts the positions).

With ``sparkcache_gpu_lease_seconds`` set, ``GpuLeases`` turns every free the KV connector
delays into a lease that ends at ``finished_sending`` or at its deadline, re-references the
request's retired but still cached checkpoints (``RetiredCheckpoints``, one per Mamba manager)
and frees them after the request's own blocks. A request aborted while its asynchronous load is
in flight is never leased: the worker may write its blocks until ``finished_recving``, so they
stay held until then, as upstream holds them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

KEY = "sparkcache_gpu_lease_seconds"
logger = logging.getLogger("vllm.v1.core.sched.scheduler")


class RetiredCheckpoints:
    """A Mamba manager's retired blocks that kept their hash, per request, while leases are on."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[tuple[KVCacheBlock, BlockHashWithGroupId]]] = {}

    def record(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks the manager is about to free (ref -> 0) while the request runs."""
        hashed = [(b, b.block_hash) for b in blocks if b.block_hash is not None]
        if hashed:
            self._by_request.setdefault(request_id, []).extend(hashed)

    def take(self, request_id: str) -> list[KVCacheBlock]:
        """The request's retired blocks still cached under the hash they had, once each."""
        seen: set[int] = set()
        still_cached = []
        for block, block_hash in self._by_request.pop(request_id, ()):
            if block.block_hash == block_hash and block.block_id not in seen:
                seen.add(block.block_id)
                still_cached.append(block)
        return still_cached

    def forget(self, request_id: str) -> None:
        """A request freed without a lease (or preempted)."""
        self._by_request.pop(request_id, None)


class GpuLeases:
    """The scheduler's leases: request id -> (deadline, re-referenced checkpoints, blocks held).

    Insertion order is deadline order (one lease length, a monotonic clock)."""

    def __init__(self, scheduler: Scheduler) -> None:
        from sparkcache.settings import transform_option

        config = scheduler.vllm_config.kv_transfer_config
        self.seconds: float = transform_option(config.kv_connector_extra_config if config else None, KEY)
        self._scheduler = scheduler
        self._leases: dict[str, tuple[float, list[KVCacheBlock], int]] = {}
        self.expired = 0
        self.late_reports = 0
        self.now = time.monotonic  # the lease clock; a scenario may replace it
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            if hasattr(manager, "sparkcache_retired"):
                manager.sparkcache_retired = RetiredCheckpoints()

    @property
    def leased_blocks(self) -> int:
        """Blocks the leases hold (SchedulerStats.num_leased_blocks; part of kv_cache_usage)."""
        return sum(num_blocks for _, _, num_blocks in self._leases.values())

    def start(self, request: Request) -> None:
        """The KV connector delayed the finished request's free (no load in flight): lease its
        blocks and re-reference its retired checkpoints (ref_cnt += 1 takes one out of the free
        queue)."""
        manager = self._scheduler.kv_cache_manager
        checkpoints: list[KVCacheBlock] = []
        for single in manager.coordinator.single_type_managers:
            retired = getattr(single, "sparkcache_retired", None)
            if retired is not None:
                checkpoints.extend(retired.take(request.request_id))
        manager.block_pool.touch(checkpoints)
        own = {block.block_id for blocks in manager.coordinator.get_blocks(request.request_id)
               for block in blocks if not block.is_null}
        num_blocks = len(checkpoints) + len(own)
        self._leases[request.request_id] = (self.now() + self.seconds, checkpoints, num_blocks)

    def end(self, request: Request) -> None:
        """After the request's own blocks were freed: free its checkpoints, so they sit behind
        their attention blocks in the LRU free queue and are evicted after them."""
        lease = self._leases.pop(request.request_id, None)
        if lease is None:
            return
        _, checkpoints, _ = lease
        if not checkpoints:
            return
        scheduler = self._scheduler
        if scheduler._request_blocks_can_be_freed(request):
            scheduler.kv_cache_manager.block_pool.free_blocks(checkpoints)
        else:
            # Behind the request's own deferred blocks (drained reversed).
            scheduler.deferred_frees.append((scheduler.sched_step_seq, checkpoints[::-1]))

    def sweep(self) -> None:
        """Start of a scheduling step: release every lease past its deadline."""
        if not self._leases:
            return
        now = self.now()
        expired = []
        for request_id, (deadline, _, _) in self._leases.items():
            if deadline > now:
                break
            expired.append(request_id)
        for request_id in expired:
            self.expired += 1
            logger.warning(
                "sparkcache: GPU lease of request %s expired after %.3g s without "
                "finished_sending; freeing its blocks (a later report is ignored)",
                request_id, self.seconds)
            self._scheduler._free_blocks(self._scheduler.requests[request_id])

    def late_report(self, request_id: str) -> None:
        """A finished_sending for a request the scheduler no longer holds: counted, ignored."""
        self.late_reports += 1
        logger.debug("sparkcache: ignoring late finished_sending for %s", request_id)
