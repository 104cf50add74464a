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
