"""A bounded number of capture slots, drained by one publisher thread.

The worker copies a finished request's pages out of the KV cache into a slot (so vLLM can
free the blocks at once) and hands the slot to the publisher, which writes it to the
store. When every slot is taken, or a capture is larger than one slot, the publication is
skipped and counted: serving never waits for a slot.

A ticket submitted with a ``tag`` is *settled* once its outcome is counted in ``stats``
(published, failed or cancelled); ``take_settled()`` returns the tags settled since the
last call, so the connector can tell the scheduler when no publication is left in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from sparkcache.store import cpus

logger = logging.getLogger("sparkcache.capture")

Job = TypeVar("Job")  # what the publisher is handed (the worker's: pages and keys of one capture)
Tag = TypeVar("Tag")  # what take_settled names a settled ticket by (the worker's: the request id)


@dataclass
class CaptureSlotStats:
    queued: int = 0
    published: int = 0
    publish_failed: int = 0
    skipped_slots_full: int = 0
    skipped_too_large: int = 0


class CaptureSlots(Generic[Job, Tag]):
    """``publish(job)`` runs on the publisher thread; its result counts as published when its
    ``ok`` is true (a ``PublishResult``) or, having none, when it is truthy."""

    def __init__(self, n_slots: int, slot_bytes: int, publish: Callable[[Job], object]) -> None:
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self._publish = publish
        self._free = n_slots
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, Job] | None] = queue.Queue()
        self._pending: dict[int, tuple[float, int]] = {}
        self._tags: dict[int, Tag] = {}
        self._settled: list[Tag] = []
        self.stats = CaptureSlotStats()
        self._seq = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="sparkcache-publisher", daemon=True)
        self._thread.start()

    def try_acquire(self, nbytes: int) -> int | None:
        """A slot ticket, or None (counted) when no slot is free or nbytes exceeds a slot."""
        with self._lock:
            if nbytes > self.slot_bytes:
                self.stats.skipped_too_large += 1
                return None
            if self._free == 0:
                self.stats.skipped_slots_full += 1
                return None
            self._free -= 1
            self._seq += 1
            self._pending[self._seq] = (time.monotonic(), nbytes)
            self.stats.queued += 1
            return self._seq

    def submit(self, ticket: int, job: Job, tag: Tag | None = None) -> None:
        if tag is not None:
            with self._lock:
                self._tags[ticket] = tag
        self._queue.put((ticket, job))

    def cancel(self, ticket: int) -> None:
        self._release(ticket)

    def _release(self, ticket: int) -> None:
        with self._lock:
            self._pending.pop(ticket, None)
            if ticket in self._tags:  # after the outcome was counted in self.stats
                self._settled.append(self._tags.pop(ticket))
            self._free += 1
            self._idle.notify_all()

    def _run(self) -> None:
        cpus.run_as_publisher()  # background work: off the model's cores, at a lower priority
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, job = item
            try:
                result = self._publish(job)
                ok = bool(getattr(result, "ok", result))
            except Exception:  # a publication failure must never reach the serving path
                logger.exception("sparkcache: publication failed")
                ok = False
            with self._lock:
                if ok:
                    self.stats.published += 1
                else:
                    self.stats.publish_failed += 1
            self._release(ticket)

    # ------------------------------------------------------------------ views

    def take_settled(self) -> list[Tag]:
        """Tags of submitted tickets whose outcome is counted, since the last call."""
        with self._lock:
            out, self._settled = self._settled, []
        return out

    def in_use(self) -> int:
        with self._lock:
            return self.n_slots - self._free

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._pending.values())

    def oldest_age(self) -> float:
        with self._lock:
            return time.monotonic() - min(t for t, _ in self._pending.values()) if self._pending else 0.0

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every slot is free (shutdown and tests only; never on the serving path)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._free < self.n_slots:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        self.drain(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=5)
