"""Scheduler scenarios: each transform's behaviour on vLLM's real Scheduler, with synthetic model outputs.

Each module (one per transform, and ``growing_conversation`` for all three together) has
``run(options_on, ...) -> dict`` of JSON values. ``python -m transforms.scenarios`` is the one
way they are run in another interpreter: it reads ``[[module, kwargs], ...]`` as JSON on stdin,
prints ``SCENARIO-FILE`` and the file of the vLLM scheduler it imported, then one
``SCENARIO-RESULT`` line of JSON per call, in order (``transforms.trees.run_scenarios`` reads
them, for the tests, the image builder and the contract suite alike).
"""

from __future__ import annotations

from pathlib import Path

FILE_LINE = "SCENARIO-FILE "
RESULT_LINE = "SCENARIO-RESULT "
HERE = Path(__file__).resolve().parent


def modules() -> list[str]:
    """The scenario modules' short names (``lease_accounting``, ...), sorted."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in ("__init__", "__main__", "harness"))
