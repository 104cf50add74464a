"""The contract suite: run inside a sparkcache image (python build.py verify REF@sha256:...).

build.py verify mounts /verify read-only with labels.json (the image's labels, from the engine),
receipt.json (the build receipt) and image.json (the reference, its digest and layer diff ids).
What the image itself carries: /opt/sparkcache/build-inputs.json (written into the overlay layer
by the builder), transforms/ (the engine and lock), contracts/ (with expected/upstream-outcomes.json),
expected/scenarios.json, and upstream/ (the pinned sdist's tests/ with an offline Hugging Face cache).

Suite: labels and receipt (test_labels_receipt), transformed files at their postimage
(test_transformed_files), the sparkcache version and entry points (test_sparkcache), the connector
through vLLM's factory and a tiny-model publish / restart / restore (test_connector), each
transform's scheduler scenario (test_scheduler_scenarios), upstream's tests (test_upstream).
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

from contracts.device import NEEDS_GPU, gpu_build_without_gpu

HOME = Path("/opt/sparkcache")
VERIFY = Path(os.environ.get("SPARKCACHE_VERIFY_DIR", "/verify"))


def _load(path: Path) -> dict:
    if not path.exists():
        pytest.fail(f"{path} is missing: run this suite through `python build.py verify REF@sha256:...`", pytrace=False)
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def labels() -> dict:
    return _load(VERIFY / "labels.json")


@pytest.fixture(scope="session")
def receipt() -> dict:
    return _load(VERIFY / "receipt.json")


@pytest.fixture(scope="session")
def image_info() -> dict:
    return _load(VERIFY / "image.json")


@pytest.fixture(scope="session")
def build_inputs() -> dict:
    return _load(HOME / "build-inputs.json")


@pytest.fixture(scope="session")
def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="session")
def lock():
    from transforms import engine

    return engine.load_lock()


# --- contracts on an image whose vLLM finds no device (the CUDA image on a host without a GPU) ------
# Contracts that run a model are reported as "needs a GPU" (skipped with that reason, listed at the
# end of the run), never silently passed; the others run (contracts/device.py).


def pytest_configure(config):
    config.addinivalue_line("markers", "model_run: runs a model through vLLM's engine (needs a device vLLM can run on)")


def pytest_collection_modifyitems(config, items):
    if not gpu_build_without_gpu():
        return
    for item in items:
        if item.get_closest_marker("model_run"):
            item.add_marker(pytest.mark.skip(reason=f"{NEEDS_GPU}: this image's vLLM finds no device to run a model on here"))


def pytest_terminal_summary(terminalreporter):
    needing = [r.nodeid for r in terminalreporter.stats.get("skipped", []) if NEEDS_GPU in str(r.longrepr)]
    if needing:
        terminalreporter.section(f"contracts that need a GPU, not run here: {len(needing)}")
        for nodeid in needing:
            terminalreporter.line(f"{NEEDS_GPU}: {nodeid}")
