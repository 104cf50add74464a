"""The S3 backend's puts: a publication's objects, each one PUT with ``If-None-Match: *``.

  1. ``add``: the object's bytes are kept (copied unless they are ``bytes`` already: a caller
     may reuse its buffer once ``add`` returns); every ``_ROUND_BYTES`` bytes or
     ``_ROUND_OBJECTS`` objects kept, a round (3) runs;
  2. ``flush``: a last round;
  3. a round: every kept object PUT (``S3Backend.put_new``), up to ``requests_in_flight`` at
     once; each is placed whole by its one request or not at all (S3 has no partial object),
     so nothing is visible under its name before its PUT succeeded, and a 412 leaves the
     object another writer placed.
An object larger than one PUT may carry (``MAX_PUT_BYTES``) is refused when it is added: a
multipart upload is never used.
"""

from __future__ import annotations

from typing import Callable, Protocol

from .backend import NewObject, PutReceipt
from .layout import check_object_digest
from .manifests import PageRef
from .s3_location import MAX_PUT_BYTES


class Requests(Protocol):
    """What a batch asks of its backend (``s3_backend.S3Backend``, which makes the batch)."""

    def put_new(self, ref: PageRef, data: bytes) -> bool: ...

    def each(self, fn: Callable, items: list) -> list: ...

_ROUND_BYTES = 64 << 20  # bytes kept before a round of PUTs
_ROUND_OBJECTS = 64  # objects kept before a round of PUTs


class S3PutBatch:
    """``backend.PutBatch`` on an S3 bucket (see the module docstring)."""

    def __init__(self, backend: Requests) -> None:
        self.backend = backend
        self._kept: list[tuple[PageRef, bytes]] = []
        self._kept_bytes = 0
        self._written: set[str] = set()
        self._present: set[str] = set()
        self._bytes = 0

    def add(self, obj: NewObject) -> None:
        check_object_digest(obj.ref.digest)
        data = obj.data if isinstance(obj.data, bytes) else bytes(obj.data)
        if len(data) != obj.ref.size:
            raise ValueError(f"object {obj.ref.digest}: {len(data)} bytes given, its ref records {obj.ref.size}")
        if len(data) > MAX_PUT_BYTES:
            raise ValueError(f"object {obj.ref.digest}: {len(data)} bytes, more than one S3 PUT carries "
                             f"({MAX_PUT_BYTES}); lower SPARKCACHE_PAGE_BLOCKS so a page object is smaller")
        self._kept.append((obj.ref, data))
        self._kept_bytes += len(data)
        if self._kept_bytes >= _ROUND_BYTES or len(self._kept) >= _ROUND_OBJECTS:
            self._round()

    def flush(self) -> PutReceipt:
        self._round()
        return PutReceipt(frozenset(self._written), frozenset(self._present), self._bytes)

    def close(self) -> None:
        """Drop what was not flushed (nothing of it was sent)."""
        self._kept.clear()
        self._kept_bytes = 0

    def _round(self) -> None:
        items, self._kept, self._kept_bytes = self._kept, [], 0
        placed = self.backend.each(lambda item: self.backend.put_new(*item), items)
        for (ref, _), was_placed in zip(items, placed):
            if was_placed:
                self._written.add(ref.digest)
                self._bytes += ref.size
            else:
                self._present.add(ref.digest)


__all__ = ["S3PutBatch"]
