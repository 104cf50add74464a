"""Tensor parallel on vLLM 0.32.0's real Scheduler with sparkcache's real scheduler side and a
real on-disk store (model outputs and worker reports synthetic): an entry is one unit across
ranks. It is offered only to the depth every rank's shard holds (vLLM restores all ranks or
none, so a shard another rank lacks would be read, refused and recomputed on every request),
a capture publishes again what any rank lacks, and a hit refreshes every rank's shard in LRU
order (so eviction does not take one rank's half first)."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

from .scheduler_scenarios import BS, make_scheduler, request, step, store_prefix


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _offered(s, prompt: list[int], rid: str = "a") -> int:
    r = request(rid, prompt)
    s.add_request(r)
    return s.connector._sched.get_num_new_matched_tokens(r, 0)[0]


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_shard_missing_on_one_rank_is_not_offered_and_is_captured_again(tmp_path, hybrid):
    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=hybrid)
    assert len(s.connector._sched.identities) == 2
    prompt = _prompt(200, 1)
    store_prefix(s, prompt, ranks=[0])  # rank 1's shard evicted, deleted or never written
    assert _offered(s, prompt) == 0
    captures = []
    for _ in range(40):
        out = step(s, sending=set(s.connector._sched.awaiting_send))
        captures += out.kv_connector_metadata.captures
        if not s.requests:
            break
    # the whole prefix is captured again (every rank publishes; rank 0's objects are reused)
    assert max(len(c.keys) for c in captures) == 192 // BS and all(c.reuse_pages == 0 for c in captures)
    store_prefix(s, prompt, ranks=[1])  # what rank 1's worker publishes
    assert _offered(s, prompt, "b") == 192


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_offers_stop_at_the_depth_every_rank_holds(tmp_path, hybrid):
    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=hybrid)
    prompt = _prompt(200, 2)
    store_prefix(s, prompt[:128])            # both ranks: 8 blocks
    store_prefix(s, prompt, ranks=[0])       # rank 0 only: 12 blocks
    assert _offered(s, prompt) == 128
    store_prefix(s, prompt, ranks=[1])
    assert _offered(s, prompt, "b") == 192


def test_states_at_different_depths_per_rank_meet_at_the_deepest_common_one(tmp_path):
    # rank 0 holds states after blocks 12, 9, 6 and 3, rank 1 after 11, 8 and 3 (it skipped
    # some captures): each pass of the lookup lands on a new depth, four passes in all
    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=True)
    prompt = _prompt(200, 4)
    for blocks, ranks in ((12, [0]), (9, [0]), (6, [0]), (11, [1]), (8, [1]), (3, [0, 1])):
        store_prefix(s, prompt[:blocks * BS], ranks=ranks)
    assert _offered(s, prompt) == 3 * BS


def test_a_hit_refreshes_every_rank_shard(tmp_path):
    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=False)
    side = s.connector._sched
    prompt = _prompt(200, 3)
    store_prefix(s, prompt)
    side.store.index.refresh(force=True)
    paths = [side.store.layout.manifest_path(e.manifest.identity.digest(), e.entry_id)
             for e in side.store.index.entries.values()]
    assert len(paths) == 2
    for path in paths:
        os.utime(path, (1_000_000_000, 1_000_000_000))
    assert _offered(s, prompt) == 192
    assert all(os.stat(path).st_mtime > 1_000_000_000 for path in paths)


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "decode_context_parallel_size",
                                  "prefill_context_parallel_size"])
def test_other_parallel_layouts_are_refused_at_startup_with_the_fix(tmp_path, name):
    from vllm.config import ParallelConfig, VllmConfig

    from sparkcache.connector.connector import _refuse_unsupported_parallel
    from sparkcache.settings import SettingsError, load_settings

    on = load_settings(env={}, extra_config={"root": str(tmp_path)})
    # vLLM 0.32.0's V1 runner refuses prefill context parallel in VllmConfig itself; the
    # connector refuses it too, for a runner that would not
    layout = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2, **{name: 2}))
    with pytest.raises(SettingsError, match=f"parallel_config.{name}=2 is not supported.*Fix: run with {name}=1"):
        _refuse_unsupported_parallel(layout, on)
    # the store switched off stores nothing wrong; tensor parallelism is supported
    _refuse_unsupported_parallel(layout, load_settings(env={"SPARKCACHE_ENABLED": "0"},
                                                       extra_config={"root": str(tmp_path)}))
    _refuse_unsupported_parallel(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2)), on)
