"""Pages a publication reads a chunk at a time: what lets an entry of any length be stored
through a bounded host buffer.

A capture that streams copies a few pages out of the KV cache into its slot, the store
hashes and writes them (``write_all`` copies them into the page cache), then the capture
copies the next few into the same slot. ``PageStream`` says up front how large every page
is (so capacity is checked before anything is written) and hands the pages over chunk by
chunk; a chunk's buffers are only read until the next chunk is asked for. A page may come
hashed already, as a ``backend.NewObject`` that ``NewObject.of`` made (a fetch from the shared
tier hashes each object on the ``io`` pool as it arrives, beside the next GETs); it is
written under that name as it is, and ``adopt`` still checks every name against the manifest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from .backend import NewObject
from .buffers import byte_view

Buffer = bytes | bytearray | memoryview | NewObject


class PageSourceError(Exception):
    """The producer of a stream could not give its pages (its copy failed, or its source
    could no longer be trusted); the publication is refused and leaves no entry."""


@dataclass(frozen=True)
class PageStream:
    """``sizes[i]``: page i's bytes, or None for a page a stored entry holds (given by
    reference, never in a chunk). ``chunks()`` yields the other pages in order, a list at a
    time; it may raise ``PageSourceError``."""

    sizes: tuple[int | None, ...]
    chunks: Callable[[], Iterable[Sequence[Buffer]]]

    @classmethod
    def of(cls, pages: Sequence[Buffer | None]) -> "PageStream":
        """Pages already in memory, as one chunk (each checked by ``byte_view``)."""
        views = [None if p is None else byte_view(p, f"page {i}") for i, p in enumerate(pages)]
        given = [v for v in views if v is not None]
        return cls(tuple(None if v is None else len(v) for v in views), lambda: [given])

    def followed_by(self, last: Buffer) -> "PageStream":
        """This stream and one more page after it (an entry's state object)."""
        view = byte_view(last, "state")
        chunks = self.chunks
        return PageStream((*self.sizes, len(view)), lambda: itertools.chain(chunks(), [[view]]))

    @property
    def given_bytes(self) -> int:
        return sum(s for s in self.sizes if s is not None)

    def checked_chunks(self) -> Iterator[list[tuple[int, memoryview | NewObject]]]:
        """Each chunk as (index, bytes or hashed object) of its pages, checked against
        ``sizes``: a page of another size, one too many or one missing is a ``PageSourceError``."""
        wanted = iter([i for i, s in enumerate(self.sizes) if s is not None])
        for chunk in self.chunks():
            out = []
            for page in chunk:
                i = next(wanted, None)
                view = page if isinstance(page, NewObject) else byte_view(page, "page" if i is None else f"page {i}")
                n = view.ref.size if isinstance(view, NewObject) else len(view)
                if i is None or n != self.sizes[i]:
                    raise PageSourceError(f"the stream gave a page of {n} bytes where "
                                          + ("it declared no more pages" if i is None else
                                             f"page {i} was declared {self.sizes[i]} bytes"))
                out.append((i, view))
            yield out
            out = view = page = chunk = None  # nothing of a chunk is held while the next is asked for
        missing = next(wanted, None)
        if missing is not None:
            raise PageSourceError(f"the stream ended before page {missing} of {len(self.sizes)}")


__all__ = ["PageSourceError", "PageStream"]
