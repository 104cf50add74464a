"""An entry's objects from the bucket, a few at a time, handed on in the manifest's order: what
lets a fetch write an entry of any size into the local store through a bounded buffer.

``ObjectFeed(backend, refs, in_flight, stop)`` is the source of a ``PageStream`` for
``PageStore.adopt``:

- every object is one GET through ``backend.get_bytes`` (its size checked), ``in_flight`` at
  once on the backend's request threads, then hashed once on the ``io`` pool (a restore's: the
  request waits for a fetch as for a restore) while the next GETs go: ``NewObject.of``, its
  BLAKE3 name and XXH3-128, what the local store names and records it by, which verifies it too
  (``backend.check_named``: the name, and the XXH3-128 the manifest records; more than a get's
  check, which is one of the two). The publication writes it without hashing it again, and
  ``adopt`` checks every name against the manifest;
  ``start()`` sends the first ones before the publication asks (its local checks run beside them);
- ``stream().chunks()`` yields the objects in order, each chunk the run of consecutive objects
  that have arrived (at least the next one, waited for), so the local writes and hashing of one
  chunk overlap the GETs of the next objects;
- it holds at most ``held_at_most(in_flight)`` objects, counting those in flight, arrived or
  hashed and the chunk handed to the publication (at most ``in_flight`` objects, read only until
  it asks for the next: ``PageStream``'s contract, and the writer keeps no reference past it), so
  ``in_flight`` GETs go on while objects wait to be hashed or written;
- a GET that fails (``absent``, ``corrupt``, ``io_error``) or ``stop`` set (the fetch's deadline)
  ends it: the GETs not begun are not made, and the stream raises ``PageSourceError``, so the
  publication is refused before its manifest is placed; ``error`` keeps the ``ObjectError`` and
  ``stopped`` says the deadline ended it, for the caller's miss.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Iterator, Sequence

from .backend import NewObject, ObjectError, check_named
from .layout import submit
from .manifests import PageRef
from .s3_backend import S3Backend
from .streams import PageSourceError, PageStream


def held_at_most(in_flight: int) -> int:
    """The most objects a feed of ``in_flight`` requests holds at once: those in flight, waiting
    their turn, arrived or hashed, and the chunk handed to the publication."""
    return 2 * max(1, in_flight)


class ObjectFeed:
    """The objects ``refs`` of ``backend``, GET ``in_flight`` at a time (the module docstring)."""

    def __init__(self, backend: S3Backend, refs: Sequence[PageRef], in_flight: int, stop: threading.Event) -> None:
        self.backend, self.refs, self.stop = backend, list(refs), stop
        self.in_flight = max(1, in_flight)
        self.error: ObjectError | None = None
        self.stopped = False
        self._pending: deque[Future] = deque()
        self._next = 0  # the next object to send a GET for

    def stream(self) -> PageStream:
        return PageStream(tuple(r.size for r in self.refs), self._chunks)

    def start(self) -> None:
        """Send the first GETs now."""
        self._send(held_at_most(self.in_flight))

    def _send(self, room: int) -> None:
        """GETs for the next objects while fewer than ``room`` are pending (sent, arrived or
        hashed, not yet handed on); the backend's ``in_flight`` threads run them, so at most
        that many are in flight and the rest wait their turn."""
        while self._next < len(self.refs) and len(self._pending) < room:
            self._pending.append(self.backend.submit(self._get, self.refs[self._next]))
            self._next += 1

    def close(self) -> None:
        """Cancel the GETs not begun (one begun ends by itself, its bytes dropped)."""
        while self._pending:
            self._pending.popleft().cancel()

    def _get(self, ref: PageRef) -> Future:
        """One object GET (its size checked), then hashed and verified on the ``io`` pool (a
        restore's: every allowed CPU, the request waits for it) while this thread sends the next
        GET."""
        return submit(self._verified, ref, self.backend.get_bytes(ref, hashed=False), pool="io")

    def _verified(self, ref: PageRef, data: bytes | bytearray) -> NewObject:
        """``data`` hashed for the local store (``NewObject.of``: its BLAKE3 name and XXH3-128),
        and verified by those: the name ``ref`` gives and the XXH3-128 its manifest records."""
        made = NewObject.of(data)
        check_named(ref, made.ref, self.backend.location.where(self.backend.location.key(ref.digest)))
        return made

    def _chunks(self) -> Iterator[list[NewObject]]:
        try:
            held = held_at_most(self.in_flight)
            while self._next < len(self.refs) or self._pending:
                self._send(held)  # the publication holds none of them now
                chunk = [self._take()]
                while len(chunk) < self.in_flight and self._pending and _ready(self._pending[0]):
                    chunk.append(self._take())
                self._send(held - len(chunk))  # the next GETs go while the publication writes these
                yield chunk
                del chunk  # the publication is done with it once it asks for the next
        finally:
            self.close()

    def _take(self) -> NewObject:
        if self.stop.is_set():
            self.stopped = True
            raise PageSourceError("the fetch's deadline passed (SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS): "
                                  "nothing of the entry is kept")
        try:
            return self._pending.popleft().result().result()
        except ObjectError as exc:
            self.error = exc
            raise PageSourceError(str(exc)) from None


def _ready(pending: Future) -> bool:
    """Whether a pending object's GET and hashing are done."""
    return pending.done() and (pending.exception() is not None or pending.result().done())


__all__ = ["ObjectFeed", "held_at_most"]
