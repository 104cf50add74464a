"""A sliding-window model (Gemma 3: windowed and full layers) stored and restored on the real CPU engine,
as vLLM runs it by default (the hybrid KV cache manager on: a ``SlidingWindowSpec`` group and a
``FullAttentionSpec`` group; an entry is the full layers' pages and, in its boundary object,
the window before its end) and with the manager off (``--disable-hybrid-kv-cache-manager``:
vLLM builds one ``FullAttentionSpec`` group with the window in it and keeps every block, so
an entry is every block's pages).

The models are ``testing.tinymodel.make_tiny_field_model``'s (the field recipes, window 64, real
random weights): Gemma 3 both ways, gpt-oss (its sinks are weights, not KV) and Mistral, every
layer of which is windowed (its entry is its windows; its pages hold no bytes). At 403da3e
every window group was refused. Each prints the bytes an entry holds. On one store root:

1. connector absent: the reference tokens and logprobs of A, B, C and D;
2. read-write, cold: A and B computed and published;
3. an entry forged with the store's own writer under the engine's identity: C's block keys over
   B's pages (what any writer of the root can do; the store checks bytes against their names);
4. after a restart, A and B restored to the stored reusable prefix (whole blocks, never the
   last prompt token): the reference's tokens, logprobs within 1e-5; then C restored from the
   forged entry to the same depth: its tokens differ from the reference, so a wrong KV cache
   changes the output and 4's equality means something. With the window group, D (A's prefix
   but its last block, another tail) is restored from an entry of A's right pages and a window
   of zeros: its output differs from its reference too, so the window is read from the store.
"""

from __future__ import annotations

import pytest

from .conftest import forge_entry, long_prompt, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
LENGTH = 600  # several windows (64 tokens)
A, B, C = (long_prompt(LENGTH, seed=s) for s in (71, 72, 73))
REUSABLE = (LENGTH - 1) // BLOCK * BLOCK
# A's first blocks but one, then another tail: restored from an entry forged with A's pages and
# a window of zeros (window group only), so the window's bytes are shown to matter
D = A[:REUSABLE - BLOCK] + long_prompt(LENGTH - REUSABLE + BLOCK, seed=74)
LOGPROB_TOL = 1e-5


@pytest.mark.parametrize("name,hma", [("gemma3", True), ("gemma3", False), ("gpt-oss", True), ("mistral", True)],
                         ids=["gemma3-window-group", "gemma3-manager-off", "gpt-oss-window-group", "mistral"])
def test_a_sliding_window_model_restores_with_identical_output(name, hma, tmp_path):
    from testing.tinymodel import make_tiny_field_model

    # the page layers: the full-attention layer alone, both in one group with the window in it,
    # or none (Mistral: every layer windowed, its pages hold no bytes)
    layers = {"mistral": 0}.get(name, 1 if hma else 2)
    root = tmp_path / "store"
    base = {"model": make_tiny_field_model(name), "max_tokens": 16, "block_size": BLOCK, "logprobs": True,
            "disable_hybrid_kv_cache_manager": not hma}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    reference = run_engine({**base, "connector": "none", "prompts": [A, B, C, D]})["results"]
    cold = run_engine({**rw, "prompts": [A, B]})
    assert [r["num_cached_tokens"] for r in cold["results"]] == [0, 0]
    print(f"{name} ({'window group' if hma else 'manager off'}): an entry of {REUSABLE} tokens holds "
          f"{_entry_bytes(root, A)} bytes (pages, boundary object)")
    forge_entry(root, C, B, BLOCK, REUSABLE // BLOCK, layers)
    forged_prompts = [C]
    if hma:
        forge_entry(root, D, A, BLOCK, REUSABLE // BLOCK - 1, layers, zeroed_boundary=True)
        forged_prompts.append(D)
    restored, forged = run_engine({**rw, "phases": [{"prompts": [A, B]}, {"prompts": forged_prompts}]})["phases"]

    records = [r["kv_transfer_params"]["sparkcache"] for r in restored["results"]]
    assert [r["external_tokens"] for r in records] == [REUSABLE, REUSABLE], records
    assert [r["num_cached_tokens"] for r in restored["results"]] == [REUSABLE, REUSABLE]
    assert [r["tokens"] for r in restored["results"]] == [r["tokens"] for r in reference[:2]]
    gap = max(abs(x - y) for r, ref in zip(restored["results"], reference[:2])
              for x, y in zip(r["logprobs"], ref["logprobs"], strict=True))
    print(f"{name} ({'window group' if hma else 'manager off'}): restored logprobs within {gap:.2e} "
          "of the reference")
    assert gap <= LOGPROB_TOL
    # the forged entry is restored (to the same depth) and changes the output
    c = forged["results"][0]
    assert c["num_cached_tokens"] == REUSABLE
    assert c["tokens"] != reference[2]["tokens"]
    if hma:  # right pages, a window of zeros: restored, and the output changes
        d = forged["results"][1]
        assert d["num_cached_tokens"] == REUSABLE - BLOCK
        assert d["tokens"] != reference[3]["tokens"]


def _entry_bytes(root, prompt: list[int]) -> tuple[int, int]:
    """(page bytes, boundary-object bytes) of ``prompt``'s entry: what the window saves
    against storing every block (docs/CONNECTOR.md, "Layouts vLLM 0.32.0 builds")."""
    from sparkcache.store import PageStore

    from .conftest import stored_entry

    store = PageStore(str(root))
    try:
        m = stored_entry(store, prompt, BLOCK, REUSABLE // BLOCK).manifest
        return sum(p.size for p in m.pages), (m.state.size if m.state is not None else 0)
    finally:
        store.close()
