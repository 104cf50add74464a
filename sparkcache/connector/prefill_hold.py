"""Publication holds still while the model prefills.

vLLM's model thread and the connector's publisher share one interpreter lock: the model's
thread gives it up for every torch op and takes it back after, and whenever the publisher holds
it then (running Python between its writes, or preempted on its CPU while holding it), the
forward waits. A prefill is what a waiting user's first token waits on (Report B's probe:
docs/SIZING.md), while a publication only delays when its entry can be restored; so a step
that prefills holds publication at its next page until the step's forward is done, for at
most ``max_s`` (a long prompt's prefill may take minutes on a CPU; what the slots hold meanwhile
is bounded, and never waits past that).
"""

from __future__ import annotations

import threading
import time

HOLD_MAX_S = 0.5  # the longest one step's prefill holds a publication


class PrefillHold:
    """``step(prefill_tokens)`` at the start of a step's forward, ``step_done()`` after it (both
    on the model's thread); ``wait()`` on the publisher before each page it puts."""

    def __init__(self, max_s: float = HOLD_MAX_S) -> None:
        self.max_s = max_s
        self._open = threading.Event()
        self._open.set()
        self._until = 0.0
        self.held_s = 0.0  # time publications spent held, all told

    def step(self, prefill_tokens: int) -> None:
        if prefill_tokens > 0:
            self._until = time.monotonic() + self.max_s
            self._open.clear()

    def step_done(self) -> None:
        self._open.set()

    def wait(self) -> None:
        if self._open.is_set():
            return
        t = time.monotonic()
        self._open.wait(max(0.0, self._until - t))
        self.held_s += time.monotonic() - t


def prefill_tokens(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]] | None) -> int:
    """A step's tokens beyond what decoding schedules (one per request, plus its draft tokens):
    the tokens it prefills."""
    spec = spec_tokens or {}
    return sum(max(0, n - 1 - len(spec.get(req, ()))) for req, n in num_scheduled_tokens.items())


__all__ = ["HOLD_MAX_S", "PrefillHold", "prefill_tokens"]
