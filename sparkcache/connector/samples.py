"""Histogram samples collected between two stats intervals (no vLLM import: the worker's
publication and maintenance threads add to it, the engine's thread takes it each step)."""

from __future__ import annotations

import threading

MAX_SAMPLES = 4096  # per histogram and interval: a bound on memory, not reached at one step's rate


class Samples:
    """Thread-safe ``{histogram name: [values]}``, at most ``MAX_SAMPLES`` per name until taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        with self._lock:
            values = self._values.setdefault(name, [])
            if len(values) < MAX_SAMPLES:
                values.append(value)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out, self._values = self._values, {}
        return out
