"""Hybrid models end to end on the real CPU engine: attention pages plus recurrent (Mamba2)
state are published, restored after a restart and refused when damaged.

Two architectures, each a tiny model made offline (``testing.tinymodel.make_tiny_hybrid``)
in fp32 with a long-memory SSM, so the recurrent state decides the output (the tests show that
a restore with the right pages and a zeroed state gives other tokens): NemotronH (Mamba2,
attention, Mamba2, MLP, Mamba2, attention) and GraniteMoeHybrid, dense (Mamba2, attention,
Mamba2, attention; its Mamba layers are ``mamba``, not ``mixer``, with their own MLP). vLLM runs with prefix caching on, ``mamba_cache_mode
"align"``, block size 64 and ``max_num_batched_tokens`` 64 (vLLM's CPU Mamba2 chunk scan
needs prefill chunks that end on block boundaries).

Per architecture, one module-scoped sequence on one store root, in three engine lives (steps 2-4
in one life, each round on an emptied GPU prefix cache, so it finds only what the connector
restores; contracts/engine_driver.py, ``"phases"``):

1. read-write, cold: the 1,100-token prompt is computed (nothing restored: the reference tokens
   and logprobs, equal to a connector-absent life's: for NemotronH that life is
   test_engine_hybrid_conversation's, for GraniteMoeHybrid one here); the entry at its last full block (1,088 tokens) is published with the state of
   all three Mamba layers;
2. read-write after a restart: restored to 1,088 tokens (vLLM's counter, the attribution
   record and the connector's own), tokens identical, logprobs within 1e-5;
3. one byte of the stored state flipped while the engine runs: refused before anything is
   placed, recomputed with identical output, the object removed and written again by this
   request's capture;
4. then: restored again, identical;
5. restore-only after the entry was rewritten with a zeroed state (a valid object): the
   restore happens and the tokens differ, so a wrong state cannot pass unnoticed.
"""

from __future__ import annotations

import pytest

from sparkcache.store import PageStore

from .conftest import flip_byte, long_prompt, metric, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 64
PROMPT = long_prompt(1100, seed=3)
REUSABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # 1,088: whole blocks, never the last token
HYBRID = {"block_size": BLOCK, "max_num_batched_tokens": BLOCK, "mamba_cache_mode": "align",
          "logprobs": True, "max_tokens": 16}


@pytest.fixture(scope="module", params=["nemotron_h", "granitemoehybrid"])
def spec(request):
    from testing.tinymodel import TINY_GRANITE_HYBRID, TINY_HYBRID

    return {"nemotron_h": TINY_HYBRID, "granitemoehybrid": TINY_GRANITE_HYBRID}[request.param]


def _state_entry(root) -> tuple[PageStore, object]:
    store = PageStore(str(root))
    store.catalog.refresh(full=True)
    entries = [e for e in store.catalog.entries() if e.manifest.state is not None]
    assert len(entries) == 1, [e.manifest.block_count for e in store.catalog.entries()]
    return store, entries[0]


@pytest.fixture(scope="module")
def runs(spec, tmp_path_factory):
    from testing.tinymodel import TINY_HYBRID, make_tiny_hybrid

    root = tmp_path_factory.mktemp("store")
    base = {"model": make_tiny_hybrid(spec), "prompts": [PROMPT], **HYBRID}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": BLOCK}}
    # The cold life (restores nothing: asserted) is the reference every restore is compared with.
    # That a connector which restores nothing leaves the output as vLLM's alone is shown once per
    # architecture: for TINY_HYBRID by test_engine_hybrid_conversation's connector-absent life,
    # for the others here.
    out = {"cold": run_engine(rw)}
    if spec != TINY_HYBRID:
        out["absent"] = run_engine({**base, "connector": "none"})
    store, entry = _state_entry(root)
    out["entry"] = (entry.manifest.block_count, entry.manifest.state.size)

    def between(phase: int, _done: list[dict]) -> None:
        if phase == 1:  # after the restore: one byte of the stored state flipped
            flip_byte(store.objects.path(entry.manifest.state.digest), 3)
            return
        try:  # removed as corrupt, then written again by the refused request's own capture
            store.objects.check_verified(entry.manifest.state.digest, entry.manifest.state.size)
            out["state_rewritten"] = True
        except Exception as exc:
            out["state_rewritten"] = repr(exc)

    later = run_engine({**rw, "phases": [{"prompts": [PROMPT]}] * 3}, between=between)
    out["restored"], out["corrupt"], out["healed"] = later["phases"]
    store, entry = _state_entry(root)
    m = entry.manifest
    pages = [bytes(p) for p in store.objects.read_many_verified(list(m.pages))]
    zeroed = store.publish(m.identity, list(m.block_keys), pages, blocks_per_page=m.blocks_per_page,
                           state=bytes(m.state.size))
    assert zeroed.ok, zeroed
    out["zeroed"] = run_engine({**rw, "extra": {**rw["extra"], "access_mode": "restore-only"}})
    return out


def _one(result: dict) -> dict:
    return result["results"][0]


def _record(result: dict) -> dict:
    return _one(result)["kv_transfer_params"]["sparkcache"]


def _same_output(result: dict, reference: dict) -> None:
    got, want = _one(result), _one(reference)
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= 1e-5


def test_cold_run_publishes_pages_with_the_recurrent_state(runs, spec):
    if "absent" in runs:
        _same_output(runs["cold"], runs["absent"])
    rec = _record(runs["cold"])
    assert (rec["external_tokens"], rec["recomputed_tokens"]) == (0, len(PROMPT))
    blocks, state_bytes = runs["entry"]
    assert blocks * BLOCK == REUSABLE
    # per Mamba layer: conv state (3 x 288) and SSM state (16 heads x 16 x 16), fp32 each
    assert state_bytes == spec.pattern.count("M") * (3 * 288 + 16 * 16 * 16) * 4
    assert metric(runs["cold"], "vllm:sparkcache_captured_bytes", kind="state") == state_bytes


def test_restart_restores_pages_and_state_with_identical_output(runs):
    restored = runs["restored"]
    _same_output(restored, runs["cold"])
    rec = _record(restored)
    assert (rec["local_hit_tokens"], rec["external_tokens"], rec["recomputed_tokens"]) == (
        0, REUSABLE, len(PROMPT) - REUSABLE)
    assert metric(restored, "vllm:external_prefix_cache_hits") == REUSABLE
    assert metric(restored, "vllm:sparkcache_restored_tokens") == REUSABLE
    assert metric(restored, "vllm:sparkcache_restores", outcome="ok") == 1
    assert metric(restored, "vllm:sparkcache_state_restores", outcome="ok") == 1
    assert metric(restored, "vllm:sparkcache_restored_bytes", kind="state") == runs["entry"][1]


def test_a_flipped_byte_in_the_state_is_refused_recomputed_and_healed(runs):
    corrupt = runs["corrupt"]
    _same_output(corrupt, runs["cold"])
    rec = _record(corrupt)
    assert rec["external_tokens"] == 0 and rec["failed_restores"] == 1
    assert rec["recomputed_tokens"] == len(PROMPT)
    assert metric(corrupt, "vllm:sparkcache_restores", outcome="refused") == 1
    assert metric(corrupt, "vllm:sparkcache_quarantined_objects") == 1
    assert metric(corrupt, "vllm:sparkcache_state_restores", outcome="refused") == 1
    assert runs["state_rewritten"] is True
    healed = runs["healed"]
    _same_output(healed, runs["cold"])
    assert _record(healed)["external_tokens"] == REUSABLE


def test_a_wrong_state_changes_the_output(runs):
    """The control: same pages, zeroed (valid, checksummed) state, restored to the same depth."""
    zeroed = runs["zeroed"]
    assert _record(zeroed)["external_tokens"] == REUSABLE
    assert _one(zeroed)["tokens"] != _one(runs["cold"])["tokens"]
