"""Tensor parallel (TP=2) on the real CPU engine: every rank publishes its own shard of an
entry, the scheduler offers an entry only when every rank's shard is there, and a damaged or
missing shard on rank 1 heals (issue 18).

The tiny offline Llama (4 KV heads, 2 per rank), two 2,100-token prompts, one worker process
per rank, each on its own core (``VLLM_CPU_OMP_THREADS_BIND``), gloo and vLLM's shared-memory
all-reduce on loopback. One module-scoped sequence on one store root, in two engine lives
(each round after the first in a life starts on an emptied GPU prefix cache, so it finds only
what the connector restores; contracts/engine_driver.py, ``"phases"``):

1. TP=2, read-write, cold: both prompts computed (nothing to restore: the reference output);
   each rank publishes its shard (4 entries);
2. TP=2 after a restart: both restored, identical; restored tokens counted once per request
   (not once per rank);
3. in the same life, rank 1's shard of prompt A corrupted (one byte of one object) and rank 1's
   shard of prompt B deleted (its objects): A is offered, refused by rank 1 and recomputed on
   both ranks; B is not offered (its shard is gone); both outputs identical, both captured again;
4. then: both restored again, identical.

Another TP size restores nothing: ``test_shards_written_at_tp4_are_not_restored_at_tp2``.

And the long-memory tiny NemotronH of ``test_engine_hybrid`` (Mamba2 + attention) at TP=2,
one life: cold (computed: the reference), then restored: each rank publishes and restores its
pages and its share of the recurrent state; tokens identical.
"""

from __future__ import annotations

import os

import pytest

from sparkcache.connector.keys import BlockKeys
from sparkcache.store import Identity, PageStore

from .conftest import flip_byte, long_prompt, metric
from .conftest import run_engine as _run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
PROMPTS = [long_prompt(2100, seed=21), long_prompt(2100, seed=22)]
REUSABLE = (2100 - 1) // BLOCK * BLOCK  # 2,080
MAX_TOKENS = 16
CAPTURED_BLOCKS = (2100 + MAX_TOKENS - 1) // BLOCK  # a finished request's computed tokens: 66 blocks


def run_engine(cfg: dict, **kwargs) -> dict:
    """An engine life in vLLM's own processes (one engine core, a worker per rank) and busy
    loop, which keeps the idle engine stepping until every rank's capture settled."""
    return _run_engine({"in_process": False, **cfg}, **kwargs)


def _tp_env(ranks: int = 2) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    # one OpenMP core per rank, round robin ("auto" refuses one NUMA node)
    bind = "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}


def _shard(root, prompt: list[int], tp_rank: int):
    """(store, the entry of ``prompt`` that ``tp_rank`` published)."""
    store = PageStore(str(root))
    store.catalog.refresh(full=True)
    key = BlockKeys(BLOCK).upto(prompt, REUSABLE // BLOCK)[-1]
    found = [e for e in store.catalog.entries() if e.manifest.identity.tp_rank == tp_rank
             and e.manifest.block_keys[REUSABLE // BLOCK - 1] == key]
    assert len(found) == 1, [(e.manifest.identity.tp_rank, e.manifest.block_count) for e in store.catalog.entries()]
    return store, found[0]


def _damage_rank_1(root) -> None:
    """Rank 1's shard of prompt A corrupted (one byte of one object), its shard of prompt B
    deleted (the objects rank 0's shard does not share)."""
    store, a = _shard(root, PROMPTS[0], 1)
    flip_byte(store.objects.path(a.manifest.pages[len(a.manifest.pages) // 2].digest))
    store, b = _shard(root, PROMPTS[1], 1)
    _, a0 = _shard(root, PROMPTS[0], 0)
    shared = {p.digest for p in a0.manifest.pages}
    for page in b.manifest.pages:
        if page.digest not in shared:
            os.unlink(store.objects.path(page.digest))


@pytest.fixture(scope="module")
def lives(tiny_model, tmp_path_factory):
    """Two lives: cold; then, after a restart, restored, damaged (the store damaged while the
    engine waits) and healed, each round on an emptied GPU prefix cache."""
    root = tmp_path_factory.mktemp("store")
    env = _tp_env()
    base = {"model": tiny_model, "max_tokens": MAX_TOKENS, "block_size": BLOCK, "tensor_parallel_size": 2}
    # Every round waits for its publications to settle before the next (and before the life
    # ends: the offline engine gets 5 s to stop, which a publication on a busy disk can outlast;
    # docs/CONNECTOR.md, "Shutdown").
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64},
          "check_units": {"root": str(root), "ranks": 2}}
    out = {"cold": run_engine({**rw, "prompts": PROMPTS}, timeout=600, env=env)}
    store = PageStore(str(root))
    store.catalog.refresh(full=True)
    out["entries"] = sorted((e.manifest.identity.tp_rank, e.manifest.block_count)
                            for e in store.catalog.entries())

    def between(phase: int, _done: list[dict]) -> None:
        if phase == 1:
            _damage_rank_1(root)

    later = run_engine({**rw, "phases": [{"prompts": PROMPTS}] * 3}, timeout=900, env=env, between=between)
    out["restored"], out["damaged"], out["healed"] = later["phases"]
    return out


@pytest.fixture(scope="module")
def hybrid_lives(hybrid_model, tmp_path_factory):
    from .test_engine_hybrid import HYBRID, PROMPT

    root = tmp_path_factory.mktemp("hybrid-store")
    base = {"model": hybrid_model, **HYBRID, "tensor_parallel_size": 2}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64},
          "check_units": {"root": str(root), "ranks": 2}}  # publications settled before shutdown
    cold, restored = run_engine({**rw, "phases": [{"prompts": [PROMPT]}] * 2}, timeout=600, env=_tp_env())["phases"]
    return {"cold": cold, "restored": restored}


def _records(result: dict) -> list[dict]:
    return [r["kv_transfer_params"]["sparkcache"] for r in result["results"]]


def _tokens(result: dict) -> list[list[int]]:
    return [r["tokens"] for r in result["results"]]


def _assert_units_whole_and_settled(results: list[dict]) -> None:
    """After every request (``check_units``): its publications settled, no entry lacks a rank."""
    assert [(r["incomplete_units"], r["units_quiet"]) for r in results] == [([], True)] * len(results), \
        [r["units_changes"] for r in results]


def _computed(result: dict) -> list[list[int]]:
    """The tokens of a life that restored nothing: the reference every restore is compared with."""
    records = _records(result)
    assert records and all(r["external_tokens"] == 0 and r["complete"] for r in records), records
    return _tokens(result)


def test_every_rank_publishes_its_shard(lives):
    _computed(lives["cold"])
    assert lives["entries"] == [(0, CAPTURED_BLOCKS)] * 2 + [(1, CAPTURED_BLOCKS)] * 2


def test_restart_restores_both_ranks_and_counts_each_request_once(lives):
    restored = lives["restored"]
    assert _tokens(restored) == _computed(lives["cold"])
    assert [r["external_tokens"] for r in _records(restored)] == [REUSABLE, REUSABLE]
    assert metric(restored, "vllm:external_prefix_cache_hits") == 2 * REUSABLE
    assert metric(restored, "vllm:sparkcache_restored_tokens") == 2 * REUSABLE  # not x2 ranks
    assert metric(restored, "vllm:sparkcache_restores", outcome="ok") == 2
    assert metric(restored, "vllm:sparkcache_restores", outcome="refused") == 0


def test_a_damaged_or_missing_shard_on_rank_1_recomputes_then_heals(lives):
    damaged = lives["damaged"]
    assert _tokens(damaged) == _computed(lives["cold"])
    corrupt, missing = _records(damaged)
    # A: rank 0's shard read and placed, rank 1's refused: vLLM recomputes on both ranks
    assert (corrupt["external_tokens"], corrupt["failed_restores"], corrupt["recomputed_tokens"]) == (0, 1, 2100)
    # B: rank 1's shard is gone, so nothing is offered (no read, no refusal)
    assert (missing["external_tokens"], missing["failed_restores"], missing["recomputed_tokens"]) == (0, 0, 2100)
    assert metric(damaged, "vllm:sparkcache_restores", outcome="refused") == 1
    assert metric(damaged, "vllm:sparkcache_quarantined_objects") == 1
    healed = lives["healed"]
    assert _tokens(healed) == _computed(lives["cold"])
    assert [r["external_tokens"] for r in _records(healed)] == [REUSABLE, REUSABLE]


def test_a_hybrid_model_at_tp2_restores_pages_and_state_with_identical_tokens(hybrid_lives):
    from .test_engine_hybrid import REUSABLE as HYBRID_REUSABLE

    restored = hybrid_lives["restored"]
    assert _tokens(restored) == _computed(hybrid_lives["cold"])
    assert [r["external_tokens"] for r in _records(restored)] == [HYBRID_REUSABLE]
    assert metric(restored, "vllm:sparkcache_state_restores", outcome="ok") == 1  # once, not per rank
    assert metric(restored, "vllm:sparkcache_restored_bytes", kind="state") > 0


# A store that holds about two units (each rank's shard of a 1,000-token prompt is ~1 MiB):
# six prompts through it, then (the GPU prefix cache emptied) the last (still stored) and the first (evicted).
SMALL = [long_prompt(1000, seed=40 + i) for i in range(6)]


@pytest.fixture(scope="module")
def small_store_lives(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("small-store")
    cfg = {"model": tiny_model, "max_tokens": MAX_TOKENS,
           "block_size": BLOCK, "tensor_parallel_size": 2, "connector": "sparkcache",
           "extra": {"root": str(root), "min_span_tokens": 64, "max_bytes": "4MiB",
                     "low_watermark_bytes": "2MiB"},
           "check_units": {"root": str(root), "ranks": 2},
           "phases": [{"prompts": SMALL}, {"prompts": [SMALL[-1], SMALL[0]]}]}
    # eight requests, each allowed check_units' 120 s to settle, inside the life's timeout
    return run_engine(cfg, timeout=1200, env=_tp_env())["phases"]


def test_a_store_at_its_cap_never_keeps_an_entry_of_only_some_ranks(small_store_lives):
    """Maintenance evicts during the run and a rank's publication can be refused over the cap
    while the other rank's went through: after every request (its publications settled), no
    entry lacks a rank's shard, and no offered restore is refused by either rank."""
    first, again = small_store_lives
    results = first["results"] + again["results"]
    _assert_units_whole_and_settled(results)
    assert metric(first, "vllm:sparkcache_evictions") > 0
    records = _records(first) + _records(again)
    assert [r["failed_restores"] for r in records] == [0] * len(records)
    assert metric(again, "vllm:sparkcache_restores", outcome="refused") == 0
    # then: the last prompt restored, the first (evicted long ago) recomputed
    assert [r["external_tokens"] for r in _records(again)] == [(1000 - 1) // BLOCK * BLOCK, 0]
    assert [r["tokens"] for r in again["results"]] == [first["results"][-1]["tokens"], first["results"][0]["tokens"]]


@pytest.fixture(scope="module")
def per_rank_root_lives(tmp_path_factory):
    """The tiny Llama with 2 KV heads, so that at TP=4 vLLM replicates each head on two ranks
    and a TP=4 rank's shard has the shape of a TP=2 rank's: first a TP=4 life, then a TP=2 life
    (cold, then with rank 1's root full), all on ``root: BASE/rank{rank}``."""
    from testing.tinymodel import TinyModelSpec, make_tiny_model

    model = make_tiny_model(TinyModelSpec(num_kv_heads=2))
    base = tmp_path_factory.mktemp("per-rank")
    cfg = {"model": model, "max_tokens": MAX_TOKENS, "block_size": BLOCK,
           "tensor_parallel_size": 2, "connector": "sparkcache",
           "extra": {"root": str(base / "rank{rank}"), "min_span_tokens": 64,
                     "max_bytes": "3MiB", "low_watermark_bytes": "2MiB"}}
    # each life waits for its publications to settle before it shuts down (see ``lives``)
    def settled(ranks: int) -> dict:
        return {"check_units": {"roots": [str(base / f"rank{r}") for r in range(ranks)], "ranks": ranks}}

    out = {"tp4": run_engine({**cfg, "prompts": SMALL[:1], "tensor_parallel_size": 4, **settled(4)},
                             timeout=600, env=_tp_env(4))}
    leases: list[str] = []
    # a writer beside the engine's on rank 1's root opens with their cap (every writer of a root
    # has one), then lifts its own check so that its filler can take the root over that cap
    full = PageStore(str(base / "rank1"), max_bytes=3 << 20, low_watermark_bytes=2 << 20)
    full.max_bytes = 1 << 40  # it publishes only (it runs no maintenance)

    def between(_phase: int, _done: list[dict]) -> None:
        out["roots"] = []
        for rank in (0, 1, 2, 3):
            store = PageStore(str(base / f"rank{rank}"), read_only=True)
            out["roots"].append(sorted(e.manifest.identity.tp_rank for e in store.catalog.entries()))
        # Rank 1's root goes over its cap, every entry in it pinned (maintenance can free
        # nothing): rank 1 serves the restore of the first prompt but refuses every
        # publication, rank 0's go through (two more prompts).
        for rank in (0, 1):  # another engine's entry, whole (both its shards): 3 MiB
            filler = Identity("filler", "x", BLOCK, rank, "lock")
            assert full.publish(filler, [f"f{i}" for i in range(4)], [bytes([rank]) * (3 << 19)],
                                blocks_per_page=4).ok
        leases.extend(full.lookup(e.manifest.identity, e.manifest.block_keys, lease=True).lease_id
                      for e in full.entries())

    out["cold"], out["restored"] = run_engine(
        {**cfg, "phases": [{"prompts": SMALL[:1]}, {"prompts": SMALL[:3]}], **settled(2)},
        timeout=900, env=_tp_env(), between=between)["phases"]
    for lease in leases:
        full.release(lease)
    return out


def test_each_rank_writes_its_own_root_and_the_scheduler_restores_from_both(per_rank_root_lives):
    """``root: /cache/rank{rank}``: each rank's worker publishes its shard under its own root;
    the scheduler reads both roots and offers the entry; the restore is identical."""
    assert per_rank_root_lives["roots"] == [[0, 0], [1, 1], [2], [3]]  # TP=4's and TP=2's shards
    restored = per_rank_root_lives["restored"]
    assert _records(restored)[0]["external_tokens"] == (1000 - 1) // BLOCK * BLOCK
    assert _tokens(restored)[:1] == _tokens(per_rank_root_lives["cold"])
    assert metric(restored, "vllm:sparkcache_restores", outcome="refused") == 0
    # each rank's root reports its own capacity (a rank label, not one rank over the other)
    used = [metric(restored, "vllm:sparkcache_capacity_used_bytes", rank=str(r)) for r in (0, 1)]
    assert used[0] > 0 and used[1] > 0


def test_shards_written_at_tp4_are_not_restored_at_tp2(per_rank_root_lives):
    """2 KV heads at TP=4 (each replicated on two ranks) and at TP=2: rank 0 and 1's shards
    have the same shape either way, but hold other heads' copies under another layout; the
    TP size is in the identity, so the TP=2 life restores nothing of TP=4's."""
    cold = per_rank_root_lives["cold"]
    assert _records(cold)[0]["external_tokens"] == 0
    assert metric(cold, "vllm:sparkcache_restored_tokens") == 0


def test_a_shard_whose_sibling_was_refused_is_removed_when_the_capture_settles(per_rank_root_lives):
    """Rank 1 refuses its publication (its root over the cap, nothing evictable), rank 0's
    goes through: once both reported, the scheduler removes rank 0's shard, so no root keeps
    an entry that can never be restored (and the next capture publishes both)."""
    life = per_rank_root_lives["restored"]
    _assert_units_whole_and_settled(life["results"])
    # vLLM's offline metrics hold what reached the frontend by the last request: the second
    # request's capture at least (the third's settles after its generate returned)
    assert metric(life, "vllm:sparkcache_captures", outcome="publish_failed") >= 1
    assert metric(life, "vllm:sparkcache_captures", outcome="published") >= 1
    assert metric(life, "vllm:sparkcache_lone_shards_removed") >= 1
