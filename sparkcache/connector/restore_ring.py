"""Restores through a ring of host buffers, for KV caches a page cannot be read straight into
(an accelerator's; host blocks whose bytes are not one run in page order).

Each object of a restore (its pages, then its boundary object) is read and verified into a
free slot of the ring by a reader, then placed from that slot, in order: at most ``slots``
objects are in host memory at once, however long the entry. On CUDA the slots are
page-locked and each object goes over on a load stream of the ring's own (one copy into a
device staging buffer, then one ``index_copy_`` per layer), queued after what the model's
stream had queued when the restore began (the forwards that last used its blocks), while the
next objects are read; the host waits for a slot's copy to finish only to reuse that slot.
On the CPU each placement is done when it returns.

``RestoreRing.restore`` returns the bytes placed and, on CUDA, an event on the load stream
once every copy is queued: a synchronous load orders the model's stream after it
(``order_current_stream_after``) and returns without waiting for the copies; an asynchronous
one polls it (``copied``). An object that fails its read stops the restore and is raised
once the reads in flight have ended (they write into slots only) and the copies queued have
landed (vLLM recomputes those blocks next, on its own stream): the objects before it hold
their verified bytes in blocks the caller reports to vLLM as not loaded.

Torch alone (no vLLM, no store): the caller passes how to read an object and how to place it.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import Callable, Sequence

import torch

RING_SLOTS = 4  # objects in host memory at once per restore: reads ahead while one is copied

# read_into(k, buffer): object k read and verified into ``buffer`` (its exact size); raises
# when it is refused. place(k, obj): object k placed from ``obj`` (uint8, on the KV cache's
# device); returns the bytes placed. submit(fn, *args): a read's future (a pool, or done now).
ReadInto = Callable[[int, memoryview], object]
Place = Callable[[int, torch.Tensor], int]
Submit = Callable[..., Future]


class RestoreRing:
    """``slots`` host buffers of ``slot_bytes`` (page-locked for a CUDA ``device``), the load
    stream and the device staging buffer; grown, never shrunk, when a restore holds a larger
    object. One restore at a time (a lock)."""

    def __init__(self, slot_bytes: int, device: torch.device, slots: int = RING_SLOTS) -> None:
        if slots < 1 or slot_bytes < 0:
            raise ValueError(f"a restore ring of {slots} slots of {slot_bytes} bytes")
        self.device = device
        self.cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._slots = slots
        self._allocate(slot_bytes)

    def _allocate(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._host = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                      for _ in range(self._slots)]
        self._copied: list[object | None] = [None] * self._slots  # CUDA: after the slot's last copy
        self._staging = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) if self.cuda else None

    def close(self) -> None:
        """Give the buffers back once the copies queued have landed (a later restore makes
        them again)."""
        with self._lock:
            self._drain()
            self._allocate(0)

    def restore(self, sizes: Sequence[int], read_into: ReadInto, place: Place, submit: Submit,
                after: object | None = None) -> tuple[int, object | None]:
        """Read object k (``sizes[k]`` bytes) into a slot, then place it, for every k in order.
        ``after``: on CUDA, the event the copies wait for (``kv_copy.copy_marker``, recorded
        on the model's thread); None: the calling thread's current stream, now. Returns the
        bytes placed and the load stream's event once every copy is queued (None on the CPU)."""
        with self._lock:
            if max(sizes, default=0) > self.slot_bytes:
                self._drain()
                self._allocate(max(sizes))
            if self._stream is not None:
                if after is None:
                    self._stream.wait_stream(torch.cuda.current_stream(self.device))
                else:
                    self._stream.wait_event(after)
            placed = self._run(sizes, read_into, place, submit)
            return placed, (self._stream.record_event() if self._stream is not None else None)

    def _run(self, sizes: Sequence[int], read_into: ReadInto, place: Place, submit: Submit) -> int:
        reading: deque[tuple[int, int, Future]] = deque()  # (object, slot, its read)
        placed = 0
        try:
            for k, size in enumerate(sizes):
                slot = k % self._slots
                if len(reading) == self._slots:  # the slot's last object: placed before its reuse
                    placed += self._place(reading.popleft(), sizes, place)
                self._wait_copied(slot)
                reading.append((k, slot, submit(read_into, k, memoryview(self._host[slot][:size].numpy()))))
            while reading:
                placed += self._place(reading.popleft(), sizes, place)
        except BaseException:
            wait([future for _, _, future in reading])  # nothing writes into a slot after this
            if self._stream is not None:  # nor into a block: vLLM recomputes them next
                self._stream.synchronize()
            raise
        return placed

    def _place(self, item: tuple[int, int, Future], sizes: Sequence[int], place: Place) -> int:
        k, slot, read = item
        read.result()  # raises the object's refusal
        host = self._host[slot][:sizes[k]]
        if self._stream is None:
            return place(k, host)
        with torch.cuda.stream(self._stream):
            staged = self._staging[:sizes[k]]
            staged.copy_(host, non_blocking=True)
            self._copied[slot] = self._stream.record_event()
            return place(k, staged)

    def _wait_copied(self, slot: int) -> None:
        event = self._copied[slot]
        if event is not None:
            event.synchronize()
            self._copied[slot] = None

    def _drain(self) -> None:
        for slot in range(self._slots):
            self._wait_copied(slot)
        if self._stream is not None:
            self._stream.synchronize()  # the staging buffer's last placements


def order_current_stream_after(event: object | None, device: torch.device) -> None:
    """Make the calling thread's current stream (the model's forward) wait for ``event``."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def copied(event: object | None) -> bool:
    """Whether the copies queued before ``event`` are done (True for None: the CPU)."""
    return event is None or bool(event.query())
