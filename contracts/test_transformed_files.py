"""Every transformed vLLM file in the image is at its postimage hash; the engine agrees."""

from __future__ import annotations

import hashlib
import subprocess
import sys


def test_each_target_file_at_postimage(site_packages, lock, build_inputs):
    assert build_inputs["site_packages"] == str(site_packages)
    for f in lock.files:
        got = hashlib.sha256((site_packages / f.path).read_bytes()).hexdigest()
        assert got == f.postimage_sha256, f"{f.path}: sha256 {got}, lock postimage {f.postimage_sha256}"


def test_transform_engine_check_exits_0(site_packages):
    proc = subprocess.run([sys.executable, "-m", "transforms", "check", "--tree", str(site_packages)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_imports_from_the_transformed_tree(site_packages):
    import vllm
    import vllm.v1.core.sched.scheduler as scheduler

    assert vllm.__version__ == "0.32.0"
    assert scheduler.__file__.startswith(str(site_packages))
