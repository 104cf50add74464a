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
without prefilling, or ``tail_s`` after the step's forward when none follows. The hold is
armed when vLLM binds a step's metadata, before its forward (vLLM 0.32.0 calls
``start_load_kv`` after the forward unless the step loads synchronously). It never holds
longer than ``max_s`` at a stretch: while step after step prefills (a long prompt's chunks,
or a server that always has a prompt in flight) background work then runs free for
``free_s`` before the next stretch, so what the slots hold stays bounded and publication and
maintenance keep at least half the time.
"""

from __future__ import annotations

import threading
import time

HOLD_MAX_S = 0.5  # the longest background work is held at a stretch
HOLD_FREE_S = 0.5  # after a hold of HOLD_MAX_S, background work runs this long before the next
HOLD_TAIL_S = 0.05  # after a prefill step's forward, when no step follows to release the hold


class PrefillHold:
    """``step(prefill_tokens)`` before a step's forward (``bind_connector_metadata``, on the
    model's thread), ``step_done()`` after it; ``wait()`` on a background thread before each
    piece of work."""

    def __init__(self, max_s: float = HOLD_MAX_S, tail_s: float = HOLD_TAIL_S,
                 free_s: float = HOLD_FREE_S) -> None:
        self.max_s = max_s
        self.tail_s = tail_s
        self.free_s = free_s
        self._changed = threading.Condition(threading.Lock())
        self._held = False
        self._since = 0.0  # when this stretch of holding began
        self._until = 0.0  # the tail's end: the hold's end if no step releases it sooner
        self._free_until = 0.0  # a stretch that reached max_s leaves background work this long
        self.held_s = 0.0  # time background work spent held, all told

    def step(self, prefill_tokens: int) -> None:
        with self._changed:
            now = time.monotonic()
            if prefill_tokens <= 0 or now < self._free_until:
                self._release()  # a decode step: the prefill's first token is out
                return
            if self._give_way_if_due(now) and now < self._free_until:
                return  # step after step prefilled for max_s
            if not self._held or now >= self._until:  # a new stretch (the last one's tail ran out)
                self._held, self._since = True, now
            self._until = now + self.max_s

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
            while self._held and (left := min(self._until, self._since + self.max_s) - time.monotonic()) > 0:
                self._changed.wait(left)
            self._give_way_if_due(time.monotonic())
            self.held_s += time.monotonic() - t

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._changed.notify_all()

    def _give_way_if_due(self, now: float) -> bool:
        """If this stretch of holding reached ``max_s`` (before its tail ran out), background
        work runs free for ``free_s`` from then, whatever the steps prefill; True if so."""
        end = self._since + self.max_s
        if not self._held or end > min(self._until, now):
            return False
        self._free_until = end + self.free_s
        self._release()
        return True


def prefill_tokens(num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]] | None) -> int:
    """A step's tokens beyond what decoding schedules (one per request, plus its draft tokens):
    the tokens it prefills."""
    spec = spec_tokens or {}
    return sum(max(0, n - 1 - len(spec.get(req, ()))) for req, n in num_scheduled_tokens.items())


__all__ = ["HOLD_FREE_S", "HOLD_MAX_S", "HOLD_TAIL_S", "PrefillHold", "prefill_tokens"]
