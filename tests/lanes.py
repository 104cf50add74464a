"""Run the whole suite as two pytest processes at once (what `make test` runs).

    python -m tests.lanes [PYTEST_ARGS...]

The image lane (tests/image_build: debootstrap, wheel downloads, docker build, push, pull and the
contract suite in a container) waits on the network, the Docker Engine and the registry much of
the time, so it also runs upstream's own tests on the transformed tree against their record
(tests/test_upstream_unchanged.py) and the restore and key engine lives; the host lane (everything else) is
CPU-bound, often on one core. Side by side they share the two cores instead of taking turns. Each line of output carries its lane's name; each
lane's whole output is also kept in .cache/test-logs/LANE.log. Exits non-zero if either lane
fails, after both have finished.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / ".cache" / "test-logs"
# Upstream's tests, the restore, key, MLA, window and multimodal engine lives and the field layouts'
# vLLM starts (CPU-bound, one core) ride in the image lane, which otherwise waits on I/O, so the
# two lanes end closer together (docs/RESULTS.md, "Test suite time").
_IMAGE_LANE = ["tests/image_build", "tests/test_upstream_unchanged.py", "tests/connector/test_engine_restore.py",
               "tests/connector/test_engine_keys.py", "tests/connector/test_field_layouts.py",
               "tests/connector/test_engine_mla.py", "tests/connector/test_engine_window.py",
               "tests/connector/test_engine_multimodal.py"]
LANES = {"image": _IMAGE_LANE,
         "host": ["tests", *(f"--ignore={path}" for path in _IMAGE_LANE)]}


def _pump(name: str, proc: subprocess.Popen, log: Path, lock: threading.Lock) -> None:
    with open(log, "w") as out:
        for line in proc.stdout:
            out.write(line)
            out.flush()
            with lock:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()


def main(argv: list[str]) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    started = time.monotonic()
    procs, pumps = {}, []
    for name, paths in LANES.items():
        cmd = [sys.executable, "-m", "pytest", *paths, *argv]
        print(f"[{name}] {' '.join(cmd[2:])}  (log: {LOGS / name}.log)", flush=True)
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        pump = threading.Thread(target=_pump, args=(name, procs[name], LOGS / f"{name}.log", lock), daemon=True)
        pump.start()
        pumps.append(pump)
    codes = {name: proc.wait() for name, proc in procs.items()}
    for pump in pumps:
        pump.join()
    print(f"lanes: {', '.join(f'{n} exit {c}' for n, c in codes.items())} after {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
