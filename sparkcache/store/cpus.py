"""Which CPUs the store's threads run on.

vLLM's CPU worker pins its process to the cores its OpenMP threads compute on (with
``VLLM_CPU_OMP_THREADS_BIND=auto``: all but one core per NUMA node, the one left for the
engine's other processes). Threads started in that process inherit the pin, so publication
(hashing pages, writing, syncing) and maintenance ran on the cores the model computes on
while the reserved core idled: Report B's slowdown (docs/SIZING.md, "Report B on the real
engine"). So:

- ``note_model_cpus``: the connector's worker records the CPUs vLLM pinned it to (and, with
  an explicit ``VLLM_CPU_OMP_THREADS_BIND``, every rank's);
- ``run_off_model_cpus``: a background thread (the publisher, the maintenance thread, their
  pools) moves to the allowed CPUs other than those, or to every allowed CPU when that
  leaves none (one core; a worker vLLM did not pin, as on GPUs; no worker at all);
- ``run_as_publisher``: the same, at a lower priority, for publication's threads;
- ``run_on_every_allowed_cpu``: a restore's readers (the model waits for them) run on every
  CPU the cpuset allows; ``held_to`` keeps one of them on one CPU while it reads its share.

Each changes only the calling thread's affinity (Linux; elsewhere nothing happens).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

_model_cpus: frozenset[int] = frozenset()


def note_model_cpus(omp_bind: str = "") -> frozenset[int]:
    """Record the model's CPUs: the calling thread's (call it on the thread vLLM pinned) and
    every core ``omp_bind`` (``VLLM_CPU_OMP_THREADS_BIND``) gives any tensor-parallel rank,
    so one rank's background work does not land on another rank's model cores."""
    global _model_cpus
    _model_cpus = own_cpus() | omp_bound_cpus(omp_bind)
    return _model_cpus


def omp_bound_cpus(omp_bind: str) -> frozenset[int]:
    """The CPUs an explicit ``VLLM_CPU_OMP_THREADS_BIND`` lists (``0-3|4-7``, ``0,2|1,3``:
    one list per rank); none for ``auto``, ``nobind`` or anything else."""
    cpus: set[int] = set()
    for rank_list in omp_bind.split("|") if omp_bind.strip() else ():
        for part in rank_list.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                return frozenset()
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def model_cpus() -> frozenset[int]:
    """The CPUs last noted as the model's (empty: none noted)."""
    return _model_cpus


def _widen() -> set[int]:
    """Let the calling thread run on every CPU the cpuset allows (the kernel intersects the
    mask with it); those CPUs."""
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    return os.sched_getaffinity(0)


def run_on_every_allowed_cpu() -> None:
    try:
        _widen()
    except (OSError, AttributeError):
        pass  # no such call, or an empty intersection: the inherited mask stays


def own_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (empty where the system does not say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return frozenset()


@contextmanager
def held_to(cpu: int) -> Iterator[None]:
    """Keep the calling thread on ``cpu`` inside the block, then give it back the CPUs it had
    (where the system cannot pin, or ``cpu`` is no longer allowed, the thread stays as it is)."""
    before = own_cpus()
    try:
        os.sched_setaffinity(0, {cpu})
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before or range(os.cpu_count() or 1))
        except OSError:
            run_on_every_allowed_cpu()  # a CPU it had went offline meanwhile


PUBLISH_NICE = 10  # publication yields to vLLM's other processes on the CPUs left to it


def run_as_publisher() -> None:
    """A publication thread: off the model's CPUs, and at niceness ``PUBLISH_NICE``: there it
    shares a core with vLLM's engine core and API server, whose every step the probe waits
    on, while a publication only delays when its entry can be restored. (Maintenance stays
    at the process's priority: its pass budget is wall time; docs/SIZING.md.)"""
    run_off_model_cpus()
    try:
        tid = threading.get_native_id()  # never above the priority it has (a niced process)
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), PUBLISH_NICE))
    except (OSError, AttributeError):
        pass  # raising niceness needs no privilege; a platform without it keeps the priority


def run_off_model_cpus() -> None:
    """Move the calling thread off the model's CPUs (to every allowed one if none is left)."""
    try:
        rest = _widen() - _model_cpus
        if rest:
            os.sched_setaffinity(0, rest)
    except (OSError, AttributeError):
        pass  # no such call: the inherited mask stays
