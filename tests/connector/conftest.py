import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The offline tiny Llama (random weights, locally trained byte-level BPE)."""
    from sparkcache.tinymodel import TINY, make_tiny_model

    return make_tiny_model(TINY)


def long_prompt(n: int = 2100, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run_engine(cfg: dict, timeout: int = 500) -> dict:
    """One engine life (start, generate, shut down) in a fresh process; returns its JSON."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Own session: whatever the engine leaves behind is killed with its group, and
        # files (not pipes) so a straggler cannot keep us waiting.
        p = subprocess.Popen([sys.executable, "-m", "tests.connector.engine_driver", json.dumps(cfg)],
                             cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
    for line in proc.stdout.splitlines():
        if line.startswith("ENGINE-RESULT "):
            result = json.loads(line[len("ENGINE-RESULT "):])
            result["log"] = proc.stdout[-20000:] + proc.stderr[-20000:]
            return result
    raise AssertionError(f"engine run failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def metric(result: dict, name: str, **labels) -> float:
    total = 0.0
    for key, value in result["metrics"].items():
        mname, _, lab = key.partition("{")
        if mname != name:
            continue
        got = json.loads("{" + lab)
        if all(got.get(k) == v for k, v in labels.items()):
            total += value
    return total


def snapshot(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() else b"<dir>"
    return out
