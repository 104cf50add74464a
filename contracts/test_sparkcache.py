"""The sparkcache package in the image is the one the labels name."""

from __future__ import annotations

import importlib.metadata
import subprocess

from contracts.device import config_env


def test_sparkcache_version(labels):
    import sparkcache

    assert importlib.metadata.version("sparkcache") == labels["io.sparkcache.version"]
    assert sparkcache.__file__.startswith("/opt/venv/")


def test_sparkcache_console_script_runs():
    proc = subprocess.run(["sparkcache", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_openai_server_entry_point_starts():
    """The README's deploy command: the server's argument parser loads and knows the connector flag."""
    proc = subprocess.run(["python", "-m", "vllm.entrypoints.openai.api_server", "--help"],
                          capture_output=True, text=True, timeout=600, env=config_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--kv-transfer-config" in proc.stdout


def test_every_dependency_of_sparkcache_is_installed_and_xxh3_128_is_the_reference_one():
    """What the package declares is in the image at a version it accepts (pinned by hash in the
    spec); XXH3-128, the restore's page checksum, gives the reference value for empty input."""
    import re

    import xxhash

    declared = importlib.metadata.requires("sparkcache") or []
    names = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in declared if "extra ==" not in r}
    assert {"blake3", "obstore", "prometheus_client", "xxhash"} <= names, declared
    for name in names:
        importlib.metadata.version(name)  # raises PackageNotFoundError when absent
    assert xxhash.xxh3_128_hexdigest(b"") == "99aa06d3014798d86001c324468d497f"


def test_the_s3_backend_and_its_client_are_in_the_image():
    """The shared tier's S3 client (obstore, docs/REMOTE.md) is installed and the backend imports:
    configuring the tier needs nothing installed into the image."""
    import obstore

    from sparkcache.store.s3_backend import S3Backend
    from sparkcache.store.s3_location import S3Location

    assert obstore.__version__ and callable(S3Backend)
    assert S3Location("bucket").key("ab" * 32) == "sparkcache/objects/ab/" + "ab" * 32
