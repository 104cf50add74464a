"""A Scheduler and Mamba managers built without the transformed ``__init__`` pass every call site.

Runs testing/scenarios/built_without_init.py: on the pristine tree (no call sites: the copy
works as vLLM's own objects do) and on the transformed tree, both ways. Without the class-level
defaults the transforms add (``transforms.class_default``), the first call site the copy reaches
raises ``AttributeError: 'Scheduler' object has no attribute 'sparkcache_leases'``.
"""

import pytest

pytestmark = [pytest.mark.slow]

SCENARIO = "testing.scenarios.built_without_init"
SCENARIO_CALLS = [
    ("pristine", SCENARIO, {"options_on": False}),
    ("transformed", SCENARIO, {"options_on": True}),
    ("transformed", SCENARIO, {"options_on": False}),
]
STAGES = ["run_to_completion", "finished_sending", "make_stats", "next_turn_admitted"]
# What every option attaches (Scheduler, then MambaManager), all of it left out of the copy.
HOOKS = ["sparkcache_decode_checkpoints", "sparkcache_leases", "sparkcache_prefer_local_prefix", "sparkcache_retired"]


@pytest.mark.parametrize(
    "tree, options_on", [("pristine", False), ("transformed", True), ("transformed", False)]
)
def test_objects_built_without_init_pass_every_call_site(scenario, tree, options_on):
    got = scenario(tree, SCENARIO, options_on=options_on)
    assert got["type"] == "Scheduler"
    assert got["copied_managers"] == ["FullAttentionManager", "MambaManager"]
    assert got["hooks_left_out"] == (HOOKS if tree == "transformed" and options_on else [])
    assert got["error"] is None
    assert got["stages_passed"] == STAGES
