"""The pause between the phases of one engine life (contracts/engine_driver.py, ``"phases"``):
``run_in_fresh_process`` runs ``between(i, phases_done)`` while the child waits, in order, once
per phase after the first; a failing ``between`` stops the life and surfaces as itself; a child
that never reaches its next phase is killed at the life's timeout.

The child here is this module run as ``python -m`` (no vLLM): it pauses with the driver's own
``_pause`` and reports each phase's prompts as its results, plus what it saw on disk after
each pause (so the test sees that ``between`` ran before the phase went on)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from contracts.engine_driver import RESULT_MARKER, _pause, load_cfg, run_in_fresh_process

REPO = Path(__file__).resolve().parents[2]
CHILD = ("tests.connector.test_engine_phases",)


def _child(cfg: dict) -> dict:
    phases: list[dict] = []
    for i, phase in enumerate(cfg["phases"]):
        if i > 0 and cfg.get("pause_dir"):
            _pause(Path(cfg["pause_dir"]), i, phases)
        if phase.get("hang"):
            time.sleep(3600)
        marker = Path(cfg["marker"])
        phases.append({"results": phase["prompts"], "marker": marker.read_text() if marker.exists() else None})
    return {"phases": phases}


def test_between_runs_before_each_later_phase_with_the_phases_done(tmp_path):
    marker = tmp_path / "marker"
    calls = []

    def between(phase: int, done: list[dict]) -> None:
        calls.append((phase, [d["results"] for d in done]))
        marker.write_text(f"before {phase}")

    cfg = {"phases": [{"prompts": [1]}, {"prompts": [2]}, {"prompts": [3]}], "marker": str(marker)}
    result = run_in_fresh_process(cfg, REPO, timeout=60, command=CHILD, between=between)
    assert calls == [(1, [[1]]), (2, [[1], [2]])]
    assert [(p["results"], p["marker"]) for p in result["phases"]] == [
        ([1], None), ([2], "before 1"), ([3], "before 2")]


def test_a_failing_between_stops_the_life_and_is_raised(tmp_path):
    def between(phase: int, done: list[dict]) -> None:
        raise ValueError(f"damage failed before phase {phase}")

    cfg = {"phases": [{"prompts": [1]}, {"prompts": [2]}], "marker": str(tmp_path / "m")}
    started = time.monotonic()
    with pytest.raises(ValueError, match="before phase 1"):
        run_in_fresh_process(cfg, REPO, timeout=60, command=CHILD, between=between)
    assert time.monotonic() - started < 60  # not left waiting for the timeout


def test_a_child_that_never_finishes_its_phase_is_killed_at_the_timeout(tmp_path):
    cfg = {"phases": [{"prompts": [1]}, {"prompts": [2], "hang": True}], "marker": str(tmp_path / "m")}
    with pytest.raises(RuntimeError, match="timeout 3 s"):
        run_in_fresh_process(cfg, REPO, timeout=3, command=CHILD, between=lambda phase, done: None)


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_child(load_cfg(sys.argv[1]))), flush=True)
