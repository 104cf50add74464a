"""The sparkcache package in the image is the one the labels name."""

from __future__ import annotations

import importlib.metadata
import subprocess


def test_sparkcache_version(labels):
    import sparkcache

    assert importlib.metadata.version("sparkcache") == labels["io.sparkcache.version"]
    assert sparkcache.__file__.startswith("/opt/venv/")


def test_sparkcache_console_script_runs():
    proc = subprocess.run(["sparkcache", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
