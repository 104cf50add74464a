"""Real Docker Engine, real registry (Debian's docker-registry on 127.0.0.1), real builds; no mocks.

`make test` runs images/setup-docker.sh first; if no engine answers here, the tests fail (never skip).
The session builds the default CPU image once through build.py (the command `make image` runs);
later builds reuse the cached base, wheelhouse and wheels stage.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REF = re.compile(r"^127\.0\.0\.1:\d+/[a-z0-9._/-]+@sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: str
    stderr: str

    @property
    def reason(self) -> str:
        lines = [l for l in self.stderr.splitlines() if l.startswith("build.py: error:")]
        assert len(lines) == 1, f"expected one error line, got:\n{self.stderr[-3000:]}"
        return lines[0]


def build_py(*args: str, env: dict | None = None, timeout: int = 2400) -> Run:
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([sys.executable, str(REPO / "build.py"), *args], capture_output=True, text=True, cwd=REPO, env=full_env, timeout=timeout)
    sys.stderr.write(proc.stderr[-4000:])
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def client():
    import docker

    try:
        c = docker.from_env(timeout=600)
        c.ping()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"no Docker Engine answers ({exc}); run `bash images/setup-docker.sh` (make test does)")
    return c


@dataclass(frozen=True)
class Built:
    ref: str
    receipt: dict
    receipt_path: Path
    run: Run


@pytest.fixture(scope="session")
def built(client, tmp_path_factory) -> Built:
    receipt_path = tmp_path_factory.mktemp("receipt") / "receipt.json"
    run = build_py("--receipt", str(receipt_path))
    assert run.rc == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 1 and REF.match(lines[0]), run.stdout
    return Built(lines[0], json.loads(receipt_path.read_text()), receipt_path, run)
