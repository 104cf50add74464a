"""prefer_local_prefix: vLLM's real Scheduler on both trees.

Measured on vLLM 0.32.0 (block size 16, hybrid FA + Mamba align, retention 0;
attention resident to 64, Mamba state only at 16, a 100-token continuation):

pristine                 local  external  reused/4  resume
  store 80, default        16      64        1        80
  store 80, divergent      64      16        4        80
  store 64, default        16      48        1        64
  store 64, divergent      16       0        1        16   (tie: recomputes 84 tokens)
transformed, option on
  store 80 (both)          64      16        4        80
  store 64 (both)          48      16        3        64   (last block + Mamba state at 64)
  store 0  (both)          16       0        1        16

Second shape: attention resident to 48 only, the Mamba state at 80 (no common depth):
pristine (both lookups)  local  external  reused/3  resume
  store 96                  0      96        0        96   (3 resident blocks reloaded)
  store 48                  0      48        0        48
transformed, option on
  store 96 (both)          48      48        3        96
  store 48 (both)          32      16        2        48   (last block + Mamba state at 48)
  store 0  (both)           0       0        0         0
"""

from __future__ import annotations

import pytest

from transforms.prefer_local_prefix import KEY, TRANSFORM

pytestmark = [pytest.mark.slow]

SCENARIO = "testing.scenarios.prefer_local_prefix"
# The string "false" used to turn the transform on (bool("false")); now only JSON booleans.
OPTION_VALUES = ["false", "true", "", 0, 1, None, True, False]
SCENARIO_CALLS = [
    ("pristine", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True}),
    ("transformed", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True, "config_values": OPTION_VALUES}),
]


def test_transform_note_and_key():
    assert TRANSFORM.id == "prefer_local_prefix"
    assert TRANSFORM.why and TRANSFORM.what_changes and TRANSFORM.removal_plan
    assert set(TRANSFORM.config_keys) == {KEY} == {"sparkcache_prefer_local_prefix"}


@pytest.fixture(scope="module")
def pristine(scenario):
    return scenario("pristine", SCENARIO, options_on=False)


def _hit(case: dict) -> tuple[int, int, int, int]:
    return case["local"], case["external"], case["reused_resident_attention_blocks"], case["resume"]


def test_pristine_reloads_resident_attention(pristine):
    # "Served by restore": 3 of 4 resident attention blocks reloaded into fresh duplicates.
    assert _hit(pristine["store80_default"]) == (16, 64, 1, 80)
    assert _hit(pristine["store64_default"]) == (16, 48, 1, 64)
    # Upstream's divergent-hit path fixes the longer store ...
    assert _hit(pristine["store80_divergent"]) == (64, 16, 4, 80)
    # ... but a tie falls back to the hybrid depth and recomputes.
    assert _hit(pristine["store64_divergent"]) == (16, 0, 1, 16)
    assert _hit(pristine["store0_default"]) == (16, 0, 1, 16)
    # Attention shallower than a surviving Mamba checkpoint: both lookups ask the store from 0
    # and reload every resident attention block.
    for path in ("default", "divergent"):
        assert _hit(pristine[f"deepmamba_store96_{path}"]) == (0, 96, 0, 96)
        assert _hit(pristine[f"deepmamba_store48_{path}"]) == (0, 48, 0, 48)
    assert all(case["valid"] for case in pristine.values())


def test_transformed_prefers_local_attention_depth(scenario, pristine):
    on = scenario("transformed", SCENARIO, options_on=True)
    for path in ("default", "divergent"):
        # Store past the local depth: only (64, 80] is loaded; nothing resident is reloaded.
        assert _hit(on[f"store80_{path}"]) == (64, 16, 4, 80)
        assert on[f"store80_{path}"]["connector_queries"][-1] == [64, 16]
        # Tie: resume at 64 (not 16), loading the last block with the Mamba state at 64.
        assert _hit(on[f"store64_{path}"]) == (48, 16, 3, 64)
        assert on[f"store64_{path}"]["connector_queries"][-1] == [48, 16]
        # Nothing in the store: the hybrid hit, no external claim.
        assert _hit(on[f"store0_{path}"]) == (16, 0, 1, 16)
        # Attention resident to 48, Mamba state at 80: take the 3 resident blocks, load (48, 96].
        assert _hit(on[f"deepmamba_store96_{path}"]) == (48, 48, 3, 96)
        assert on[f"deepmamba_store96_{path}"]["connector_queries"][-1] == [48, 48]
        assert _hit(on[f"deepmamba_store48_{path}"]) == (32, 16, 2, 48)
        assert _hit(on[f"deepmamba_store0_{path}"]) == (0, 0, 0, 0)
    for name, case in on.items():
        # Correctness: every token reported computed is resident or loaded, and the
        # resume point has a valid Mamba state; never worse than pristine on reuse or depth.
        assert case["valid"], name
        assert case["num_computed_tokens"] == case["resume"], name
        assert case["reused_resident_attention_blocks"] >= pristine[name]["reused_resident_attention_blocks"], name
        assert case["resume"] >= pristine[name]["resume"], name


def test_transformed_option_off_is_upstream(scenario, pristine):
    off = scenario("transformed", SCENARIO, options_on=False)
    assert off == pristine


def test_option_values_parsed_by_the_settings_table(scenario):
    values = OPTION_VALUES
    result = scenario("transformed", SCENARIO, options_on=True, config_values=values)
    assert result["absent"] == {"error": None, "read": False}
    assert result["sparkcache_imported_without_options"] is False
    readings = dict(zip(map(repr, values), result["readings"]))
    for bad in ("'false'", "'true'", "''", "0", "1", "None"):
        error = readings[bad]["error"]
        assert error and f"kv_connector_extra_config['sparkcache_prefer_local_prefix']={bad}" in error, (bad, error)
        assert "JSON true/false only" in error and readings[bad]["read"] is None, error
    assert readings["True"] == {"error": None, "read": True}
    assert readings["False"] == {"error": None, "read": False}
