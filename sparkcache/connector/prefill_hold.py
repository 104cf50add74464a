"""Background work holds still while the model prefills and its first token goes out.

vLLM's model thread and the connector's publisher and maintenance share one interpreter lock,
and, where vLLM's CPU worker binds its OpenMP threads to every core (a machine of two), the
cores too: the model's thread gives the lock up for every torch op and takes it back after,
and whenever a background thread holds it then (running Python between its writes, or
preempted on its CPU while holding it), the forward waits; a background thread that runs on
a core where one of the model's OpenMP threads computes delays that thread, and every
parallel region waits for its slowest thread. A prefill is what a waiting user's first token
waits on (Report B's probe: docs/SIZING.md), while a publication only delays when its entry
can be restored and a maintenance pass when the store is trimmed; so a step that prefills
holds the publisher (before each chunk it hashes and each page it puts) and the maintenance
thread (before each pass) until the step's first token is out: until the next step starts
without prefilling, or ``tail_s`` after the step's forward when none follows. No wait lasts
longer than ``max_s``, from the step's start or, while step after step prefills (a long
prompt's chunks may take minutes on a CPU), from the wait's own start: what the slots hold
meanwhile is bounded, and publication and maintenance go on between its waits.
"""

from __future__ import annotations

import threading
import time

HOLD_MAX_S = 0.5  # the longest one step's prefill holds background work
HOLD_TAIL_S = 0.05  # after a prefill step's forward, when no step follows to release the hold


class PrefillHold:
    """``step(prefill_tokens)`` at the start of a step's forward, ``step_done()`` after it (both
    on the model's thread); ``wait()`` on a background thread before each piece of work."""

    def __init__(self, max_s: float = HOLD_MAX_S, tail_s: float = HOLD_TAIL_S) -> None:
        self.max_s = max_s
        self.tail_s = tail_s
        self._changed = threading.Condition(threading.Lock())
        self._held = False
        self._until = 0.0
        self.held_s = 0.0  # time background work spent held, all told

    def step(self, prefill_tokens: int) -> None:
        with self._changed:
            if prefill_tokens > 0:
                self._held, self._until = True, time.monotonic() + self.max_s
            elif self._held:
                self._held = False  # a decode step: the prefill's first token is out
                self._changed.notify_all()

    def step_done(self) -> None:
        """The step's forward is done: a prefill's hold lasts until the next step starts,
        ``tail_s`` at most."""
        with self._changed:
            if self._held:
                self._until = min(self._until, time.monotonic() + self.tail_s)
                self._changed.notify_all()

    def wait(self) -> None:
        if not self._held:
            return
        t = time.monotonic()
        with self._changed:  # the publisher and the maintenance thread may both wait
            # never past max_s from here, even while step after step prefills
            while self._held and (left := min(self._until, t + self.max_s) - time.monotonic()) > 0:
                self._changed.wait(left)
            self.held_s += time.monotonic() - t


def prefill_tokens(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]] | None) -> int:
    """A step's tokens beyond what decoding schedules (one per request, plus its draft tokens):
    the tokens it prefills."""
    spec = spec_tokens or {}
    return sum(max(0, n - 1 - len(spec.get(req, ()))) for req, n in num_scheduled_tokens.items())


__all__ = ["HOLD_MAX_S", "HOLD_TAIL_S", "PrefillHold", "prefill_tokens"]
