"""A bounded number of capture slots, drained by one publisher thread.

Each slot owns one host buffer of ``slot_bytes``, kept until ``close`` (the worker makes them
all when vLLM registers its KV caches: captures never allocate on the serving path; its
``close`` gives them back, not the garbage collector). The worker copies a capture's pages
into its slot, now (a hybrid boundary, whose blocks vLLM may reuse after this step) or on
the publisher thread a slot's worth at a time (a finished request, whose blocks vLLM holds
until ``finished_sending``), and the publisher writes them to the store.
What captures hold in host memory is therefore at most ``n_slots x slot_bytes``. When every
slot is taken, or a capture that must be copied at once is larger than one slot, the
publication is skipped and counted: serving never waits for a slot.

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


@dataclass
class _Ticket:
    slot: int
    since: float
    nbytes: int


class CaptureSlots(Generic[Job, Tag]):
    """``publish(job, buffer_of)`` runs on the publisher thread; ``buffer_of()`` is the
    ticket's slot buffer. Its result counts as published when its ``ok`` is true (a
    ``PublishResult``) or, having none, when it is truthy. ``allocate(nbytes)`` makes a
    slot's buffer."""

    def __init__(self, n_slots: int, slot_bytes: int,
                 publish: Callable[[Job, Callable[[], memoryview]], object],
                 allocate: Callable[[int], memoryview]) -> None:
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self._publish = publish
        self._allocate = allocate
        self._free_slots = list(range(n_slots))
        self._buffers: dict[int, memoryview] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, Job] | None] = queue.Queue()
        self._pending: dict[int, _Ticket] = {}
        self._tags: dict[int, Tag] = {}
        self._settled: list[Tag] = []
        self.stats = CaptureSlotStats()
        self._seq = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="sparkcache-publisher", daemon=True)
        self._thread.start()

    def try_acquire(self, nbytes: int) -> int | None:
        """A slot ticket for a capture holding ``nbytes`` in the slot at a time, or None
        (counted) when no slot is free or nbytes exceeds a slot."""
        with self._lock:
            if nbytes > self.slot_bytes:
                self.stats.skipped_too_large += 1
                return None
            if not self._free_slots:
                self.stats.skipped_slots_full += 1
                return None
            self._seq += 1
            self._pending[self._seq] = _Ticket(self._free_slots.pop(), time.monotonic(), nbytes)
            self.stats.queued += 1
            return self._seq

    def allocate_all(self) -> None:
        """Make every slot's buffer now (else each is made on its first use)."""
        for slot in range(self.n_slots):
            with self._lock:
                if slot in self._buffers:
                    continue
            made = self._allocate(self.slot_bytes)
            with self._lock:
                self._buffers.setdefault(slot, made)

    def buffer(self, ticket: int) -> memoryview:
        """The slot buffer of a ticket not yet released (``slot_bytes`` long)."""
        with self._lock:
            slot = self._pending[ticket].slot
            if slot not in self._buffers:
                self._buffers[slot] = self._allocate(self.slot_bytes)
            return self._buffers[slot]

    def submit(self, ticket: int, job: Job, tag: Tag | None = None) -> None:
        if tag is not None:
            with self._lock:
                self._tags[ticket] = tag
        self._queue.put((ticket, job))

    def cancel(self, ticket: int) -> None:
        self._release(ticket)

    def _release(self, ticket: int) -> None:
        with self._lock:
            held = self._pending.pop(ticket)
            if ticket in self._tags:  # after the outcome was counted in self.stats
                self._settled.append(self._tags.pop(ticket))
            self._free_slots.append(held.slot)
            self._idle.notify_all()

    def _run(self) -> None:
        cpus.run_as_publisher()  # background work: off the model's cores, at a lower priority
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, job = item
            try:
                result = self._publish(job, lambda: self.buffer(ticket))
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
            return self.n_slots - len(self._free_slots)

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(t.nbytes for t in self._pending.values())

    def buffer_bytes(self) -> int:
        """Host memory the slots' buffers hold (at most ``n_slots x slot_bytes``)."""
        with self._lock:
            return sum(b.nbytes for b in self._buffers.values())

    def oldest_age(self) -> float:
        with self._lock:
            return time.monotonic() - min(t.since for t in self._pending.values()) if self._pending else 0.0

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every slot is free (shutdown and tests only; never on the serving path)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while len(self._free_slots) < self.n_slots:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Drain, stop the publisher and, once it has stopped, give the slots' buffers back
        (pinned on CUDA: up to ``n_slots x slot_bytes`` of page-locked memory). Nothing is
        captured after it: no slot is free any more. A second call does nothing."""
        if not self._thread.is_alive():  # closed
            return
        self.drain(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=5)
        with self._lock:
            self._free_slots.clear()
            if not self._thread.is_alive():  # else a publication past the timeouts still uses them
                self._buffers.clear()
