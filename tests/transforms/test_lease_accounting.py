"""lease_accounting: vLLM's real Scheduler on both trees.

Measured on vLLM 0.32.0 (block size 16, hybrid FA + Mamba align, retention 0,
100 blocks; prompt range(100, 180), 5 output tokens, ProbeConnector delaying
the free until finished_sending; the next turn = prompt + reply + 32 tokens):

                              Mamba@64 retired   free-queue position after release    next turn
                              (ref 1 -> 0) at    checkpoint   attention blocks        per-group    local hit
pristine                      computed=81        93           94..98 (0-15 at 98)     (80, 0)      0
transformed, lease on         computed=81        98 (last)    93..97                  (80, 64)     64
  (held with ref 1 during the lease; 8 leased blocks: 6 attention, 1 Mamba, the checkpoint)

The synchronous Scheduler retires the checkpoint when the first decode step is
scheduled (computed 81 = 80 prompt tokens + the first sampled one); DESIGN.md's
computed=82 counts one step later, as the asynchronous scheduler does, whose
processed-token basis lags one in-flight token.

Pressure = a real allocation of every free block queued ahead of the
request's attention blocks (94 pristine, 93 transformed), so every attention
block stays resident. Expiry (30 s lease, fake clock, no finished_sending):
pristine holds the blocks and keeps the engine busy; transformed frees them at
the next step's start. A second finished_sending: pristine AssertionError,
transformed ignored and counted.
"""

from __future__ import annotations

import copy

import pytest

from testing.scenarios.lease_accounting import NUM_BLOCKS
from transforms.lease_accounting import LEASE_KEY, SCHEDULER, SINGLE_TYPE, STATS, TRANSFORM

pytestmark = [pytest.mark.slow]

SCENARIO = "testing.scenarios.lease_accounting"
# The injected code calls sparkcache.settings.transform_option: the connector's own row.
LEASE_VALUES = [float("nan"), float("inf"), "5", True, None, 0, -1, "soon", 0.0001, 86401, 2.5, 30]
SCENARIO_CALLS = [
    ("pristine", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True}),
    ("transformed", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True, "config_values": LEASE_VALUES}),
]


def test_transform_note_and_keys():
    assert TRANSFORM.id == "lease_accounting"
    assert TRANSFORM.why and TRANSFORM.what_changes and TRANSFORM.removal_plan
    assert set(TRANSFORM.config_keys) == {LEASE_KEY} == {"sparkcache_gpu_lease_seconds"}
    assert set(TRANSFORM.edits) == {SCHEDULER, SINGLE_TYPE, STATS}


@pytest.fixture(scope="module")
def pristine(scenario):
    return scenario("pristine", SCENARIO, options_on=False)


@pytest.fixture(scope="module")
def leased(scenario):
    return scenario("transformed", SCENARIO, options_on=True)


def test_pristine_evicts_the_retired_checkpoint_first(pristine):
    case = pristine["checkpoint_eviction"]
    assert case["checkpoint_retired_at_computed"] == 81  # the first decode step (sync scheduler)
    assert case["during_lease"] == {
        "held": True,
        "checkpoint_ref_cnt": 0,
        "leased_blocks": None,
        "stats_leased_blocks": None,
    }
    after = case["after_release"]
    # Queued ahead of every attention block of its prefix: evicted first.
    assert after["checkpoint_position"] < min(after["attention_positions"])
    assert (after["checkpoint_position"], after["first_attention_block_position"]) == (93, 98)
    assert case["evicted_oldest_free_blocks"] == min(after["attention_positions"]) == 94
    assert case["checkpoint_survived"] is False
    assert case["next_turn_per_group_hits"] == {"attention": 80, "mamba": 0}
    assert case["next_turn_external"] == [0]
    assert case["next_turn_local_hit"] == 0


def test_pristine_leaks_without_report_and_asserts_on_a_late_one(pristine):
    case = pristine["expiry"]
    assert case["held_after_deadline_step"] is True
    assert case["engine_busy_after_deadline_step"] is True
    assert case["free_blocks_after_deadline_step"] == case["free_blocks_at_finish"] < case["free_blocks_total"]
    assert case["release_error"] is None  # the first report frees the blocks
    assert case["late_report_error"] in ("AssertionError", "KeyError")  # KeyError under python -O


def test_lease_holds_the_checkpoint_and_frees_it_last(leased):
    case = leased["checkpoint_eviction"]
    assert case["checkpoint_retired_at_computed"] == 81
    assert case["during_lease"] == {
        "held": True,
        "checkpoint_ref_cnt": 1,
        "leased_blocks": 8,  # 6 attention + the running Mamba block + the re-referenced checkpoint
        "stats_leased_blocks": 8,
    }
    after = case["after_release"]
    assert after["leased_blocks"] == 0
    assert after["checkpoint_position"] > max(after["attention_positions"])
    assert after["checkpoint_position"] == after["free_queue_len"] - 1  # the newest free block
    assert case["checkpoint_survived"] is True
    assert case["next_turn_per_group_hits"] == {"attention": 80, "mamba": 64}
    assert case["next_turn_external"] == [0]
    assert case["next_turn_local_hit"] == 64


def test_lease_expires_at_step_start_and_ignores_a_late_report(leased):
    case = leased["expiry"]
    assert case["held_after_deadline_step"] is False
    assert case["engine_busy_after_deadline_step"] is False
    assert case["expired_leases"] == 1
    assert case["free_blocks_after_deadline_step"] == case["free_blocks_total"]
    assert "release_error" not in case
    assert case["late_report_error"] is None
    assert case["late_reports_ignored"] == 1
    assert case["free_blocks_after_late_report"] == case["free_blocks_total"]


def _counters(result: dict) -> dict:
    """Pop the transform's own counters (None on the pristine tree); the rest is behaviour."""
    eviction, expiry, aborted = result["checkpoint_eviction"], result["expiry"], result["aborted_during_load"]
    return {
        "leased_blocks_after_abort": aborted.pop("leased_blocks_after_abort"),
        "expired_leases_after_abort": aborted.pop("expired_leases"),
        "leased_blocks": eviction["during_lease"].pop("leased_blocks"),
        "stats_leased_blocks": eviction["during_lease"].pop("stats_leased_blocks"),
        "leased_blocks_after_release": eviction["after_release"].pop("leased_blocks"),
        "expired_leases": expiry.pop("expired_leases"),
        "late_reports_ignored": expiry.pop("late_reports_ignored"),
    }


def test_option_absent_is_upstream(scenario, pristine):
    off = scenario("transformed", SCENARIO, options_on=False)
    counters = _counters(off)
    assert counters.pop("stats_leased_blocks") == 0  # the new SchedulerStats field: nothing leased
    assert set(counters.values()) == {None}  # no GpuLeases attached: nothing to lease, expire or ignore
    upstream = copy.deepcopy(pristine)
    assert set(_counters(upstream).values()) == {None}
    assert off == upstream


def test_lease_values_parsed_by_the_settings_table(scenario):
    values = LEASE_VALUES
    result = scenario("transformed", SCENARIO, options_on=True, config_values=values)
    assert result["absent"] == {"error": None, "read": None}  # upstream: no deadline
    assert result["sparkcache_imported_without_options"] is False
    readings = dict(zip(map(repr, values), result["readings"]))
    for bad in ("nan", "inf", "'5'", "True", "None", "0", "-1", "'soon'", "0.0001", "86401"):
        error = readings[bad]["error"]
        assert error and f"kv_connector_extra_config['sparkcache_gpu_lease_seconds']={bad}" in error, (bad, error)
        assert "a finite JSON number 0.001 .. 86400" in error, error
    assert readings["2.5"] == {"error": None, "read": 2.5}
    assert readings["30"] == {"error": None, "read": 30.0}


def test_pristine_holds_an_aborted_loads_blocks_until_finished_recving(pristine):
    case = pristine["aborted_during_load"]
    assert case["waiting_for_load"] is True and case["blocks_allocated_for_load"] == 5
    assert case["held_after_deadline_step"] is True
    assert case["free_blocks_after_deadline_step"] == NUM_BLOCKS - 1 - 5
    assert case["finished_recving_error"] is None
    assert case["held_after_finished_recving"] is False
    assert case["free_blocks_after_finished_recving"] == NUM_BLOCKS - 1


def test_no_lease_on_blocks_an_aborted_load_still_writes(leased, pristine):
    """Aborted while its asynchronous load is in flight: the connector delays the free until
    finished_recving, and vLLM's worker may write the blocks until then. A lease there would
    free them at its deadline (another request could be given them while the load still
    writes) and the report would then trip upstream's assert. Held exactly as upstream holds them."""
    case = leased["aborted_during_load"]
    assert case.pop("leased_blocks_after_abort") == 0
    assert case.pop("expired_leases") == 0
    upstream = pristine["aborted_during_load"]
    assert {k: upstream[k] for k in ("leased_blocks_after_abort", "expired_leases")} == {
        "leased_blocks_after_abort": None, "expired_leases": None}
    assert case == {k: v for k, v in upstream.items() if k not in ("leased_blocks_after_abort", "expired_leases")}
