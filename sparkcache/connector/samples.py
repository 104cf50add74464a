"""Counters and histogram samples collected between two stats intervals (no vLLM import: the
worker's publication and maintenance threads add to them, the engine's thread takes them each
step). Keys are data keys declared in ``sparkcache/metrics.py``; an undeclared one raises
where it is added."""

from __future__ import annotations

import threading

from sparkcache.metrics import require_counter, require_histogram

MAX_SAMPLES = 4096  # per histogram and interval: a bound on memory, not reached at one step's rate


class Samples:
    """Thread-safe ``{histogram name: [values]}``, at most ``MAX_SAMPLES`` per name until taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        require_histogram(name)
        with self._lock:
            values = self._values.setdefault(name, [])
            if len(values) < MAX_SAMPLES:
                values.append(value)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out, self._values = self._values, {}
        return out


def add_count(counters: dict[str, float], key: str, n: float = 1) -> None:
    """Add ``n`` to the counter ``key`` of ``counters`` (nothing for 0; the caller holds
    whatever lock guards them)."""
    require_counter(key)
    if n:
        counters[key] = counters.get(key, 0) + n
