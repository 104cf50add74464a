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

from transforms import Edit, Transform, class_default

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
KEY = "sparkcache_prefer_local_prefix"

# The logic is sparkcache.hooks.prefer_local_prefix.LocalPrefixFirst; these edits are its call sites.
_READ_OPTION = Edit(
    function="Scheduler.__init__",
    mode="insert_before",
    anchor="kv_transfer_config = self.vllm_config.kv_transfer_config",
    new="""
self.sparkcache_prefer_local_prefix = None  # sparkcache prefer_local_prefix (opt-in)
if "sparkcache_prefer_local_prefix" in (
    getattr(self.vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
):
    from sparkcache.hooks.prefer_local_prefix import LocalPrefixFirst

    self.sparkcache_prefer_local_prefix = LocalPrefixFirst.attach(self)
""",
)

_DIVERGENT_LOOKUP = Edit(
    function="Scheduler._get_local_prefix_cache_hit",
    mode="replace",
    anchor="""
if connector is not None and connector.supports_divergent_local_hybrid_hits:
    return self.kv_cache_manager.get_computed_blocks_for_connector(request)
""",
    new="""
# getattr: upstream tests call this method on a SimpleNamespace `self` (no class default there).
if connector is not None and getattr(self, "sparkcache_prefer_local_prefix", None) is not None:
    return self.sparkcache_prefer_local_prefix.local_hit(request)
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
if self.sparkcache_prefer_local_prefix is not None and not partial_tail:
    # sparkcache prefer_local_prefix: ask only past the local attention depth.
    (
        new_computed_blocks,
        num_new_local_computed_tokens,
        ext_tokens,
        load_kv_async,
        hit_diverged,
    ) = self.sparkcache_prefer_local_prefix.ask_connector(
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

TRANSFORM = Transform(
    id="prefer_local_prefix",
    why=(
        "On a hybrid attention + Mamba model whose recurrent group is shallow, vLLM asks the connector "
        "beyond the hybrid hit, so a store holding the conversation reloads attention pages that are "
        "resident into fresh duplicate blocks ('served by restore'); upstream's divergent-hit path "
        "recomputes from the hybrid depth when the store ends exactly at the local attention depth."
    ),
    what_changes=(
        "Scheduler.__init__ reads the opt-in key (sparkcache.hooks.prefer_local_prefix.LocalPrefixFirst holds "
        "the logic; the edits are its call sites); Scheduler._get_local_prefix_cache_hit uses the per-group "
        "(full-attention depth) lookup when opted in, through LocalPrefixFirst.local_hit, "
        "which also reports the full-attention depth when a deeper Mamba checkpoint outlived the attention "
        "tail (upstream falls back to the hybrid depth there); Scheduler.schedule asks the connector through "
        "LocalPrefixFirst.ask_connector, which keeps every resident attention block below the "
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
    edits={
        SCHEDULER: (
            class_default("Scheduler", "sparkcache_prefer_local_prefix", "prefer_local_prefix"),
            _READ_OPTION,
            _DIVERGENT_LOOKUP,
            _ASK_CONNECTOR,
        )
    },
)
