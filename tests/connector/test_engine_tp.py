"""Tensor parallel (TP=2) on the real CPU engine: every rank publishes its own shard of an
entry, the scheduler offers an entry only when every rank's shard is there, and a damaged or
missing shard on rank 1 heals (issue 18).

The tiny offline Llama (4 KV heads, 2 per rank), two 2,100-token prompts, one worker process
per rank, each on its own core (``VLLM_CPU_OMP_THREADS_BIND``), gloo and vLLM's shared-memory
all-reduce on loopback. One module-scoped sequence of engine lives on one store root:

1. TP=2, connector absent: the reference;
2. TP=2, read-write, cold: both prompts computed; each rank publishes its shard (4 entries);
3. TP=2 after a restart: both restored, identical; restored tokens counted once per request
   (not once per rank);
4. rank 1's shard of prompt A corrupted (one byte of one object) and rank 1's shard of
   prompt B deleted (its objects): A is offered, refused by rank 1 and recomputed on both
   ranks; B is not offered (its shard is gone); both outputs identical, both captured again;
5. TP=2 after that: both restored again, identical;
6. TP=1, restore-only, on the TP=2 store: nothing restored (another TP size holds other heads).

And the long-memory tiny NemotronH of ``test_engine_hybrid`` (Mamba2 + attention) at TP=2:
reference, cold, restored: each rank publishes and restores its pages and its share of the
recurrent state; tokens identical.
"""

from __future__ import annotations

import os

import pytest

from sparkcache.connector.keys import BlockKeys
from sparkcache.store import PageStore

from .conftest import long_prompt, metric, run_engine

BLOCK = 32
PROMPTS = [long_prompt(2100, seed=21), long_prompt(2100, seed=22)]
REUSABLE = (2100 - 1) // BLOCK * BLOCK  # 2,080
MAX_TOKENS = 16
CAPTURED_BLOCKS = (2100 + MAX_TOKENS - 1) // BLOCK  # a finished request's computed tokens: 66 blocks


def _tp_env() -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[1 % len(cpus)]}"  # one OpenMP core per rank ("auto" refuses one NUMA node)
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}


def _shard(root, prompt: list[int], tp_rank: int):
    """(store, the entry of ``prompt`` that ``tp_rank`` published)."""
    store = PageStore(str(root))
    store.index.refresh(force=True)
    key = BlockKeys(BLOCK).upto(prompt, REUSABLE // BLOCK)[-1]
    found = [e for e in store.index.entries.values() if e.manifest.identity.tp_rank == tp_rank
             and e.manifest.block_keys[REUSABLE // BLOCK - 1] == key]
    assert len(found) == 1, [(e.manifest.identity.tp_rank, e.manifest.block_count) for e in store.index.entries.values()]
    return store, found[0]


@pytest.fixture(scope="module")
def lives(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    env = _tp_env()
    base = {"model": tiny_model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "block_size": BLOCK,
            "tensor_parallel_size": 2}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    out = {"reference": run_engine({**base, "connector": "none"}, timeout=600, env=env),
           "cold": run_engine(rw, timeout=600, env=env)}
    store = PageStore(str(root))
    store.index.refresh(force=True)
    out["entries"] = sorted((e.manifest.identity.tp_rank, e.manifest.block_count)
                            for e in store.index.entries.values())
    out["restored"] = run_engine(rw, timeout=600, env=env)
    store, a = _shard(root, PROMPTS[0], 1)
    victim = store.objects.path(a.manifest.pages[len(a.manifest.pages) // 2].digest)
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    os.chmod(victim, 0o644)
    with open(victim, "wb") as f:
        f.write(data)
    store, b = _shard(root, PROMPTS[1], 1)
    _, a0 = _shard(root, PROMPTS[0], 0)
    shared = {p.digest for p in a0.manifest.pages}
    for page in b.manifest.pages:
        if page.digest not in shared:
            os.unlink(store.objects.path(page.digest))
    out["damaged"] = run_engine(rw, timeout=600, env=env)
    out["healed"] = run_engine(rw, timeout=600, env=env)
    out["tp1"] = run_engine({**rw, "tensor_parallel_size": 1,
                             "extra": {**rw["extra"], "access_mode": "restore-only"}}, timeout=600)
    return out


@pytest.fixture(scope="module")
def hybrid_lives(hybrid_model, tmp_path_factory):
    from .test_engine_hybrid import HYBRID, PROMPT

    root = tmp_path_factory.mktemp("hybrid-store")
    base = {"model": hybrid_model, "prompts": [PROMPT], **HYBRID, "tensor_parallel_size": 2}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    env = _tp_env()
    return {"reference": run_engine({**base, "connector": "none"}, timeout=600, env=env),
            "cold": run_engine(rw, timeout=600, env=env), "restored": run_engine(rw, timeout=600, env=env)}


def _records(result: dict) -> list[dict]:
    return [r["kv_transfer_params"]["sparkcache"] for r in result["results"]]


def _tokens(result: dict) -> list[list[int]]:
    return [r["tokens"] for r in result["results"]]


def test_every_rank_publishes_its_shard(lives):
    assert _tokens(lives["cold"]) == _tokens(lives["reference"])
    assert lives["entries"] == [(0, CAPTURED_BLOCKS)] * 2 + [(1, CAPTURED_BLOCKS)] * 2


def test_restart_restores_both_ranks_and_counts_each_request_once(lives):
    restored = lives["restored"]
    assert _tokens(restored) == _tokens(lives["reference"])
    assert [r["external_tokens"] for r in _records(restored)] == [REUSABLE, REUSABLE]
    assert metric(restored, "vllm:external_prefix_cache_hits") == 2 * REUSABLE
    assert metric(restored, "vllm:sparkcache_restored_tokens") == 2 * REUSABLE  # not x2 ranks
    assert metric(restored, "vllm:sparkcache_restores", outcome="ok") == 2
    assert metric(restored, "vllm:sparkcache_restores", outcome="refused") == 0


def test_a_damaged_or_missing_shard_on_rank_1_recomputes_then_heals(lives):
    damaged = lives["damaged"]
    assert _tokens(damaged) == _tokens(lives["reference"])
    corrupt, missing = _records(damaged)
    # A: rank 0's shard read and placed, rank 1's refused: vLLM recomputes on both ranks
    assert (corrupt["external_tokens"], corrupt["failed_restores"], corrupt["recomputed_tokens"]) == (0, 1, 2100)
    # B: rank 1's shard is gone, so nothing is offered (no read, no refusal)
    assert (missing["external_tokens"], missing["failed_restores"], missing["recomputed_tokens"]) == (0, 0, 2100)
    assert metric(damaged, "vllm:sparkcache_restores", outcome="refused") == 1
    assert metric(damaged, "vllm:sparkcache_quarantined_objects") == 1
    healed = lives["healed"]
    assert _tokens(healed) == _tokens(lives["reference"])
    assert [r["external_tokens"] for r in _records(healed)] == [REUSABLE, REUSABLE]


def test_another_tp_size_restores_nothing(lives):
    tp1 = lives["tp1"]
    assert [r["external_tokens"] for r in _records(tp1)] == [0, 0]
    assert metric(tp1, "vllm:sparkcache_restored_tokens") == 0


def test_a_hybrid_model_at_tp2_restores_pages_and_state_with_identical_tokens(hybrid_lives):
    from .test_engine_hybrid import REUSABLE as HYBRID_REUSABLE

    assert _tokens(hybrid_lives["cold"]) == _tokens(hybrid_lives["reference"])
    restored = hybrid_lives["restored"]
    assert _tokens(restored) == _tokens(hybrid_lives["reference"])
    assert [r["external_tokens"] for r in _records(restored)] == [HYBRID_REUSABLE]
    assert metric(restored, "vllm:sparkcache_state_restores", outcome="ok") == 1  # once, not per rank
    assert metric(restored, "vllm:sparkcache_restored_bytes", kind="state") > 0
