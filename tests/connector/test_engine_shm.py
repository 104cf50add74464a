"""An engine life's clean-up takes only what its own processes left in ``/dev/shm``
(contracts/engine_driver.py, ``run_in_fresh_process``; issue 43, item 8).

A program beside the life (here: a separate process holding a ``spawn`` context's Lock, made
after the life started, as a ``vllm serve`` started meanwhile would) keeps its semaphore
through the life's end: the file is still there and a spawned child can rebuild the lock.
glibc's ``sem_open`` maps a temporary file and links it to the name, so ``/proc/*/maps``
shows ``sem.XXXXXX (deleted)``, never the name: a clean-up that removes what no process
appears to hold deletes every live multiprocessing semaphore made during the life.

The life here is this module run as ``python -m`` (no vLLM): it leaves a segment in
``/dev/shm`` as a killed engine does and pauses once (the driver's ``_pause``) so that the
test can start its neighbour while the life runs."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

from contracts.engine_driver import RESULT_MARKER, _pause, load_cfg, run_in_fresh_process

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.connector.test_engine_shm"
SHM = Path("/dev/shm")


def _life(cfg: dict) -> dict:
    """A life that leaves a segment behind, as a killed engine's workers do."""
    leftover = SHM / cfg["leftover"]
    leftover.write_bytes(b"\0" * 4096)
    _pause(Path(cfg["pause_dir"]), 1, [{"results": []}])
    return {"phases": [{"results": []}, {"results": [], "saw_leftover": leftover.exists()}]}


def _use(lock) -> None:
    with lock:
        pass


def _neighbour() -> None:
    """Holds a spawn Lock, prints its name, waits for a line, then uses the lock here and in
    a spawned child (which rebuilds it from its name) and prints the child's exit code."""
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    print(lock._semlock.name, flush=True)
    sys.stdin.readline()
    _use(lock)
    child = ctx.Process(target=_use, args=(lock,))
    child.start()
    child.join(120)
    print(f"child exit {child.exitcode}", flush=True)


def _start_neighbour() -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "neighbour"], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    name = proc.stdout.readline().strip()
    assert name.startswith("/"), f"the neighbour printed no semaphore name: {name!r}"
    return proc, SHM / ("sem." + name[1:])


def test_a_life_leaves_a_neighbours_semaphore_and_takes_only_its_own_leftovers():
    leftover = f"sparkcache-test-life-{uuid.uuid4().hex}"
    started: list[tuple[subprocess.Popen, Path]] = []

    def between(phase: int, done: list[dict]) -> None:
        started.append(_start_neighbour())

    cfg = {"phases": [{"prompts": []}, {"prompts": []}], "leftover": leftover}
    try:
        result = run_in_fresh_process(cfg, REPO, timeout=120, command=(MODULE,), between=between)
        assert started, "between never ran: the life did not pause"
        neighbour, sem = started[0]
        assert sem.exists(), f"the life's clean-up removed {sem}, a semaphore of a program beside it"
        out, _ = neighbour.communicate("go\n", timeout=120)
        assert out.strip() == "child exit 0", f"the neighbour's spawned child could not use its lock: {out!r}"
        assert result["phases"][1]["saw_leftover"]
        if result["shm"]["private"]:
            assert not (SHM / leftover).exists(), "a life with a private /dev/shm left a segment on the host's"
        else:  # no namespace could be made: its leftovers stay, and the result says which
            assert (SHM / leftover).exists() and leftover in result["shm"]["left"]
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        (SHM / leftover).unlink(missing_ok=True)


if __name__ == "__main__":
    if sys.argv[1] == "neighbour":
        _neighbour()
    else:
        print(RESULT_MARKER + json.dumps(_life(load_cfg(sys.argv[1]))), flush=True)
        os._exit(0)
