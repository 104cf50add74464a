"""The labels and the build receipt describe this very image."""

from __future__ import annotations

import importlib.metadata

OCI = "org.opencontainers.image."


def test_oci_labels_present(labels):
    for key in ("source", "revision", "version", "created", "base.name", "base.digest"):
        assert labels.get(OCI + key), f"label {OCI}{key} missing"
    assert labels[OCI + "base.digest"].startswith("sha256:") and len(labels[OCI + "base.digest"]) == 71


def test_labels_match_what_the_image_carries(labels, build_inputs, lock):
    import vllm

    assert labels["io.sparkcache.vllm.version"] == vllm.__version__ == build_inputs["vllm_version"]
    assert labels["io.sparkcache.transform-lock.sha256"] == lock.sha256 == build_inputs["transform_lock_sha256"]
    assert labels["io.sparkcache.version"] == labels[OCI + "version"] == build_inputs["sparkcache"]["version"]
    assert labels[OCI + "base.digest"] == build_inputs["base"]["digest"]
    assert labels[OCI + "base.name"] == build_inputs["base"]["name"]
    assert labels[OCI + "revision"] == build_inputs["revision"]


def test_receipt_subject_is_this_image(receipt, image_info):
    subject = receipt["subject"][0]
    assert f"{subject['name']}@sha256:{subject['digest']['sha256']}" == image_info["ref"]
    assert "sha256:" + receipt["predicate"]["runDetails"]["byproducts"][0]["digest"]["sha256"] == image_info["image_id"]
    layers = next(b for b in receipt["predicate"]["runDetails"]["byproducts"] if b["name"] == "layers")
    assert layers["diff_ids"] == image_info["diff_ids"]


def test_receipt_inputs_match_the_image(receipt, build_inputs, labels):
    deps = receipt["predicate"]["buildDefinition"]["resolvedDependencies"]
    for dep in deps:
        assert dep["digest"], f"input {dep['name']} has no digest"
    base = next(d for d in deps if d["name"] == "base")
    assert base["uri"] == f"{build_inputs['base']['name']}@{build_inputs['base']['digest']}"
    wheels = {d["name"][len("wheel:"):]: d["digest"]["sha256"] for d in deps if d["name"].startswith("wheel:")}
    assert wheels == {w["name"]: w["sha256"] for w in build_inputs["wheels"]}
    lock_dep = next(d for d in deps if d["name"] == "transform-lock")
    assert lock_dep["digest"]["sha256"] == build_inputs["transform_lock_sha256"]
    files = receipt["predicate"]["buildDefinition"]["files"]
    assert [(f["file"], f["pre"], f["post"]) for f in files] == [(f["file"], f["pre"], f["post"]) for f in build_inputs["files"]]
    assert receipt["labels"] == labels


def test_installed_distributions_are_the_pinned_wheels(build_inputs, site_packages):
    """The venv holds exactly the pinned wheels, sparkcache, and what `python3 -m venv` put there.

    Read from site-packages itself: importing setuptools puts its vendored copies (their own
    dist-info) on sys.path, and those are not installed distributions."""
    def norm(n):
        import re

        return re.sub(r"[-_.]+", "-", n).lower()

    installed = {norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(site_packages)])}
    pinned = {norm(w["name"]): w["version"] for w in build_inputs["wheels"]}
    assert {name: installed.get(name) for name in pinned} == pinned
    assert set(installed) - set(pinned) - {"sparkcache"} <= {"pip", "setuptools"}, sorted(set(installed) - set(pinned))


def test_trimmed_paths_are_gone(build_inputs, site_packages):
    """Every path the spec trims is absent from site-packages (the CPU spec trims nothing; the CUDA spec's
    entries each say why vLLM never loads them). What a contract needs must survive: the rest of the suite
    running on the trimmed image is that check."""
    left = {pattern: sorted(str(p.relative_to(site_packages)) for p in site_packages.glob(pattern)) for pattern in build_inputs["trim"]}
    assert {pattern: paths for pattern, paths in left.items() if paths} == {}
