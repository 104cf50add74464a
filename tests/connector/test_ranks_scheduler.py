"""Tensor parallel on vLLM 0.32.0's real Scheduler with sparkcache's real scheduler side and a
real on-disk store (model outputs and worker reports synthetic): an entry is one unit across
ranks. It is offered only to the depth every rank's shard holds (vLLM restores all ranks or
none, so a shard another rank lacks would be read, refused and recomputed on every request),
a capture publishes again what any rank lacks, and a hit refreshes every rank's shard in LRU
order (so eviction does not take one rank's half first)."""

from __future__ import annotations

import dataclasses
import os
import random
from types import SimpleNamespace

import pytest

from sparkcache.connector.keys import BlockKeys

from .scheduler_scenarios import BS, make_scheduler, request, step, store_prefix


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _offered(s, prompt: list[int], rid: str = "a") -> int:
    r = request(rid, prompt)
    s.add_request(r)
    return s.connector._sched.get_num_new_matched_tokens(r, 0)[0]


def _run_to_end(s) -> list:
    """Step until no request is left; the capture plans sent to the workers meanwhile."""
    captures = []
    for _ in range(40):
        out = step(s, sending=set(s.connector._sched.awaiting_send))
        captures += out.kv_connector_metadata.captures
        if not s.requests:
            break
    return captures


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_a_shard_missing_on_one_rank_is_not_offered_and_is_captured_again(tmp_path, hybrid):
    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=hybrid)
    assert len(s.connector._sched.identities) == 2
    prompt = _prompt(200, 1)
    store_prefix(s, prompt, ranks=[0])  # rank 1's shard evicted, deleted or never written
    assert _offered(s, prompt) == 0
    captures = _run_to_end(s)
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
    side.store.catalog.refresh(full=True)
    paths = [side.store.layout.manifest_path(e.manifest.identity.digest(), e.entry_id)
             for e in side.store.catalog.entries()]
    assert len(paths) == 2
    for path in paths:
        os.utime(path, (1_000_000_000, 1_000_000_000))
    assert _offered(s, prompt) == 192
    for store in side.stores:
        store.accesses.flush()  # hits are stamped off the scheduler's thread
    assert all(os.stat(path).st_mtime > 1_000_000_000 for path in paths)


def test_an_engine_spanning_nodes_is_refused_at_startup(tmp_path):
    from sparkcache.connector.connector import _refuse_unsupported_parallel
    from sparkcache.settings import SettingsError, load_settings

    on = load_settings(env={}, extra_config={"root": str(tmp_path)})
    two = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=8, nnodes=2, nnodes_within_dp=2))
    with pytest.raises(SettingsError, match="spans 2 nodes.*Fix: keep each engine's tensor-parallel ranks on one node"):
        _refuse_unsupported_parallel(two, on)
    # data parallel replicas on two nodes: each engine on one node
    _refuse_unsupported_parallel(SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=8, nnodes=2, nnodes_within_dp=1)), on)


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


def _finish_capturing(s, prompt: list[int], rid: str = "a") -> list:
    """Run ``prompt`` to its end; the capture plans the scheduler sent to the workers."""
    s.add_request(request(rid, prompt))
    return _run_to_end(s)


def _stored(s) -> list[tuple[int, int]]:
    """(tp rank, blocks) of every entry in every rank's store."""
    out = []
    for store in dict.fromkeys(s.connector._sched.stores):
        store.catalog.refresh(full=True)
        out += [(e.manifest.identity.tp_rank, e.manifest.block_count) for e in store.catalog.entries()]
    return sorted(out)


@pytest.mark.parametrize("per_rank_root", [False, True], ids=["shared-root", "root-per-rank"])
@pytest.mark.parametrize("published", [[0], [1], [0, 1]])
def test_an_entry_one_rank_failed_to_publish_is_removed_once_every_rank_settled(tmp_path, published,
                                                                             per_rank_root):
    """A rank's publication refused (over the cap, a full disk) while another's went through
    leaves a shard that can never be restored and that the next capture would skip: when
    every rank reported the capture settled, the scheduler removes it."""
    root = str(tmp_path / "rank{rank}") if per_rank_root else str(tmp_path)
    s = make_scheduler(root, tensor_parallel_size=2, hybrid=False, extra={"root": root})
    side = s.connector._sched
    (plan,) = _finish_capturing(s, _prompt(200, 5))
    pages = [b"p" * 64] * (-(-len(plan.keys) // side.bpp))
    for rank in published:  # what each rank's worker managed to publish
        assert side.stores[rank].publish(side.identities[rank], plan.keys, pages).ok
    step(s, settled=[plan.req_id])            # rank 0's report: one still owed
    assert len(_stored(s)) == len(published)
    step(s, settled=[plan.req_id])            # every rank settled
    whole = len(published) == 2
    assert _stored(s) == ([(0, len(plan.keys)), (1, len(plan.keys))] if whole else [])
    stats = [o.scheduler_stats.kv_connector_stats for o in s.last_engine_outputs.values()]
    assert stats[0]["counters"].get("lone_shards_removed", 0) == (0 if whole else 1)


def test_a_shard_the_store_cannot_remove_now_keeps_the_engine_stepping_until_it_is_removed(tmp_path):
    """The settle check finds a lone shard while maintenance holds the store's lock (its pass
    runs right after the publication that filled the store): the removal is retried in the
    next steps, and vLLM keeps stepping an idle engine until it is done, so a lone shard does
    not outlive its request's settlement by more than the lock's hold."""
    import time

    from sparkcache.connector.shard_units import LONE_RETRY_S
    from sparkcache.store.locks import exclusive_lock

    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=False)
    side = s.connector._sched
    (plan,) = _finish_capturing(s, _prompt(200, 6))
    pages = [b"p" * 64] * (-(-len(plan.keys) // side.bpp))
    assert side.store.publish(side.identities[0], plan.keys, pages).ok
    with exclusive_lock(side.store.layout, timeout_s=1.0):  # maintenance holds the store's lock
        step(s, settled=[plan.req_id, plan.req_id])
        assert _stored(s) == [(0, len(plan.keys))]
        assert s.connector.has_pending_push_work()     # an idle engine keeps stepping
        time.sleep(LONE_RETRY_S)
        step(s)
        assert _stored(s) == [(0, len(plan.keys))]
    time.sleep(LONE_RETRY_S)
    step(s)                                          # the lock is free: removed
    assert _stored(s) == []
    step(s)                                          # its counter taken
    assert not s.connector.has_pending_push_work()


def test_a_shard_still_locked_when_its_retries_end_is_found_by_the_next_reconciliation(tmp_path):
    """A lock held longer than the retries (a stopped process) does not keep the engine busy
    forever: the retries end after the grace, and the periodic reconciliation removes it."""
    import time

    from sparkcache.connector.shard_units import UNIT_GRACE_S
    from sparkcache.store.locks import exclusive_lock

    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=False)
    side = s.connector._sched
    (plan,) = _finish_capturing(s, _prompt(200, 12))
    pages = [b"p" * 64] * (-(-len(plan.keys) // side.bpp))
    assert side.store.publish(side.identities[0], plan.keys, pages).ok
    with exclusive_lock(side.store.layout, timeout_s=1.0):
        step(s, settled=[plan.req_id, plan.req_id])
        assert side.has_pending_push_work()
        side.take_counters()
        assert not side.has_pending_push_work(now=time.monotonic() + UNIT_GRACE_S + 1)
        assert _stored(s) == [(0, len(plan.keys))]
    side.units.reconcile(now=time.time() + UNIT_GRACE_S)
    assert _stored(s) == []


def test_a_lone_shard_another_request_still_captures_is_left_to_it(tmp_path):
    """Two requests capture the same entry: the first settles with rank 1's shard refused
    while the second is still writing; rank 0's shard (the second's too) is kept, by the
    settle check and by the reconciliation, until the second settles."""
    import time

    from sparkcache.connector.shard_units import UNIT_GRACE_S

    s = make_scheduler(str(tmp_path), tensor_parallel_size=2, hybrid=False)
    side = s.connector._sched
    prompt = _prompt(200, 10)
    s.add_request(request("a", prompt))
    s.add_request(request("b", prompt))
    plans = _run_to_end(s)
    assert sorted(p.req_id for p in plans) == ["a", "b"] and plans[0].keys == plans[1].keys
    keys = plans[0].keys
    pages = [b"p" * 64] * (-(-len(keys) // side.bpp))
    assert side.store.publish(side.identities[0], keys, pages).ok
    step(s, settled=["a", "a"])                 # a settled; b still in flight
    side.units.reconcile(now=time.time() + UNIT_GRACE_S)
    assert _stored(s) == [(0, len(keys))]
    step(s, settled=["b", "b"])                 # b settled without rank 1's shard either
    assert _stored(s) == []


def test_each_rank_has_its_own_root_and_the_scheduler_reads_every_one(tmp_path):
    root = str(tmp_path / "rank{rank}")
    s = make_scheduler(root, tensor_parallel_size=2, hybrid=False, extra={"root": root})
    side = s.connector._sched
    assert [st.layout.base for st in side.stores] == [str(tmp_path / f"rank{r}" / "default") for r in (0, 1)]
    prompt = _prompt(200, 7)
    store_prefix(s, prompt, ranks=[0])
    assert os.listdir(tmp_path / "rank1" / "default" / "manifests") == []
    assert _offered(s, prompt) == 0           # rank 1's root lacks its shard
    store_prefix(s, prompt, ranks=[1])
    assert _offered(s, prompt, "b") == 192


@pytest.mark.parametrize("per_rank_root", [False, True], ids=["shared-root", "root-per-rank"])
def test_shards_whose_siblings_are_gone_are_removed_after_a_grace(tmp_path, per_rank_root):
    """Each rank's maintenance evicts on its own root, or an engine stopped between its ranks'
    publications: the periodic reconciliation removes the shards left without a sibling,
    once they are older than the grace (a sibling may still be being written) and not a
    capture the scheduler waits for; whole units, and other engines' entries, stay."""
    import time

    from sparkcache.connector.shard_units import UNIT_GRACE_S

    root = str(tmp_path / "rank{rank}") if per_rank_root else str(tmp_path)
    s = make_scheduler(root, tensor_parallel_size=2, hybrid=False, extra={"root": root})
    side = s.connector._sched
    whole, lone = _prompt(200, 8), _prompt(200, 9)
    store_prefix(s, whole)
    store_prefix(s, lone, ranks=[1])
    other = dataclasses.replace(side.identities[0], parallel='{"tensor_parallel_size":4}')
    keys = BlockKeys(BS).upto(lone, 12)
    assert side.stores[0].publish(other, keys, [b"o" * 64]).ok  # another engine's rank 0: not ours
    side.units.reconcile(now=time.time())    # younger than the grace: left alone
    assert len(_stored(s)) == 4
    side.units.reconcile(now=time.time() + UNIT_GRACE_S + 1)
    assert _stored(s) == [(0, 12), (0, 12), (1, 12)]  # whole's two shards, the other engine's
    assert side.take_counters()["lone_shards_removed"] == 1
