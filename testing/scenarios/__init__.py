"""Scheduler scenarios: each transform's behaviour on vLLM's real Scheduler, with synthetic model outputs.

Each module (one per transform, and ``growing_conversation`` for all three together) has
``run(options_on, ...) -> dict`` of JSON values, and drives the scheduler through
``testing.vllm_scheduler``. ``python -m testing.scenarios`` is the one way they are run in
another interpreter: it reads ``[[module, kwargs], ...]`` as JSON on stdin, prints
``SCENARIO-FILE`` and the file of the vLLM scheduler it imported, then one ``SCENARIO-RESULT``
line of JSON per call, in order; :func:`run_scenarios` is the one reader (for the tests, the
contract suite, and ``python -m testing.scenarios record``, which the image builder runs to
record what the image's contract suite compares).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

FILE_LINE = "SCENARIO-FILE "
RESULT_LINE = "SCENARIO-RESULT "
HERE = Path(__file__).resolve().parent


def modules() -> list[str]:
    """The scenario modules' short names (``lease_accounting``, ...), sorted."""
    return sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_"))


def run_scenarios(tree: Path | None, calls: Sequence[tuple[str, dict]], env: dict[str, str] | None = None) -> list[dict]:
    """Run each ``module.run(**kwargs)`` of calls, in order, in one fresh interpreter against tree
    (None: the installed vLLM), with ``tree_env(tree)`` or env; return their JSON results. Each call
    builds its own Scheduler, so one interpreter (one vLLM import) serves them all."""
    from transforms.trees import REPO, installed_site_packages, tree_env

    proc = subprocess.run(
        [sys.executable, "-m", "testing.scenarios"],
        input=json.dumps([[module, kwargs] for module, kwargs in calls]),
        env=env if env is not None else tree_env(tree),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    lines = proc.stdout.splitlines()
    files = [line[len(FILE_LINE) :] for line in lines if line.startswith(FILE_LINE)]
    results = [json.loads(line[len(RESULT_LINE) :]) for line in lines if line.startswith(RESULT_LINE)]
    if proc.returncode != 0 or len(results) != len(calls):
        failed = calls[len(results)][0] if len(results) < len(calls) else ", ".join(sorted({m for m, _ in calls}))
        raise RuntimeError(f"scenario {failed} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    expected_root = (tree if tree is not None else installed_site_packages()).resolve()
    if not files or not Path(files[0]).resolve().is_relative_to(expected_root):  # resolved: the venv may be a link
        raise RuntimeError(f"the scenarios ran vLLM's scheduler from {files}, not from {expected_root}")
    return results


def scenarios_both_ways(tree: Path | None, names: Sequence[str], env: dict[str, str] | None = None) -> dict[str, dict]:
    """{name: {"options_on": ..., "options_off": ...}} for these scenario modules, in one interpreter:
    what the builder records on the host's transformed tree and the contract suite compares in an image."""
    calls = [(f"testing.scenarios.{name}", {"options_on": on}) for name in names for on in (True, False)]
    results = iter(run_scenarios(tree, calls, env=env))
    return {name: {"options_on": next(results), "options_off": next(results)} for name in names}


def option_readings(configs: list[dict[str, Any]], read: Callable[[Any], Any], **kwargs: Any) -> dict:
    """How the Scheduler reads a transform's options: built once per ``configs`` entry (added to
    the ProbeConnector's kv_connector_extra_config), each reading is
    ``{"error": str | None, "read": read(scheduler)}``; kwargs go to ``make_scheduler``.

    First a Scheduler without any of the options: on the transformed tree it must not import
    sparkcache (the call sites import ``sparkcache.hooks.*``, and they ``sparkcache.settings``,
    only for a key that is present).
    """
    from testing.vllm_scheduler import make_scheduler, probe_connector

    def reading(extra: dict[str, Any]) -> dict[str, Any]:
        try:
            scheduler = make_scheduler(probe_connector(extra), **kwargs)
        except ValueError as exc:
            return {"error": str(exc), "read": None}
        return {"error": None, "read": read(scheduler)}

    # Another scenario in this interpreter may have imported them already: take them out of
    # sys.modules, so that only an import by this Scheduler puts one back.
    def watched(name: str) -> bool:
        return name in ("sparkcache.settings", "sparkcache.hooks") or name.startswith("sparkcache.hooks.")

    earlier = {m: sys.modules.pop(m) for m in [m for m in sys.modules if watched(m)]}
    absent = reading({})
    imported = any(watched(m) for m in sys.modules)
    if not imported:
        sys.modules.update(earlier)
    return {
        "absent": absent,
        "sparkcache_imported_without_options": imported,
        "readings": [reading(extra) for extra in configs],
    }
