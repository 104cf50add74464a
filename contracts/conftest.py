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
