"""vLLM's own ``ExampleConnector`` hands a flipped byte to the model; sparkcache refuses it.

One engine life in three rounds on one ``shared_storage_path``, CPU, tiny model, each round
after the first on an emptied GPU prefix cache (contracts/engine_driver.py, ``"phases"``):

1. cold: ExampleConnector stores the prompt's KV as one safetensors file per layer;
2. files intact: the KV is loaded (vLLM counts the external hit) and the output is
   the cold run's (so the connector works here and any later difference is the flip's);
3. one byte of one stored file flipped (the top byte of one float32 value, in the data
   region, not the header): the file still loads without any error, the loaded tensor
   differs from the stored one in exactly that value, vLLM again counts the external hit,
   and the generated tokens differ from the reference — the corrupt bytes reached the model.

sparkcache under the same kind of corruption (one byte of one stored object flipped):
``tests/connector/test_engine_restore.py::test_flipped_byte_is_refused_and_recomputed`` —
the restore is refused by the sha256 check, nothing is placed, the request recomputes, the
output equals the reference and ``vllm:sparkcache_load_failures`` moves.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from .conftest import long_prompt, metric, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
PROMPT = long_prompt(300, seed=7)
LOADED = (len(PROMPT) - 1) // BLOCK * BLOCK  # ExampleConnector loads whole blocks of prompt[:-1]


def _flip(path: Path) -> tuple[int, int]:
    """Flip bit 0x40 of the top byte of one float32 in the data region; return (element, offset)."""
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    data_start = 8 + header_len
    n_elems = (len(raw) - data_start) // 4
    elem = n_elems // 2 + 40  # a middle token; last-dim channel well inside the row
    offset = data_start + 4 * elem + 3  # little-endian: byte 3 holds the sign and exponent
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))
    return elem, offset


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    import safetensors.torch as st

    storage = tmp_path_factory.mktemp("example_store")
    out = {}

    def between(phase: int, _done: list[dict]) -> None:
        files = sorted(storage.rglob("*.safetensors"))
        if phase == 1:
            out["files"] = [str(f) for f in files]
            return
        victim = files[-1]  # the last attention layer's file
        before = st.load_file(str(victim))["kv_cache"].clone()
        out["flip"] = _flip(victim)
        after = st.load_file(str(victim))["kv_cache"]  # loads without error
        out["changed_elems"] = int((before.flatten() != after.flatten()).sum())
        out["changed_value"] = (float(before.flatten()[out["flip"][0]]), float(after.flatten()[out["flip"][0]]))

    cfg = {"model": tiny_model, "max_tokens": 16, "block_size": BLOCK, "connector": "example",
           "example_path": str(storage), "phases": [{"prompts": [PROMPT]}] * 3}
    out["cold"], out["intact"], out["corrupt"] = run_engine(cfg, between=between)["phases"]
    return out


def test_example_connector_stores_and_restores_intact(runs):
    assert len(runs["files"]) == 2, runs["files"]  # one file per attention layer of the tiny model
    cold, intact = runs["cold"]["results"][0], runs["intact"]["results"][0]
    assert cold["num_cached_tokens"] == 0
    assert intact["num_cached_tokens"] == LOADED
    assert metric(runs["intact"], "vllm:external_prefix_cache_hits") == LOADED
    assert intact["tokens"] == cold["tokens"]


def test_example_connector_feeds_a_flipped_byte_to_the_model(runs):
    assert runs["changed_elems"] == 1, runs["changed_elems"]  # the loaded tensor differs, no error
    print("flipped value:", runs["changed_value"])
    corrupt = runs["corrupt"]["results"][0]
    assert corrupt["num_cached_tokens"] == LOADED  # the corrupt file was loaded as a hit
    assert metric(runs["corrupt"], "vllm:external_prefix_cache_hits") == LOADED
    assert corrupt["tokens"] != runs["cold"]["results"][0]["tokens"], \
        "the flipped byte did not change the output"
