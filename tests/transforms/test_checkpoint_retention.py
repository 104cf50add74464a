"""checkpoint_retention: vLLM's real Scheduler on both trees.

Measured on vLLM 0.32.0 (block size 16, hybrid FA + Mamba align; prompt 40,
the next turn's prompt = prompt + the previous output + 20 new tokens):

                                     Mamba states hashed   per-group hits  next-turn local hit
pristine, retention 0, 30 output     [32]                  (64, 32)        32
pristine, dense retention (None)     [32, 48, 64]          (64, 64)        64   (the reference)
pristine, retention 0, 25 output,
  delayed free (ends on 64)          [32]                  (64, 32)        32
transformed, retention 0, both keys  [32, 64]              (64, 64)        64
  25 output, delayed free            [32, 64]              (64, 64)        64
transformed, retention 0, retain
  only (no drop)                     [32, 48, 64]          (64, 64)        64

Every hashed state past the prompt sits in the block the worker last wrote
the running state into, at exactly its hashed position (decode_states_invalid
is empty).
"""

from __future__ import annotations

import pytest

from transforms.checkpoint_retention import DROP_KEY, RETAIN_KEY, SCHEDULER, SINGLE_TYPE, TRANSFORM

pytestmark = [pytest.mark.slow]

SCENARIO = "testing.scenarios.checkpoint_retention"
OPTION_CONFIGS = [
    {RETAIN_KEY: "yes"},  # accepted as true before the one table
    {RETAIN_KEY: True, DROP_KEY: "no"},
    {DROP_KEY: "true"},  # checked even without the first key
    {RETAIN_KEY: 1},
    {RETAIN_KEY: True},
    {RETAIN_KEY: True, DROP_KEY: True},
    {RETAIN_KEY: False, DROP_KEY: True},
    {DROP_KEY: True},
]
SCENARIO_CALLS = [
    ("pristine", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True}),
    ("transformed", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True, "config_values": OPTION_CONFIGS}),
]


def test_transform_note_and_keys():
    assert TRANSFORM.id == "checkpoint_retention"
    assert TRANSFORM.why and TRANSFORM.what_changes and TRANSFORM.removal_plan
    assert set(TRANSFORM.config_keys) == {RETAIN_KEY, DROP_KEY} == {
        "sparkcache_retain_decode_checkpoint",
        "sparkcache_drop_superseded_checkpoint",
    }
    assert set(TRANSFORM.edits) == {SCHEDULER, SINGLE_TYPE}


def _summary(case: dict) -> tuple:
    return (
        case["mamba_state_positions"],
        tuple(case["per_group_hits"]),
        case["next_turn_local_hit"],
        case["next_turn_external"],
        case["next_turn_num_computed_tokens"],
    )


@pytest.fixture(scope="module")
def pristine(scenario):
    return scenario("pristine", SCENARIO, options_on=False)


def test_pristine_loses_the_decode_checkpoint(pristine):
    # Retention 0: only the prompt's replay boundary (32) is hashed; the next turn stops there
    # although attention is resident to 64.
    assert _summary(pristine["retention_0"]) == ([32], (64, 32), 32, 0, 32)
    assert _summary(pristine["ends_on_boundary_delayed_free"]) == ([32], (64, 32), 32, 0, 32)
    # Dense retention, the reference: the decode states at 48 and 64 are hashed; hit 64.
    assert _summary(pristine["dense_reference"]) == ([32, 48, 64], (64, 64), 64, 0, 64)
    assert all(not case.get("decode_states_invalid") for case in pristine.values() if isinstance(case, dict))


def test_pristine_loses_a_preempted_requests_state(pristine):
    # The pool preempts the 240-token prompt at 208 computed tokens: its attention blocks stay
    # hashed, the state the worker wrote at 208 does not, so it resumes from 0.
    case = pristine["preempted_mid_prefill"]
    assert case["preemptions"] == [{"at": 208, "state_hashed_at": None, "state_written_at": 208}]
    assert case["resumed_at"] == [0]


def test_transformed_keeps_a_preempted_requests_state(scenario):
    # The running state at the preemption point is hashed before the blocks go back, so the
    # request resumes locally where it stopped.
    case = scenario("transformed", SCENARIO, options_on=True)["preempted_mid_prefill"]
    assert case["preemptions"] == [{"at": 208, "state_hashed_at": 208, "state_written_at": 208}]
    assert case["resumed_at"] == [208]


def test_transformed_keeps_the_newest_decode_checkpoint(scenario, pristine):
    on = scenario("transformed", SCENARIO, options_on=True)
    # Retention 0 + both keys: 48 kept then dropped when 64 supersedes it; hit 64 like dense.
    assert _summary(on["retention_0"]) == ([32, 64], (64, 64), 64, 0, 64)
    # The run ends with the state at 64 in its running block; it survives _connector_finished
    # and the delayed free.
    assert _summary(on["ends_on_boundary_delayed_free"]) == ([32, 64], (64, 64), 64, 0, 64)
    # Without the drop key every decode boundary state stays hashed.
    assert _summary(on["retain_only"]) == ([32, 48, 64], (64, 64), 64, 0, 64)
    # Dense retention is untouched.
    assert on["dense_reference"] == pristine["dense_reference"]
    # Every kept state is the real state at its boundary.
    assert all(not case.get("decode_states_invalid") for case in on.values() if isinstance(case, dict))


def test_transformed_with_options_off_is_upstream(scenario, pristine):
    off = scenario("transformed", SCENARIO, options_on=False)
    assert off == pristine


def test_option_values_parsed_by_the_settings_table(scenario):
    result = scenario("transformed", SCENARIO, options_on=True, config_values=OPTION_CONFIGS)
    assert result["absent"] == {"error": None, "read": [False, False]}
    assert result["sparkcache_imported_without_options"] is False
    errors = [r["error"] for r in result["readings"][:4]]
    for error, (key, value) in zip(errors, [(RETAIN_KEY, "'yes'"), (DROP_KEY, "'no'"), (DROP_KEY, "'true'"), (RETAIN_KEY, "1")]):
        assert error and f"kv_connector_extra_config['{key}']={value}" in error and "JSON true/false only" in error, error
    assert [r["read"] for r in result["readings"][4:]] == [[True, False], [True, True], [False, False], [False, False]]
    assert all(r["error"] is None for r in result["readings"][4:])
