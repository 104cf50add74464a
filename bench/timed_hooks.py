"""A restore arm's own connector with the hooks a load runs in timed where they run.

    KVTransferConfig(kv_connector="TimedExampleConnector", kv_connector_module_path="bench.timed_hooks", ...)

A load's cost in TTFT (``restore_overhead_s`` in ``bench.restore_ttft``) is a difference of two
TTFTs, each mostly the forward; at 64K tokens the forward's spread from one engine life to the
next is as large as a whole load (docs/RESULTS.md). This module measures the load itself beside
it: each class here is the arm's unchanged connector (sparkcache's, vLLM's ExampleConnector,
the bench's LMCache one) with the hooks of ``HOOKS`` wrapped in a wall-clock timer, in
whichever process calls them (the scheduler's in the engine core, the worker's in the worker).
Every call appends one line, ``<hook> <seconds>``, to the file named by ``LOG_ENV`` (one
``write`` on a descriptor opened with ``O_APPEND``, so lines of two processes never mix); the
bench reads the lines each request added (``HookLog``). Nothing else changes: the same
metadata, the same loads, the same output.

On vLLM's CPU engine each arm loads everything in ``start_load_kv`` (sparkcache its verified
read and placement, ExampleConnector its safetensors reads and copies, LMCache its retrieval,
not layerwise) and looks up in ``get_num_new_matched_tokens``; ``wait_for_layer_load`` is a
no-op in all three and is left out (a call per layer and step). Stores are not in these hooks,
except sparkcache's captures, which run in ``start_load_kv`` in the step after the request
that planned them (a timed request's own capture, if any, comes after it: not counted for it).
On an accelerator these hooks would time an asynchronous copy's start, not the copy.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

LOG_ENV = "RESTORE_TTFT_HOOK_LOG"  # not SPARKCACHE_*: sparkcache refuses names it does not know
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "start_load_kv")
# the class name vLLM is given -> the connector it times (module, class)
TIMED = {"TimedSparkcacheConnector": ("sparkcache.connector.connector", "SparkcacheConnector"),
         "TimedExampleConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector"),
         "TimedLMCacheCPUConnector": ("bench.lmcache_arm", "LMCacheCPUConnector")}

_fd: list[int] = []


def _record(hook: str, seconds: float) -> None:
    if not _fd:
        path = os.environ.get(LOG_ENV)
        if path is None:  # not in a bench life: time nothing, change nothing
            return
        _fd.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    os.write(_fd[0], f"{hook} {seconds:.9f}\n".encode())


def _timer(hook: str, method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _record(hook, time.perf_counter() - t)
    return wrapper


def timed(cls: type) -> type:
    """A subclass of ``cls`` whose ``HOOKS`` record their wall time; nothing else differs."""
    return type(f"Timed{cls.__name__}", (cls,), {hook: _timer(hook, getattr(cls, hook)) for hook in HOOKS})


def __getattr__(name: str) -> type:  # vLLM's factory: getattr(module, kv_connector)
    if name not in TIMED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; timed connectors: {sorted(TIMED)}")
    module, cls = TIMED[name]
    made = timed(getattr(importlib.import_module(module), cls))
    globals()[name] = made
    return made


@dataclass
class HookLog:
    """The lines a life's connectors appended to ``path``, read a request at a time. The file
    (and its folder: the arm's root beside it may be made only by its connector) is made here,
    before any connector writes."""
    path: str
    offset: int = 0

    def __post_init__(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).touch()

    def take(self) -> dict[str, float]:
        """Seconds per hook in the lines added since the last call (every hook of ``HOOKS``)."""
        totals = dict.fromkeys(HOOKS, 0.0)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self.offset += len(whole)
        for line in whole.decode().splitlines():
            hook, seconds = line.split()
            totals[hook] += float(seconds)
        return totals
