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
  CPU the cpuset allows; ``held_to`` keeps one of them on one CPU while it reads its share;
- ``note_spinning_cpus``: the connector's worker records the CPUs vLLM bound the model's
  OpenMP threads to. Those threads spin for milliseconds after each parallel region, so a
  restore reads on none of them but its calling thread's own (``layout.reader_cpus``).

Each changes only the calling thread's affinity (Linux; elsewhere nothing happens).
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

_model_cpus: frozenset[int] = frozenset()
_spinning_cpus: frozenset[int] = frozenset()


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
    if not omp_bind.strip():
        return frozenset()
    return _cpu_list(part.strip() for rank_list in omp_bind.split("|") for part in rank_list.split(","))


def note_spinning_cpus(environ: Mapping[str, str]) -> frozenset[int]:
    """Record the CPUs the model's OpenMP threads are bound to (``omp_env_cpus`` of the
    worker's environment, and every rank's cores an explicit ``VLLM_CPU_OMP_THREADS_BIND``
    lists). After each parallel region those threads wait by spinning at normal priority
    (libgomp for a few milliseconds, Intel's runtime ``KMP_BLOCKTIME``, which vLLM sets to
    5 ms), right when a step's restore starts: a reader woken on one of those CPUs waited
    behind the spin for up to a scheduler tick, several times per restore (docs/RESULTS.md,
    "Restore readers off the model's spinning OpenMP threads")."""
    global _spinning_cpus
    _spinning_cpus = omp_env_cpus(environ) | omp_bound_cpus(environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    return _spinning_cpus


def spinning_cpus() -> frozenset[int]:
    """The CPUs last noted as the model's OpenMP threads' (empty: none noted)."""
    return _spinning_cpus


def omp_env_cpus(environ: Mapping[str, str]) -> frozenset[int]:
    """The CPUs the OpenMP runtime's own variables bind its threads to, in the forms vLLM's
    CPU worker sets them (``vllm/utils/ompmultiprocessing.py``): ``GOMP_CPU_AFFINITY`` (GNU:
    ``0 1 2``, also ``0-3``, ``0-6:2``), ``KMP_AFFINITY``'s ``proclist=[0,1,2]`` (Intel; its
    ``{0,1}`` sets as their CPUs), or ``OMP_PLACES`` (``{0,1,2}``; ``{0}:4``-style intervals
    and abstract names bind nothing known). Anything else, or anything that does not parse,
    is none."""
    kmp = environ.get("KMP_AFFINITY", "")
    places = environ.get("OMP_PLACES", "").strip()
    found = _cpu_list(environ.get("GOMP_CPU_AFFINITY", "").replace(",", " ").split())
    if "proclist=[" in kmp and "]" in kmp:
        listed = kmp.split("proclist=[", 1)[1].split("]", 1)[0]
        found |= _cpu_list(listed.replace("{", "").replace("}", "").split(","))
    if places.startswith("{") and places.endswith("}") and ":" not in places:
        found |= _cpu_list(p for p in places.replace("{", ",").replace("}", ",").split(",") if p.strip())
    return found


_MAX_CPU = 1 << 16  # a CPU number beyond any machine's: the variable is garbage
_CPU_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?(?::([0-9]+))?")


def _cpu_list(parts: Iterable[str]) -> frozenset[int]:
    """The CPUs of ``7``, ``0-3`` or ``0-6:2`` parts; none at all when any part is something
    else (or names a CPU past ``_MAX_CPU``)."""
    found: set[int] = set()
    for part in parts:
        m = _CPU_RANGE.fullmatch(part.strip())
        if m is None or int(m[2] or m[1]) >= _MAX_CPU or m[3] is not None and int(m[3]) == 0:
            return frozenset()
        found.update(range(int(m[1]), int(m[2] or m[1]) + 1, int(m[3] or 1)))
    return frozenset(found)


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
