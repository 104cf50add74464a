"""The transformed scheduler behaves in the image as on the tested tree.

Each testing.scenarios module (one per transform, run with vLLM's real Scheduler and synthetic
model outputs) runs here both ways; the results must equal what the builder recorded on the host's
transformed tree (expected/scenarios.json), where tests/transforms asserts the numbers that prove
each transform. New scenario modules are picked up by themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.device import config_env
from testing.scenarios import modules, scenarios_both_ways

HOME = Path("/opt/sparkcache")
EXPECTED = json.loads((HOME / "expected" / "scenarios.json").read_text())
MODULES = modules()


def test_every_scenario_was_recorded():
    assert MODULES and sorted(EXPECTED) == MODULES


@pytest.fixture(scope="module")
def in_this_image() -> dict[str, dict]:
    """Every scenario module both ways, in one interpreter (one import of vLLM for them all)."""
    return scenarios_both_ways(None, MODULES, env=config_env(PYTHONPATH=str(HOME)))


@pytest.mark.parametrize("module", MODULES)
def test_scenario_matches_the_tested_tree(in_this_image, module):
    got = in_this_image[module]
    assert got == EXPECTED[module]
    assert got["options_on"] != got["options_off"], "the transform changes nothing with its options on"
