"""An engine life's clean-up takes only what its own processes left in ``/dev/shm``
(contracts/engine_driver.py, ``run_in_fresh_process``; issue 43, item 8).

A program beside the life (here: a separate process holding a ``spawn`` context's Lock, made
after the life started, as a ``vllm serve`` started meanwhile would) keeps its semaphore
through the life's end: the file is still there and a spawned child can rebuild the lock.
glibc's ``sem_open`` maps a temporary file and links it to the name, so ``/proc/*/maps``
shows ``sem.XXXXXX (deleted)``, never the name: a clean-up that removes what no process
appears to hold deletes every live multiprocessing semaphore made during the life.

Each life gets its own ``/dev/shm`` (contracts/private_shm.py): as root a mount namespace;
without CAP_SYS_ADMIN a user namespace too; where the kernel refuses both, the life shares
the host's, removes nothing and names what appeared. Each of the three is run here.

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

import pytest

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


def _scenario() -> dict:
    """One life with a neighbour started during it; checks what each leaves (module doc) and
    returns the life's ``shm`` report."""
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
        else:  # no namespace: nothing removed, and the report names what appeared, theirs and ours
            assert result["shm"]["reason"]
            assert (SHM / leftover).exists() and {leftover, sem.name} <= set(result["shm"]["left"])
        return result["shm"]
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        (SHM / leftover).unlink(missing_ok=True)


def _scenario_as(prefix: list[str]) -> dict:
    """``_scenario`` in a process started through ``prefix`` (setpriv, unshare); its report."""
    proc = subprocess.run([*prefix, sys.executable, "-m", MODULE, "scenario"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"the scenario failed under {prefix}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_life_leaves_a_neighbours_semaphore_and_takes_only_its_own_leftovers():
    """As this user: root gets a mount namespace; another user a user namespace, or none."""
    shm = _scenario()
    if os.getuid() == 0:  # root can always make a mount namespace
        assert shm == {"private": True}


@pytest.mark.root
def test_without_cap_sys_admin_a_life_gets_its_private_shm_through_a_user_namespace():
    """Root without CAP_SYS_ADMIN (setpriv drops it from the bounding set), as an operator who
    is not root: no mount namespace of its own, so a user namespace mapping the user to itself,
    where the kernel allows one; where it does not, the life shares /dev/shm and removes nothing."""
    assert os.getuid() == 0, "dropping a capability needs root; pytest -m 'not root' leaves this out"
    shm = _scenario_as(["setpriv", "--bounding-set=-sys_admin"])
    assert shm["private"] or "CLONE_NEWUSER" in shm["reason"], shm


@pytest.mark.root
def test_where_no_namespace_can_be_made_a_life_removes_nothing_and_names_what_appeared():
    """The kernel refuses both namespaces (no CAP_SYS_ADMIN, and no user namespace left to make:
    ``user.max_user_namespaces`` 0 inside a user namespace of the test's own), as in a Docker
    container under its default seccomp profile: nothing is provably the life's, so its own
    segment stays beside the neighbour's semaphore and the report names both."""
    assert os.getuid() == 0, "making a user namespace to run in needs root here; pytest -m 'not root' leaves this out"
    refuse = ("echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-sys_admin "
              '"$@"')
    shm = _scenario_as(["unshare", "--user", "--map-root-user", "sh", "-c", refuse, "sh"])
    assert shm["private"] is False and "CLONE_NEWUSER" in shm["reason"], shm


if __name__ == "__main__":
    if sys.argv[1] == "neighbour":
        _neighbour()
    elif sys.argv[1] == "scenario":
        print(json.dumps(_scenario()), flush=True)
    else:
        print(RESULT_MARKER + json.dumps(_life(load_cfg(sys.argv[1]))), flush=True)
        os._exit(0)
