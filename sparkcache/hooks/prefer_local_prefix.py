"""prefer_local_prefix: never reload attention pages that are already resident.

vLLM 0.32.0 asks the KV connector only beyond the hybrid local hit (the depth every KV-cache
group agrees on). On a hybrid full-attention + Mamba ("align") model whose recurrent group is
shallow, a store holding the conversation then claims everything past that depth and vLLM
reloads resident attention pages into fresh duplicate blocks; upstream's divergent-hit path
recomputes when the store ends exactly at the local attention depth (a tie). The reasoning is in
transforms/prefer_local_prefix.py; the cases, both trees, in tests/transforms/test_prefer_local_prefix.py.

``LocalPrefixFirst`` is what the transformed scheduler calls when the option is true:
``local_hit`` is the lookup at the full-attention depth, ``ask_connector`` replaces the
scheduler's ``get_num_new_matched_tokens`` call for a block-aligned local hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

KEY = "sparkcache_prefer_local_prefix"


class LocalPrefixFirst:
    """A scheduler's longer-local-prefix preference (attach with ``attach``)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    @classmethod
    def attach(cls, scheduler: Scheduler) -> LocalPrefixFirst | None:
        """The option parsed by sparkcache's settings table (JSON true/false only, as the
        connector reads it): an instance when true, None (upstream behaviour) when false."""
        from sparkcache.settings import transform_option

        config = scheduler.vllm_config.kv_transfer_config
        on = transform_option(config.kv_connector_extra_config if config is not None else None, KEY)
        return cls(scheduler) if on else None

    def local_hit(self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit at the full-attention depth: (blocks, tokens, shared prefix boundary,
        hit diverged).

        Upstream's ``get_computed_blocks_for_connector``, with one change: when a lagging group
        (Mamba) kept a checkpoint deeper than the resident attention, upstream falls back to the
        reconciled hybrid depth without flagging divergence, and the resident attention blocks
        between the two would be asked from (and reloaded by) the store. That case is reported
        as a divergent hit too: attention at its own depth, every deeper group at the reconciled
        depth. One per-group lookup; the reconciled lookup runs only in that lagging-deeper case
        (as upstream's does)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        manager = self._scheduler.kv_cache_manager
        coordinator = manager.coordinator
        attention_group = getattr(coordinator, "full_attention_group_id", None)
        if (
            attention_group is None
            or not manager.kv_cache_config.has_mamba_layers
            or not manager.prefix_cache_lookup_enabled(request)
        ):
            return manager.get_computed_blocks_for_connector(request)
        per_group_blocks, per_group_hits = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1)
        num_attention = per_group_hits[attention_group]
        deeper = [hit_len > num_attention for hit_len in per_group_hits]
        if not any(deeper):
            # Per-group lookups do not detect an uncached shared prefix (boundary 0).
            blocks = manager.create_kv_cache_blocks(per_group_blocks)
            return blocks, num_attention, 0, min(per_group_hits) < num_attention
        reconciled = manager.get_computed_blocks(request)
        reconciled_blocks, num_reconciled, _ = reconciled
        groups = manager.kv_cache_config.kv_cache_groups
        if num_attention <= num_reconciled or any(
            is_deeper and not isinstance(groups[gid].kv_cache_spec, MambaSpec)
            for gid, is_deeper in enumerate(deeper)
        ):
            return *reconciled, False
        merged = tuple(
            reconciled_blocks.blocks[gid] if is_deeper else per_group_blocks[gid]
            for gid, is_deeper in enumerate(deeper)
        )
        return manager.create_kv_cache_blocks(merged), num_attention, 0, True

    def ask_connector(self, request: Request, blocks: KVCacheBlocks, num_local: int,
                      hit_diverged: bool) -> tuple[KVCacheBlocks, int, int | None, bool, bool]:
        """A longer local prefix beats the store: (blocks, num_local, external tokens or None,
        load_kv_async, hit_diverged).

        blocks/num_local: the block-aligned local hit at the full-attention depth L; hit_diverged:
        the recurrent group stops shallower. The connector's last get_num_new_matched_tokens call
        is made at the returned num_local (upstream re-asks a waiting request on every scheduling
        attempt, so the last call is the authoritative one).

        - Not diverged: ask at the local depth, as upstream does.
        - Diverged: ask at the hybrid depth H to learn where the store ends (S).
          S > L: local L, load only (L, S].
          H < S <= L (a tie or a shorter store): local S - block_size with its resident attention
          blocks; load the last block and the recurrent state at S (vLLM 0.32.0 cannot express a
          state-only, zero-token load).
          S <= H: the hybrid hit, nothing external.
        An external claim not past the local hit is clamped to 0, no async wait."""
        scheduler = self._scheduler
        connector = scheduler.connector
        assert connector is not None
        if not hit_diverged:
            ext, load_async = connector.get_num_new_matched_tokens(request, num_local)
            if ext is not None and ext <= 0:
                ext, load_async = 0, False
            return blocks, num_local, ext, load_async, hit_diverged

        hybrid_blocks, num_hybrid, boundary = scheduler.kv_cache_manager.get_computed_blocks(request)

        def at_hybrid_depth(ext: int, load_async: bool) -> tuple[KVCacheBlocks, int, int, bool, bool]:
            """Resume where every group agrees (upstream's hybrid hit)."""
            request.shared_prefix_boundary = boundary
            return hybrid_blocks, num_hybrid, ext, load_async, False

        undecided = (blocks, num_local, None, False, hit_diverged)  # the connector cannot tell yet
        ext_h, load_async_h = connector.get_num_new_matched_tokens(request, num_hybrid)
        if ext_h is None:
            return undecided
        if ext_h <= 0:
            return at_hybrid_depth(0, False)
        store_end = num_hybrid + ext_h
        store_end -= store_end % scheduler.block_size
        if store_end > num_local:
            resume_local = num_local
        else:
            resume_local = max(num_hybrid, store_end - scheduler.block_size)
        if resume_local == num_hybrid:
            return at_hybrid_depth(ext_h, load_async_h)  # the store's load starts there: no re-ask
        ext, load_async = connector.get_num_new_matched_tokens(request, resume_local)
        if ext is None:
            return undecided
        if ext <= 0:
            return at_hybrid_depth(0, False)  # the connector no longer backs the deeper boundary
        if resume_local < num_local:
            blocks = scheduler.kv_cache_manager.truncate_computed_blocks(blocks, resume_local)
        return blocks, resume_local, ext, load_async, hit_diverged
