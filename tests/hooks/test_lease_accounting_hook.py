"""sparkcache.hooks.lease_accounting in-process, on vLLM 0.32.0's real (pristine) Scheduler and
block pool: a lease holds a finished request's blocks and its retired checkpoint, expires at its
deadline, frees the checkpoint behind the attention blocks, and counts a late report. The
transformed scheduler's calls into it are tests/transforms/test_lease_accounting.py."""

from __future__ import annotations

import pytest

from sparkcache.hooks.lease_accounting import KEY, GpuLeases, RetiredCheckpoints
from testing.scenarios import lease_accounting as shape
from testing.vllm_scheduler import make_request, make_scheduler, probe_connector, run_to_completion


def _finished_with_delayed_free():
    scheduler = make_scheduler(probe_connector({"probe_delay_free": True, KEY: shape.LEASE_SECONDS}),
                               num_blocks=shape.NUM_BLOCKS)
    mamba = scheduler.kv_cache_manager.coordinator.single_type_managers[shape.MAMBA_GROUP]
    mamba.sparkcache_retired = None  # the attribute the transform adds; GpuLeases fills it
    leases = GpuLeases(scheduler)
    clock = shape._Clock()
    leases.now = clock
    request = make_request("r", shape.PROMPT, shape.MAX_TOKENS)
    run_to_completion(scheduler, request)
    return scheduler, leases, clock, request, mamba


def test_a_lease_holds_the_retired_checkpoint_and_frees_it_behind_the_attention_blocks():
    scheduler, leases, clock, request, mamba = _finished_with_delayed_free()
    pool = scheduler.kv_cache_manager.block_pool
    checkpoint = shape._cached(pool, request, shape.CHECKPOINT_TOKENS, shape.MAMBA_GROUP)
    assert checkpoint is not None and checkpoint.ref_cnt == 0  # retired on the first decode step: in the free queue
    assert isinstance(mamba.sparkcache_retired, RetiredCheckpoints)
    mamba.sparkcache_retired.record("r", [checkpoint])  # what the transformed MambaManager records
    leases.start(request)
    attention = list(scheduler.kv_cache_manager.coordinator.get_blocks("r")[shape.ATTN_GROUP])
    assert checkpoint.ref_cnt == 1 and leases.leased_blocks == 8  # 6 attention + running Mamba + checkpoint
    leases.sweep()
    assert "r" in scheduler.requests and leases.expired == 0  # before its deadline
    clock.now += shape.LEASE_SECONDS + 1
    leases.sweep()  # frees the request's blocks (vLLM's _free_blocks)
    assert "r" not in scheduler.requests and leases.expired == 1
    leases.end(request)  # what the transformed _free_blocks calls next
    assert leases.leased_blocks == 0 and checkpoint.ref_cnt == 0
    queue = shape._free_queue(pool)
    assert len(attention) == 6 and all(queue.index(b) < queue.index(checkpoint) for b in attention)
    assert pool.get_num_free_blocks() == shape.NUM_BLOCKS - 1


def test_a_late_report_is_counted():
    _, leases, _, _, _ = _finished_with_delayed_free()
    leases.late_report("gone")
    assert leases.late_reports == 1


def test_retired_checkpoints_keep_only_blocks_still_under_their_hash():
    scheduler, _, _, request, mamba = _finished_with_delayed_free()
    pool = scheduler.kv_cache_manager.block_pool
    checkpoint = shape._cached(pool, request, shape.CHECKPOINT_TOKENS, shape.MAMBA_GROUP)
    unhashed = next(b for b in pool.blocks if b.block_hash is None and not b.is_null)
    retired = RetiredCheckpoints()
    retired.record("r", [checkpoint, unhashed, checkpoint])
    assert retired.take("r") == [checkpoint]  # once, the unhashed one never recorded
    assert retired.take("r") == []
    retired.record("r", [checkpoint])
    pool.evict_blocks({checkpoint.block_id})  # reused: its hash is gone
    assert retired.take("r") == []
    retired.record("r", [checkpoint] if checkpoint.block_hash else [])
    retired.forget("r")
    assert retired.take("r") == []


@pytest.mark.parametrize("value", ["30", float("nan"), 0, -1, True, None])
def test_a_bad_lease_length_is_refused_naming_the_key(value):
    scheduler = make_scheduler(probe_connector({KEY: value}))
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{KEY}'\]"):
        GpuLeases(scheduler)
