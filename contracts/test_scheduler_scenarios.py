"""The transformed scheduler behaves in the image as on the tested tree.

Each transforms.scenarios module (one per transform, run with vLLM's real Scheduler and synthetic
model outputs) runs here both ways; the results must equal what the builder recorded on the host's
transformed tree (expected/scenarios.json), where tests/transforms asserts the numbers that prove
each transform. New scenario modules are picked up by themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.device import config_env

HOME = Path("/opt/sparkcache")
EXPECTED = json.loads((HOME / "expected" / "scenarios.json").read_text())
MODULES = sorted(p.stem for p in (HOME / "transforms" / "scenarios").glob("*.py") if p.stem not in ("__init__", "harness"))


def test_every_scenario_was_recorded():
    assert MODULES and sorted(EXPECTED) == MODULES


@pytest.mark.parametrize("module", MODULES)
def test_scenario_matches_the_tested_tree(module):
    proc = subprocess.run(
        [sys.executable, str(HOME / "contracts" / "scenario_runner.py"), f"transforms.scenarios.{module}"],
        capture_output=True, text=True, cwd=HOME, timeout=900, env=config_env(PYTHONPATH=str(HOME)),
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("SCENARIO-RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    got = json.loads(line[len("SCENARIO-RESULT "):])
    assert got == EXPECTED[module]
    assert got["options_on"] != got["options_off"], "the transform changes nothing with its options on"
