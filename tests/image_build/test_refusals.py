"""Refusals that need the engine: each exits 2 with a one-line reason."""

from __future__ import annotations

import uuid

import pytest
import yaml

from images.builder import dockerenv
from images.builder.spec import load
from tests.image_build.conftest import REPO, build_py

pytestmark = [pytest.mark.docker, pytest.mark.network, pytest.mark.slow]


def test_unreachable_engine():
    env = {"DOCKER_HOST": "unix:///tmp/sparkcache-no-such-engine.sock"}
    run = build_py(env=env)
    assert run.rc == 2 and "no Docker Engine answers at unix:///tmp/sparkcache-no-such-engine.sock" in run.reason
    assert "fix:" in run.reason
    run = build_py("verify", "127.0.0.1:5050/sparkcache/vllm-cpu@sha256:" + "0" * 64, "--receipt", str(REPO / "images" / "vllm-cpu.yaml"), env=env)
    assert run.rc == 2 and "no Docker Engine answers" in run.reason


def test_wheel_hash_mismatch(tmp_path, client):
    raw = yaml.safe_load((REPO / "images" / "vllm-cpu.yaml").read_text())
    i = next(i for i, w in enumerate(raw["wheels"]) if w.startswith("idna=="))
    pin, good = raw["wheels"][i].split()
    bad = "sha256:" + ("0" * 63 + "1")
    raw["wheels"][i] = f"{pin} {bad}"
    spec = tmp_path / "badhash.yaml"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = build_py("--spec", str(spec))
    assert run.rc == 2, run.stderr
    reason = run.reason
    assert f"wheels[{i}] {pin}" in reason and good.split(":")[1] in reason and bad.split(":")[1] in reason, reason
    assert run.stdout == ""


def test_base_with_drifted_vllm_file_stops_the_build(tmp_path, client, built):
    """A base whose installed vLLM differs from the lock's preimage: the build names the file and both hashes."""
    host = built.ref.split("/")[0]
    target = f"{load(REPO / 'images' / 'vllm-cpu.yaml').site_packages}/vllm/v1/core/sched/scheduler.py"
    container = client.containers.create(built.ref, command=["/bin/sh", "-c", f"echo '# drifted' >> {target}"], network_mode="none")
    try:
        container.start()
        assert container.wait()["StatusCode"] == 0
        repo = f"{host}/sparkcache/test-drifted-base"
        tag = uuid.uuid4().hex[:8]
        container.commit(repository=repo, tag=tag)
    finally:
        container.remove(force=True)
    digest = dockerenv.push(client, repo, tag)
    raw = yaml.safe_load((REPO / "images" / "vllm-cpu.yaml").read_text())
    raw["base"] = {"image": f"{repo}@{digest}"}
    raw["name"] = "test-drifted"
    spec = tmp_path / "drifted.yaml"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = build_py("--spec", str(spec))
    assert run.rc == 2, run.stderr
    assert "vllm/v1/core/sched/scheduler.py" in run.reason and "preimage" in run.reason, run.reason
    assert run.stdout == ""


def test_push_to_stopped_registry_fails(client, built):
    port = 5099
    dockerenv.ensure_local_registry(port)
    dockerenv.stop_local_registry(port)
    assert not dockerenv.registry_answers(f"127.0.0.1:{port}")
    run = build_py("--registry", f"127.0.0.1:{port}/sparkcache/vllm-cpu")
    assert run.rc == 2, run.stderr
    assert "push of 127.0.0.1:5099/" in run.reason and "failed" in run.reason, run.reason
    assert run.stdout == ""


def test_base_whose_python_is_not_the_spec_python_stops_the_build(tmp_path, client, built):
    """A spec saying 3.12 on a base whose python3 is 3.11: the wheels stage refuses, naming both."""
    raw = yaml.safe_load((REPO / "images" / "vllm-cpu.yaml").read_text())
    raw["base"] = {"image": built.ref}
    raw["python_version"] = "3.12"
    raw["name"] = "test-other-python"
    spec = tmp_path / "other-python.yaml"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = build_py("--spec", str(spec))
    assert run.rc == 2 and run.stdout == "", run.stderr
    assert all(part in run.reason for part in ("python_version is 3.12", "python3 in the base is 3.11", built.ref)), run.reason


def test_trim_entry_that_matches_nothing_stops_the_build(tmp_path, client, built):
    """A trim path the wheels no longer ship: the wheels stage refuses, naming the path (never a silent no-op)."""
    raw = yaml.safe_load((REPO / "images" / "vllm-cpu.yaml").read_text())
    raw["base"] = {"image": built.ref}
    raw["name"] = "test-trim-unmatched"
    raw["trim"] = [{"path": "torch/lib", "why": "a path that is there"}, {"path": "no_such_package/lib*", "why": "gone from the wheels"}]
    spec = tmp_path / "trim-unmatched.yaml"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = build_py("--spec", str(spec))
    assert run.rc == 2 and run.stdout == "", run.stderr
    assert all(part in run.reason for part in ("trim: no_such_package/lib* matches nothing under /opt/venv/lib/python3.11/site-packages",
                                               built.ref, "correct or drop the trim entry")), run.reason


def test_a_checkout_edited_during_the_build_stops_it(client, built, monkeypatch):
    """A file appearing under contracts/ while the build reads the checkout (here: as the sparkcache
    wheel is built, before the overlay is written): the image would carry it under a revision label
    that does not name it, so the build refuses before anything is pushed."""
    from images.builder import layers, pipeline
    from images.builder.dockerenv import BuildError

    stray = REPO / "contracts" / f"_mid_build_{uuid.uuid4().hex[:8]}.txt"
    wheel = layers.sparkcache_wheel

    def wheel_then_edit(sde):
        out = wheel(sde)
        stray.write_text("written while the build ran\n")
        return out

    monkeypatch.setattr(layers, "sparkcache_wheel", wheel_then_edit)
    try:
        with pytest.raises(BuildError) as err:
            pipeline.build(REPO / "images" / "vllm-cpu.yaml", None)
    finally:
        stray.unlink(missing_ok=True)
    assert "the checkout changed while the build read it" in str(err.value) and "build again" in str(err.value), err.value
