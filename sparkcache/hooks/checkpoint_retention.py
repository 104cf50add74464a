"""checkpoint_retention: keep the newest block-aligned recurrent state reached in decode.

With production retention (``prefix_cache_retention_interval`` 0) vLLM 0.32.0 hashes no Mamba
align state past the prompt's replay boundary, so the next turn's hybrid local hit stops at the
previous prompt's last block boundary even when the new prompt repeats the previous reply
(transforms/checkpoint_retention.py has the measurement and the worker's copy rule).

The only safe moment to hash a decode state is the ``cache_blocks`` call of the step that ends
exactly on its boundary, while the request still holds the block: ``DecodeCheckpoints.boundary``
names that boundary, the manager adds it to the boundaries it hashes, and ``keep`` records the
state hashed (dropping the one it supersedes when opted in). ``forget`` evicts the hash of a
state whose step never ran (the request was preempted in the same scheduling pass).

``keep_preempted`` hashes a preempted request's running state, when it ends on a hit-aligned
block boundary, before its blocks go back to the pool: the request resumes locally where it was
stopped (its attention blocks keep their hashes anyway), not from its last retained boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.request import Request

RETAIN_KEY = "sparkcache_retain_decode_checkpoint"
DROP_KEY = "sparkcache_drop_superseded_checkpoint"


def enable_decode_checkpoints(scheduler: Scheduler) -> None:
    """Read both keys (sparkcache's settings table, as the connector reads them) and give each
    align-mode Mamba manager without speculative blocks its ``DecodeCheckpoints``."""
    from sparkcache.settings import transform_option

    config = scheduler.vllm_config.kv_transfer_config
    extra = config.kv_connector_extra_config if config is not None else None
    retain = transform_option(extra, RETAIN_KEY)
    drop = transform_option(extra, DROP_KEY)
    if not retain:
        return
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if not hasattr(manager, "sparkcache_decode_checkpoints"):
            continue  # not a Mamba manager
        if manager.mamba_cache_mode == "align" and manager.num_speculative_blocks == 0:
            # Speculative blocks relocate the running state: not covered.
            manager.sparkcache_decode_checkpoints = DecodeCheckpoints(manager, drop_superseded=drop)


class DecodeCheckpoints:
    """One Mamba manager's kept decode states: request id -> (request, boundary, block, hash)."""

    def __init__(self, manager: MambaManager, *, drop_superseded: bool) -> None:
        self._manager = manager
        self.drop_superseded = drop_superseded
        self._kept: dict[str, tuple[Request, int, KVCacheBlock, BlockHashWithGroupId]] = {}

    def boundary(self, request: Request, num_tokens: int, retention_interval: int | None,
                 replay_boundaries: Sequence[int]) -> int | None:
        """The boundary this step's running state lands on, if it must be kept: only a step that
        ends exactly on a hit-aligned block boundary at or past the prompt's end leaves the state
        at that boundary in the block for it (the running block, cdiv(num_tokens, block_size) - 1),
        and only when upstream's (sparse) retention would not keep it anyway."""
        manager = self._manager
        if retention_interval is None:
            return None  # dense retention hashes every state already
        alignment = manager.cache_hit_alignment_tokens or manager.block_size
        if (
            num_tokens <= 0
            or num_tokens % manager.block_size != 0
            or num_tokens % alignment != 0
            or num_tokens < request.num_prompt_tokens
            or num_tokens <= request.num_computed_tokens
        ):
            return None
        block_idx = num_tokens // manager.block_size - 1
        blocks = manager.req_to_blocks.get(request.request_id, [])
        if block_idx != len(blocks) - 1 or blocks[block_idx].is_null:
            return None  # not this step's running state block
        if manager.num_cached_block.get(request.request_id, 0) > block_idx:
            return None
        upstream = manager.reachable_block_mask(
            block_idx,
            block_idx + 1,
            manager.cache_hit_alignment_tokens,
            manager.kv_cache_spec,
            manager.use_eagle,
            retention_interval=retention_interval,
            reachable_boundaries=[
                *replay_boundaries,
                *([request.shared_prefix_boundary] if request.shared_prefix_boundary else []),
            ],
            dcp_world_size=manager.dcp_world_size,
        )
        if upstream is None or upstream[0]:
            return None  # upstream's retention keeps it; not ours to track or drop
        return num_tokens

    def keep_preempted(self, request: Request) -> None:
        """Before the pool takes a preempted request's blocks back: hash its running state if it
        ends on a hit-aligned block boundary. The step that ended at ``num_computed_tokens`` left
        the state in block ``num_computed_tokens // block_size - 1`` (a step scheduled in the
        same pass never runs), and no later step writes that block."""
        manager = self._manager
        tokens = request.num_computed_tokens
        alignment = manager.cache_hit_alignment_tokens or manager.block_size
        if tokens <= 0 or tokens % manager.block_size != 0 or tokens % alignment != 0:
            return
        block_idx = tokens // manager.block_size - 1
        blocks = manager.req_to_blocks.get(request.request_id, [])
        if block_idx >= len(blocks) or blocks[block_idx].is_null or blocks[block_idx].block_hash is not None:
            return
        if len(request.block_hashes) * manager.block_pool.hash_block_size < tokens:
            return  # no hash for that prefix yet
        manager.block_pool.cache_full_blocks(
            request=request,
            blocks=blocks,
            num_cached_blocks=block_idx,
            num_full_blocks=block_idx + 1,
            block_size=manager.block_size,
            kv_cache_group_id=manager.kv_cache_group_id,
        )
        if blocks[block_idx].block_hash is not None:
            # Like upstream's own hashing: no hit on it before the next step.
            manager.cached_blocks_this_step.add(blocks[block_idx].block_hash)

    def keep(self, request: Request, boundary: int) -> None:
        """After cache_blocks: record the decode state just hashed; drop the one it supersedes
        if opted in (only if that block still carries the hash this gave it)."""
        manager = self._manager
        block = manager.req_to_blocks[request.request_id][boundary // manager.block_size - 1]
        if block.block_hash is None or block.block_hash_num_tokens != boundary:
            return
        previous = self._kept.get(request.request_id)
        self._kept[request.request_id] = (request, boundary, block, block.block_hash)
        if previous is not None and self.drop_superseded:
            _, _, old_block, old_hash = previous
            if old_block is not block and old_block.block_hash == old_hash:
                manager.block_pool._maybe_evict_cached_block(old_block)

    def forget(self, request_id: str) -> None:
        """On free: a state hashed for a step that never ran (preempted in the same scheduling
        pass) does not hold the state at its boundary; evict its hash."""
        kept = self._kept.pop(request_id, None)
        if kept is None:
            return
        request, boundary, block, block_hash = kept
        if request.num_computed_tokens < boundary and block.block_hash == block_hash:
            self._manager.block_pool._maybe_evict_cached_block(block)
