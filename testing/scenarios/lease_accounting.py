"""GPU-lease accounting on vLLM's real Scheduler (hybrid full attention + Mamba "align", retention 0).

Three parts, each on a fresh scheduler with the ProbeConnector delaying frees
(``probe_delay_free``: blocks are held until the scenario reports
``finished_sending``, as an asynchronous capture does):

1. checkpoint eviction: an 80-token prompt (range(100, 180)) decodes 5 tokens;
   its Mamba state at 64 is retired during decode. The lease ends with
   finished_sending; then pressure takes, by a real allocation
   (``block_pool.get_new_blocks``, which pops the free queue's head and evicts
   the hashes of what it pops), every free block queued ahead of the request's
   attention blocks, so every attention block stays resident. The next turn
   (prompt + reply + 32 new tokens) reports its local hit and per-group hits.
2. expiry: the lease runs past its deadline with no finished_sending; one empty
   scheduling step later the blocks are back in the pool.
3. late report: finished_sending for a request whose blocks were already
   released (after the expiry with leases on; after the one release upstream
   allows with leases off).
4. aborted during a load: the store holds the prompt's first 64 tokens and the
   load is asynchronous (``probe_async_load``); the request is aborted while it
   waits for the load, the clock passes a lease's deadline, then the worker
   reports finished_recving. The blocks the load writes must stay allocated
   until that report: freed earlier, another request could be given them while
   the load still writes into them.

The lease clock is ``scheduler.sparkcache_leases.now``
(sparkcache.hooks.lease_accounting.GpuLeases); the scenario replaces it with a
fake clock. Counters read None where no leases are attached (the pristine tree,
or the option absent).
"""

from __future__ import annotations

from testing import vllm_scheduler as h
from testing.scenarios import option_readings

LEASE_KEY = "sparkcache_gpu_lease_seconds"
LEASE_SECONDS = 30.0
PROMPT = list(range(100, 180))
MAX_TOKENS = 5
NEW_TOKENS = list(range(300, 332))
NUM_BLOCKS = 100
ATTN_GROUP, MAMBA_GROUP = 0, 1
CHECKPOINT_TOKENS = 64


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(options_on: bool, **probe):
    extra = {"probe_delay_free": True, **probe}
    if options_on:
        extra[LEASE_KEY] = LEASE_SECONDS
    scheduler = h.make_scheduler(h.probe_connector(extra), num_blocks=NUM_BLOCKS)
    clock = _Clock()
    if _leases(scheduler) is not None:
        _leases(scheduler).now = clock
    return scheduler, clock


def _leases(scheduler):
    """The scheduler's GpuLeases (None: not transformed, or the option absent)."""
    return getattr(scheduler, "sparkcache_leases", None)


def _lease_count(scheduler, name: str):
    leases = _leases(scheduler)
    return None if leases is None else getattr(leases, name)


def _free_queue(block_pool) -> list:
    """The free queue, head (evicted first) to tail."""
    queue = block_pool.free_block_queue
    out, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        out.append(block)
        block = block.next_free_block
    return out


def _cached(block_pool, request, num_tokens: int, group: int):
    idx = num_tokens // h.BLOCK_SIZE - 1
    found = block_pool.get_cached_block(request.block_hashes[idx], [group])
    return found[0] if found else None


def _leased_blocks(scheduler):
    """GpuLeases.leased_blocks and SchedulerStats.num_leased_blocks (None: not there)."""
    stats = scheduler.make_stats()
    return _lease_count(scheduler, "leased_blocks"), getattr(stats, "num_leased_blocks", None)


def _error_name(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the pristine tree asserts (or KeyErrors under -O)
        return type(exc).__name__
    return None


def checkpoint_eviction(options_on: bool) -> dict:
    scheduler, _ = _scheduler(options_on)
    block_pool = scheduler.kv_cache_manager.block_pool
    first = h.make_request("turn1", PROMPT, MAX_TOKENS)
    scheduler.add_request(first)
    checkpoint = None
    retired_at = None
    for _ in range(100):
        h.step(scheduler)
        if checkpoint is None:
            checkpoint = _cached(block_pool, first, CHECKPOINT_TOKENS, MAMBA_GROUP)
        elif retired_at is None and checkpoint.ref_cnt == 0:
            retired_at = first.num_computed_tokens
        if first.is_finished():
            break
    assert checkpoint is not None and first.is_finished()
    attention = [_cached(block_pool, first, n, ATTN_GROUP) for n in range(16, len(PROMPT) + 1, 16)]
    leased_blocks, stats_leased_blocks = _leased_blocks(scheduler)
    during_lease = {
        "held": first.request_id in scheduler.requests,
        "checkpoint_ref_cnt": checkpoint.ref_cnt,
        "leased_blocks": leased_blocks,
        "stats_leased_blocks": stats_leased_blocks,
    }

    h.step(scheduler, finished_sending={first.request_id})
    queue = _free_queue(block_pool)
    position = {block.block_id: i for i, block in enumerate(queue)}
    attention_positions = [position.get(b.block_id) for b in attention]
    checkpoint_position = position.get(checkpoint.block_id)
    # Pressure that spares every attention block: a real allocation of all
    # free blocks queued ahead of the first of them, returned unhashed.
    num_evicted = min(attention_positions)
    block_pool.free_blocks(block_pool.get_new_blocks(num_evicted))

    second = h.make_request("turn2", list(first.all_token_ids) + NEW_TOKENS, MAX_TOKENS)
    attn_hit, mamba_hit = h.per_group_hits(scheduler, second)
    hit = h.first_schedule_hit(scheduler, second)
    return {
        "checkpoint_retired_at_computed": retired_at,
        "during_lease": during_lease,
        "after_release": {
            "leased_blocks": _leased_blocks(scheduler)[0],
            "free_queue_len": len(queue),
            "checkpoint_position": checkpoint_position,
            "first_attention_block_position": attention_positions[0],
            "attention_positions": attention_positions,
        },
        "evicted_oldest_free_blocks": num_evicted,
        "checkpoint_survived": checkpoint.block_hash is not None,
        "next_turn_prompt_tokens": second.num_prompt_tokens,
        "next_turn_per_group_hits": {"attention": attn_hit, "mamba": mamba_hit},
        # The probe store is empty (external 0), so the tokens computed at
        # admission are the local hit; prefill_stats is consumed when the
        # request samples in its first step, so it is not read here.
        "next_turn_external": [q[2] for q in scheduler.connector.queries if q[0] == second.request_id],
        "next_turn_local_hit": hit["num_computed_tokens"],
    }


def expiry_and_late_report(options_on: bool) -> dict:
    scheduler, clock = _scheduler(options_on)
    block_pool = scheduler.kv_cache_manager.block_pool
    request = h.make_request("lost", PROMPT, MAX_TOKENS)
    h.run_to_completion(scheduler, request)
    free_at_finish = block_pool.get_num_free_blocks()
    clock.now += LEASE_SECONDS + 1  # past the deadline, and no finished_sending ever comes
    h.step(scheduler)
    out = {
        "free_blocks_total": NUM_BLOCKS - 1,
        "free_blocks_at_finish": free_at_finish,
        "free_blocks_after_deadline_step": block_pool.get_num_free_blocks(),
        "held_after_deadline_step": request.request_id in scheduler.requests,
        "engine_busy_after_deadline_step": scheduler.has_requests(),
        "expired_leases": _lease_count(scheduler, "expired"),
    }
    if out["held_after_deadline_step"]:
        # Upstream: the only way out is the report; a second one is "late".
        out["release_error"] = _error_name(lambda: h.step(scheduler, finished_sending={request.request_id}))
    out["late_report_error"] = _error_name(lambda: h.step(scheduler, finished_sending={request.request_id}))
    out["late_reports_ignored"] = _lease_count(scheduler, "late_reports")
    out["free_blocks_after_late_report"] = block_pool.get_num_free_blocks()
    return out


def aborted_during_load(options_on: bool) -> dict:
    from vllm.v1.request import RequestStatus

    scheduler, clock = _scheduler(options_on, probe_async_load=True)
    block_pool = scheduler.kv_cache_manager.block_pool
    scheduler.connector.store_prefix(PROMPT[:CHECKPOINT_TOKENS])
    request = h.make_request("aborted", PROMPT, MAX_TOKENS)
    scheduler.add_request(request)
    h.step(scheduler)  # allocates the blocks the load writes; the request waits for it
    waiting = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    free_while_loading = block_pool.get_num_free_blocks()
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    leased_after_abort = _leased_blocks(scheduler)[0]
    clock.now += LEASE_SECONDS + 1  # a lease started at the abort would be past its deadline
    h.step(scheduler)
    out = {
        "waiting_for_load": waiting,
        "blocks_allocated_for_load": NUM_BLOCKS - 1 - free_while_loading,
        "leased_blocks_after_abort": leased_after_abort,
        "held_after_deadline_step": request.request_id in scheduler.requests,
        "free_blocks_after_deadline_step": block_pool.get_num_free_blocks(),
        "expired_leases": _lease_count(scheduler, "expired"),
    }
    out["finished_recving_error"] = _error_name(lambda: h.step(scheduler, finished_recving={request.request_id}))
    out["held_after_finished_recving"] = request.request_id in scheduler.requests
    out["free_blocks_after_finished_recving"] = block_pool.get_num_free_blocks()
    return out


def run(options_on: bool, config_values: list | None = None) -> dict:
    """config_values: how the scheduler reads each sparkcache_gpu_lease_seconds value instead."""
    if config_values is not None:
        return option_readings(
            [{LEASE_KEY: value} for value in config_values],
            lambda scheduler: _lease_count(scheduler, "seconds"),
            num_blocks=NUM_BLOCKS,
        )
    return {
        "options_on": options_on,
        "checkpoint_eviction": checkpoint_eviction(options_on),
        "expiry": expiry_and_late_report(options_on),
        "aborted_during_load": aborted_during_load(options_on),
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(options_on="--on" in sys.argv), indent=2))
