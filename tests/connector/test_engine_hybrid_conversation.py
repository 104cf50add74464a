"""A growing hybrid-model conversation with all three scheduler transforms on and an engine
restart between turns 2 and 3: turn 3 comes back from the store (pages and recurrent state),
and every turn's output equals a connector-disabled run.

The tiny long-memory NemotronH of ``test_engine_hybrid`` (block size 64); four turns: a
1,100-token opening, then 80 new tokens per turn, 16 output tokens each. Three engine lives,
each in its own process: the reference (pristine vLLM, no connector, all four turns); turns
1-2 on the transformed vLLM with the connector read-write; turns 3-4 after a restart.
"""

from __future__ import annotations

import pytest

from testing.scenarios.growing_conversation import ALL_OPTIONS

from .conftest import long_prompt, metric, run_engine
from .test_engine_hybrid import BLOCK, HYBRID

pytestmark = [pytest.mark.engine, pytest.mark.slow]

OPENING = long_prompt(1100, seed=5)
TURNS = [OPENING] + [long_prompt(80, seed=10 + k) for k in range(3)]


@pytest.fixture(scope="module")
def lives(hybrid_model, transformed_tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    base = {"model": hybrid_model, **HYBRID, "chain": True}
    rw = {**base, "connector": "sparkcache",
          "extra": {"root": str(root), "min_span_tokens": BLOCK, **ALL_OPTIONS}}
    on_transformed = {"PYTHONPATH": str(transformed_tree)}
    reference = run_engine({**base, "connector": "none", "prompts": TURNS})
    first = run_engine({**rw, "prompts": TURNS[:2]}, env=on_transformed)
    history = first["results"][1]["prompt"] + first["results"][1]["tokens"]
    second = run_engine({**rw, "prompts": [history + TURNS[2], TURNS[3]]}, env=on_transformed)
    return {"reference": reference["results"], "turns": first["results"] + second["results"],
            "second": second, "first": first}


def test_every_turn_equals_the_connector_disabled_run(lives):
    assert [t["prompt"] for t in lives["turns"]] == [t["prompt"] for t in lives["reference"]]
    for k, (got, want) in enumerate(zip(lives["turns"], lives["reference"]), start=1):
        assert got["tokens"] == want["tokens"], f"turn {k}"
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= 1e-5, f"turn {k}"


def test_turn_two_keeps_its_local_hit_and_turn_three_is_restored_after_the_restart(lives):
    records = [t["kv_transfer_params"]["sparkcache"] for t in lives["turns"]]
    # Turn 2 runs in the same life: the transforms keep turn 1's prefix resident.
    assert records[1]["local_hit_tokens"] >= len(OPENING) // BLOCK * BLOCK
    assert records[1]["external_tokens"] == 0
    # Turn 3, after the restart: nothing is resident; the deepest stored state that fits is
    # turn 2's prompt boundary (captured in life 1), restored with its pages.
    turn2_boundary = lives["turns"][1]["prompt_tokens"] // BLOCK * BLOCK
    assert records[2]["local_hit_tokens"] == 0
    assert records[2]["external_tokens"] >= turn2_boundary
    assert records[2]["external_tokens"] % BLOCK == 0
    assert metric(lives["second"], "vllm:sparkcache_state_restores", outcome="ok") >= 1
    # Turn 4 continues locally.
    assert records[3]["local_hit_tokens"] >= records[2]["external_tokens"]
