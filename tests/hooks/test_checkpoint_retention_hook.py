"""sparkcache.hooks.checkpoint_retention in-process, on vLLM 0.32.0's real (pristine) Scheduler
and Mamba manager: which managers are enabled, and which steps' boundaries are kept. The
transformed manager's calls into it are tests/transforms/test_checkpoint_retention.py."""

from __future__ import annotations

from sparkcache.hooks.checkpoint_retention import DROP_KEY, RETAIN_KEY, DecodeCheckpoints, enable_decode_checkpoints
from testing.vllm_scheduler import BLOCK_SIZE, make_request, make_scheduler, probe_connector, step


def _mamba(extra):
    scheduler = make_scheduler(probe_connector(extra))
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    manager.sparkcache_decode_checkpoints = None  # the attribute the transform adds
    enable_decode_checkpoints(scheduler)
    return scheduler, manager


def test_enabled_only_when_retain_is_true():
    assert _mamba({RETAIN_KEY: False, DROP_KEY: True})[1].sparkcache_decode_checkpoints is None
    kept = _mamba({RETAIN_KEY: True, DROP_KEY: True})[1].sparkcache_decode_checkpoints
    assert isinstance(kept, DecodeCheckpoints) and kept.drop_superseded is True
    # The attention manager has no such attribute and is left alone.
    scheduler, _ = _mamba({RETAIN_KEY: True})
    assert not hasattr(scheduler.kv_cache_manager.coordinator.single_type_managers[0], "sparkcache_decode_checkpoints")


def test_only_a_decode_step_ending_on_a_block_boundary_is_kept():
    scheduler, manager = _mamba({RETAIN_KEY: True})
    kept = manager.sparkcache_decode_checkpoints
    request = make_request("r", list(range(40)), max_tokens=30)
    scheduler.add_request(request)
    seen = {}  # (tokens, retention interval) -> boundaries named over the run
    for _ in range(30):
        computed = request.num_computed_tokens
        for tokens in (computed + 1, 32, 48, 64):
            for retention in (0, None):
                seen.setdefault((tokens, retention), set()).add(kept.boundary(request, tokens, retention, [32]))
        step(scheduler)
        if request.is_finished():
            break
    assert seen[48, 0] == {None, 48} and seen[64, 0] == {None, 64}  # kept at the step that ends there
    assert seen[32, 0] == {None}  # the prompt's replay boundary: upstream's retention keeps it
    assert all(named == {None} for (tokens, retention), named in seen.items()
               if retention is None or tokens % BLOCK_SIZE)  # dense retention, or off a boundary
