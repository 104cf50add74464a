"""prefer_local_prefix: never reload attention pages that are already resident.

vLLM 0.32.0 asks the KV connector only beyond the *hybrid* local hit (the
depth every KV-cache group agrees on). On a hybrid full-attention + Mamba
("align") model whose recurrent group is shallow, a store that holds the
conversation then claims everything past that depth, and vLLM allocates fresh
duplicate blocks for attention pages that are resident and reloads them
("served by restore"). Upstream's divergent-hit path
(``supports_divergent_local_hybrid_hits``) fixes the case where the store
reaches past the local attention depth, but a store that reaches exactly that
depth (a tie) falls back to the hybrid depth and recomputes.

Resolution of the tie (the recurrent state at the local attention depth L is
not resident; the store holds the conversation to L, state included):
vLLM 0.32.0's scheduler -> connector interface cannot express a zero-token,
state-only load (``update_state_after_alloc(..., 0)`` means "no load" to every
connector, an async wait asserts ``num_external_computed_tokens > 0``, and the
Mamba block at the resume position is freshly allocated and queued for
zeroing). So the transformed scheduler resumes at L with the attention blocks
below L - block_size taken locally and the last block (L - block_size, L]
loaded with the recurrent state at L: exactly one attention block is reloaded,
the smallest load vLLM can express that yields a valid state at L. A store that
reaches past L loads only the tokens past L (nothing resident is reloaded).

The local attention depth itself: upstream's per-group lookup
(``get_computed_blocks_for_connector``) reports it only when full attention is
the deepest group. When the tail of the attention blocks was evicted while a
deeper Mamba checkpoint survived, it returns the reconciled hybrid depth (often
0) without flagging divergence, and the store would be asked for, and reload,
the resident attention blocks below L. The transformed scheduler reports that
case as a divergent hit at L as well, with the deeper recurrent group cut back
to the reconciled depth.
"""

from __future__ import annotations

from transforms import Edit, Transform

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
KEY = "sparkcache_prefer_local_prefix"

_READ_OPTION = Edit(
    function="Scheduler.__init__",
    mode="insert_before",
    anchor="kv_transfer_config = self.vllm_config.kv_transfer_config",
    new='''
self.sparkcache_prefer_local_prefix = False  # sparkcache prefer_local_prefix (opt-in)
if self.vllm_config.kv_transfer_config is not None and (
    "sparkcache_prefer_local_prefix"
    in (self.vllm_config.kv_transfer_config.kv_connector_extra_config or {})
):
    # Parsed by sparkcache's settings table as the connector parses it (JSON
    # true/false only); with the key absent sparkcache is not imported.
    from sparkcache.settings import transform_option

    self.sparkcache_prefer_local_prefix = transform_option(
        self.vllm_config.kv_transfer_config.kv_connector_extra_config,
        "sparkcache_prefer_local_prefix",
    )
''',
)

_DIVERGENT_LOOKUP = Edit(
    function="Scheduler._get_local_prefix_cache_hit",
    mode="replace",
    anchor="""
if connector is not None and connector.supports_divergent_local_hybrid_hits:
    return self.kv_cache_manager.get_computed_blocks_for_connector(request)
""",
    new="""
# getattr: upstream tests call this method on a stand-in `self`.
if connector is not None and getattr(self, "sparkcache_prefer_local_prefix", False):
    return self._sparkcache_local_attention_hit(request)
if connector is not None and connector.supports_divergent_local_hybrid_hits:
    return self.kv_cache_manager.get_computed_blocks_for_connector(request)
""",
)

_ASK_CONNECTOR = Edit(
    function="Scheduler.schedule",
    mode="replace",
    anchor="""
ext_tokens, load_kv_async = (
    self.connector.get_num_new_matched_tokens(
        request, block_aligned_local
    )
)
""",
    new="""
if self.sparkcache_prefer_local_prefix and not partial_tail:
    # sparkcache prefer_local_prefix: ask only past the local attention depth.
    (
        new_computed_blocks,
        num_new_local_computed_tokens,
        ext_tokens,
        load_kv_async,
        hit_diverged,
    ) = self._sparkcache_prefer_local_prefix(
        request, new_computed_blocks, num_new_local_computed_tokens, hit_diverged
    )
else:
    ext_tokens, load_kv_async = (
        self.connector.get_num_new_matched_tokens(
            request, block_aligned_local
        )
    )
""",
)

_LOCAL_ATTENTION_HIT = Edit(
    function="Scheduler",
    mode="append_to_class",
    new='''
def _sparkcache_local_attention_hit(
    self, request: Request
) -> tuple[KVCacheBlocks, int, int, bool]:
    """sparkcache prefer_local_prefix: the local hit at the full-attention depth."""
    # Upstream's get_computed_blocks_for_connector, with one change: when a
    # lagging group (Mamba) kept a checkpoint deeper than the resident
    # attention, upstream falls back to the reconciled hybrid depth without
    # flagging divergence, and the resident attention blocks between the two
    # would be asked from (and reloaded by) the store. Report that case as a
    # divergent hit too: attention at its own depth, every deeper group at the
    # reconciled depth. One per-group lookup; the reconciled lookup only runs
    # in that lagging-deeper case (as upstream's does).
    manager = self.kv_cache_manager
    coordinator = manager.coordinator
    attention_group = getattr(coordinator, "full_attention_group_id", None)
    if (
        attention_group is None
        or not manager.kv_cache_config.has_mamba_layers
        or not manager.prefix_cache_lookup_enabled(request)
    ):
        return manager.get_computed_blocks_for_connector(request)
    per_group_blocks, per_group_hits = coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1
    )
    num_attention = per_group_hits[attention_group]
    deeper = [hit_len > num_attention for hit_len in per_group_hits]
    if not any(deeper):
        # Per-group lookups do not detect an uncached shared prefix (boundary 0).
        blocks = manager.create_kv_cache_blocks(per_group_blocks)
        return blocks, num_attention, 0, min(per_group_hits) < num_attention
    reconciled = manager.get_computed_blocks(request)
    blocks, num_reconciled, _ = reconciled
    groups = manager.kv_cache_config.kv_cache_groups
    if num_attention <= num_reconciled or any(
        is_deeper and not isinstance(groups[gid].kv_cache_spec, MambaSpec)
        for gid, is_deeper in enumerate(deeper)
    ):
        return *reconciled, False
    merged = tuple(
        blocks.blocks[gid] if is_deeper else per_group_blocks[gid]
        for gid, is_deeper in enumerate(deeper)
    )
    return manager.create_kv_cache_blocks(merged), num_attention, 0, True
''',
)

_HELPER = Edit(
    function="Scheduler",
    mode="append_to_class",
    new='''
def _sparkcache_prefer_local_prefix(
    self,
    request: Request,
    blocks: KVCacheBlocks,
    num_local: int,
    hit_diverged: bool,
) -> tuple[KVCacheBlocks, int, int | None, bool, bool]:
    """sparkcache prefer_local_prefix: a longer local prefix beats the store."""
    # blocks/num_local: the block-aligned local hit at the full-attention depth L
    # (get_computed_blocks_for_connector); hit_diverged: the recurrent group stops
    # shallower. Returns (blocks, num_local, external tokens or None,
    # load_kv_async, hit_diverged). The connector's last get_num_new_matched_tokens
    # call is made at the returned num_local (upstream re-asks a waiting request
    # on every scheduling attempt, so the last call is the authoritative one).
    # - Not diverged: ask at the local depth, as upstream does.
    # - Diverged: ask at the hybrid depth H to learn where the store ends (S).
    #   S > L: local L, load only (L, S].
    #   H < S <= L (a tie or a shorter store): local S - block_size with its
    #   resident attention blocks; load the last block and the recurrent state
    #   at S (vLLM 0.32.0 cannot express a state-only, zero-token load).
    #   S <= H: the hybrid hit, nothing external.
    # An external claim not past the local hit is clamped to 0, no async wait.
    connector = self.connector
    assert connector is not None
    if not hit_diverged:
        ext, load_async = connector.get_num_new_matched_tokens(request, num_local)
        if ext is not None and ext <= 0:
            ext, load_async = 0, False
        return blocks, num_local, ext, load_async, hit_diverged

    hybrid_blocks, num_hybrid, boundary = self.kv_cache_manager.get_computed_blocks(
        request
    )
    ext_h, load_async_h = connector.get_num_new_matched_tokens(request, num_hybrid)
    if ext_h is None:
        return blocks, num_local, None, False, hit_diverged
    if ext_h <= 0:
        request.shared_prefix_boundary = boundary
        return hybrid_blocks, num_hybrid, 0, False, False
    store_end = num_hybrid + ext_h
    store_end -= store_end % self.block_size
    if store_end > num_local:
        resume_local = num_local
    else:
        resume_local = max(num_hybrid, store_end - self.block_size)
    if resume_local == num_hybrid:
        # The store starts its load where every group agrees: no re-ask.
        request.shared_prefix_boundary = boundary
        return hybrid_blocks, num_hybrid, ext_h, load_async_h, False
    ext, load_async = connector.get_num_new_matched_tokens(request, resume_local)
    if ext is None:
        return blocks, num_local, None, False, hit_diverged
    if ext <= 0:
        # The connector no longer backs the deeper boundary: reconcile.
        request.shared_prefix_boundary = boundary
        return hybrid_blocks, num_hybrid, 0, False, False
    if resume_local < num_local:
        blocks = self.kv_cache_manager.truncate_computed_blocks(blocks, resume_local)
    return blocks, resume_local, ext, load_async, hit_diverged
''',
)

TRANSFORM = Transform(
    id="prefer_local_prefix",
    why=(
        "On a hybrid attention + Mamba model whose recurrent group is shallow, vLLM asks the connector "
        "beyond the hybrid hit, so a store holding the conversation reloads attention pages that are "
        "resident into fresh duplicate blocks ('served by restore'); upstream's divergent-hit path "
        "recomputes from the hybrid depth when the store ends exactly at the local attention depth."
    ),
    what_changes=(
        "Scheduler.__init__ reads the opt-in key; Scheduler._get_local_prefix_cache_hit uses the per-group "
        "(full-attention depth) lookup when opted in, through Scheduler._sparkcache_local_attention_hit, "
        "which also reports the full-attention depth when a deeper Mamba checkpoint outlived the attention "
        "tail (upstream falls back to the hybrid depth there); Scheduler.schedule asks the connector through "
        "Scheduler._sparkcache_prefer_local_prefix, which keeps every resident attention block below the "
        "resume point, loads only tokens past the local attention depth (or, for a tie, the last block and "
        "the recurrent state there), and clamps an external claim not past the local hit to 0 with no "
        "async wait."
    ),
    removal_plan=(
        "Drop when upstream vLLM asks the connector at the full-attention depth for every connector that "
        "can restore recurrent state and supports a state-only load (vLLM issue 52773 / RFC 52837); until "
        "then re-verify the anchors and tests/transforms/test_prefer_local_prefix.py on each vLLM bump."
    ),
    config_keys={
        KEY: (
            "JSON true/false (parsed by sparkcache.settings.transform_option, the connector's own row). "
            "True: the connector (sparkcache's) restores the recurrent state at the end of any load, so the "
            "scheduler takes the local attention depth and asks the connector only for the difference. "
            "Absent/false: upstream behaviour."
        )
    },
    edits={SCHEDULER: (_READ_OPTION, _DIVERGENT_LOOKUP, _ASK_CONNECTOR, _LOCAL_ATTENTION_HIT, _HELPER)},
)
