"""``PageStore.publish`` of a ``PageStream``: pages handed over a chunk at a time through one
reused buffer (a capture streamed through its slot) make the same entry as the same pages
given at once, however they are chunked; a producer that fails, or gives pages other than it
declared, refuses the publication with ``source_failed`` and leaves no entry."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcache.store import Reason
from sparkcache.store.streams import PageSourceError, PageStream

from store_helpers import IDENT, conv_keys, open_store, page_bytes

_CONVS = itertools.count(1000)
_DIR = tempfile.TemporaryDirectory(prefix="sc-streams-")
BPP = 2


def _store():
    return open_store(os.path.join(_DIR.name, "s"), page_blocks=BPP)


def _through_one_buffer(pages: list[bytes], cuts: list[int]) -> PageStream:
    """``pages`` a chunk at a time (chunk boundaries at ``cuts``), every chunk copied into the
    same buffer over the previous one, as a capture slot is reused."""
    buffer = bytearray(sum(map(len, pages)))

    def chunks():
        bounds = [0, *sorted(set(cuts)), len(pages)]
        for lo, hi in zip(bounds, bounds[1:]):
            at, views = 0, []
            for page in pages[lo:hi]:
                buffer[at:at + len(page)] = page
                views.append(memoryview(buffer)[at:at + len(page)])
                at += len(page)
            yield views
    return PageStream(tuple(map(len, pages)), chunks)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(1, 24), data=st.data())
def test_any_chunking_through_one_buffer_makes_the_entry_the_pages_make_at_once(blocks, data):
    n_pages = -(-blocks // BPP)
    cuts = data.draw(st.lists(st.integers(0, n_pages), max_size=6), label="cuts")
    store = _store()
    conv = next(_CONVS)
    pages = [page_bytes(conv, p, min(BPP, blocks - p * BPP), 64) for p in range(n_pages)]
    streamed = store.publish(IDENT, conv_keys(conv, blocks), _through_one_buffer(pages, cuts))
    assert streamed.ok, streamed
    entry = store.entry(streamed.entry_id).manifest
    found = store.lookup(IDENT, conv_keys(conv, blocks))
    assert found.hit_blocks == blocks
    assert [bytes(p) for p in store.read(found.handle).pages] == pages
    other = next(_CONVS)  # the same bytes given at once, under other keys: the same objects
    at_once = store.publish(IDENT, conv_keys(other, blocks), pages)
    assert store.entry(at_once.entry_id).manifest.pages == entry.pages


def test_a_stream_can_grow_an_entry_by_reference_and_carry_a_state(tmp_path):
    store = open_store(str(tmp_path / "s"), page_blocks=BPP)
    pages = [page_bytes(1, p, BPP, 64) for p in range(3)]
    assert store.publish(IDENT, conv_keys(1, 4), pages[:2]).ok
    grown = PageStream((None, None, len(pages[2])), lambda: [[pages[2]]])
    result = store.publish(IDENT, conv_keys(1, 6), grown, state=b"state")
    assert result.ok and result.pages_reused == 2, result
    found = store.lookup(IDENT, conv_keys(1, 6), with_state=True)
    assert [bytes(p) for p in store.read(found.handle).pages] == pages
    assert bytes(store.read_pages([found.handle.state])[0]) == b"state"


def _failing_after(pages: list[bytes], n: int):
    def chunks():
        for i, page in enumerate(pages):
            if i == n:
                raise PageSourceError("the copy failed")
            yield [page]
    return chunks


@pytest.mark.parametrize("case", ["fails_midway", "fails_at_once", "short_page", "extra_page",
                                  "missing_page"])
def test_a_producer_that_fails_or_lies_refuses_the_publication_and_leaves_no_entry(tmp_path, case):
    store = open_store(str(tmp_path / "s"), page_blocks=1)
    pages = [page_bytes(2, p, 1, 4096) for p in range(80)]  # more than one sync round of objects
    sizes = tuple(map(len, pages))
    stream = {
        "fails_midway": PageStream(sizes, _failing_after(pages, 70)),
        "fails_at_once": PageStream(sizes, _failing_after(pages, 0)),
        "short_page": PageStream(sizes, lambda: [pages[:5] + [pages[5][:-1]] + pages[6:]]),
        "extra_page": PageStream(sizes, lambda: [pages, [pages[0]]]),
        "missing_page": PageStream(sizes, lambda: [pages[:-1]]),
    }[case]
    result = store.publish(IDENT, conv_keys(2, 80), stream)
    assert (result.ok, result.reason) == (False, Reason.SOURCE_FAILED), result
    assert not store.lookup(IDENT, conv_keys(2, 80)).hit
    assert store.entries() == []
    staging = os.path.join(store.layout.base, "staging")
    left = [f for _, _, files in os.walk(staging) for f in files] if os.path.isdir(staging) else []
    assert left == [], f"temp files left behind: {left}"
    assert store.publish(IDENT, conv_keys(2, 80), pages).ok  # the next capture publishes it
    assert not store.verify_root(str(tmp_path / "s")).problems


def test_a_state_after_a_stream_through_one_buffer_leaves_every_page_its_bytes(tmp_path):
    """The state follows the last chunk: the chunks before are still read one at a time, so
    each page is written before the buffer holds the next."""
    store = open_store(str(tmp_path / "s"), page_blocks=BPP)
    pages = [page_bytes(3, p, BPP, 64) for p in range(4)]
    assert store.publish(IDENT, conv_keys(3, 8), _through_one_buffer(pages, [1, 2, 3]), state=b"state").ok
    found = store.lookup(IDENT, conv_keys(3, 8), with_state=True)
    assert [bytes(p) for p in store.read(found.handle).pages] == pages
    assert bytes(store.read_pages([found.handle.state])[0]) == b"state"


def test_a_publication_waits_in_its_pace_before_each_chunk_and_page_and_writes_nothing_meanwhile(tmp_path):
    """``pace`` is called before each chunk of pages is hashed and before each page is put
    (the connector holds publication there while the model prefills): while it waits, no
    object of the publication is written, and the first call comes before any hashing."""
    import threading

    store = open_store(str(tmp_path / "s"), page_blocks=1)
    pages = [page_bytes(31, b, 1) for b in range(4)]
    stream = PageStream.of(pages)
    chunks = len(list(PageStream.of(pages).checked_chunks()))
    go = threading.Event()
    calls: list[int] = []

    def pace() -> None:
        calls.append(len(store.objects.list()))
        go.wait(30)

    done: list = []
    publisher = threading.Thread(target=lambda: done.append(store.publish(IDENT, conv_keys(31, 4), stream, pace=pace)))
    publisher.start()
    try:
        for _ in range(200):
            if calls:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.1)
        assert calls == [0] and store.objects.list() == [], "a page was written while its pace held it"
    finally:
        go.set()
        publisher.join(30)
    assert done and done[0].ok and len(calls) == chunks + 4, (done, calls, chunks)
    assert len(store.objects.list()) == 4
