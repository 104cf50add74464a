"""A restore that finds its objects out of the page cache asks the disk for the objects ahead
of the one it reads (``read_ahead``), so their reads run together; a warm restore asks for
nothing. Real files on the real disk, evicted with ``POSIX_FADV_DONTNEED``; what the kernel
was asked for shows as pages coming into the page cache (``mincore``) while the reader is held
before its next page."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.page_cache import evict, resident_fraction
from sparkcache.store import cpus, objects
from sparkcache.store.layout import pool_cpus, reader_cpus
from sparkcache.store.read_ahead import ReadAhead
from store_helpers import IDENT, conv_keys, open_store

PAGE = 1 << 20
N = 8


@pytest.fixture
def stored(tmp_path):
    """N pages of an entry, read by one reader (as on a CPU engine whose model's OpenMP threads
    spin on every CPU): a second reader would read on while the first is held."""
    cpus.note_spinning_cpus({"GOMP_CPU_AFFINITY": " ".join(map(str, pool_cpus("io")))})
    assert len(reader_cpus("io")) == 1
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = [os.urandom(PAGE) for _ in range(N)]
    assert store.publish(IDENT, conv_keys(1, N), pages).ok
    refs = list(store.lookup(IDENT, conv_keys(1, N)).handle.pages)
    yield store, pages, refs, [store.objects.path(ref.digest) for ref in refs]
    cpus.note_spinning_cpus({})


def _in_page_cache(paths: list[str], within_s: float) -> bool:
    """Whether every page of ``paths`` is in the page cache within ``within_s`` (polled: the
    disk reads a hint started end on their own)."""
    deadline = time.monotonic() + within_s
    while resident_fraction(paths) < 1.0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _restore(store, refs, at_page: int, look):
    """``read_pages_into`` of every page; before page ``at_page`` is read, ``look()`` runs
    (the reader waits for it). Returns the bytes read and what ``look`` returned."""
    views = [memoryview(bytearray(ref.size)) for ref in refs]
    seen = []

    def views_of(i: int):
        if i == at_page:
            seen.append(look())
        return [views[i]]

    store.read_pages_into(refs, views_of)
    return [bytes(v) for v in views], seen[0]


def test_a_cold_restore_asks_the_disk_for_the_objects_ahead(stored):
    store, pages, refs, paths = stored
    evict(paths)
    got, ahead_came = _restore(store, refs, 1, lambda: _in_page_cache(paths[1:], 10.0))
    assert got == pages
    assert ahead_came, "the objects after the first cold one were not asked for: none came in"


def test_the_read_ahead_stays_within_its_window(stored, monkeypatch):
    store, pages, refs, paths = stored
    monkeypatch.setattr(objects, "_READ_AHEAD_BYTES", 3 * PAGE)
    evict(paths)

    def look():  # reading page 1: pages 1..4 (page 1 and three more) asked for, none after
        return _in_page_cache(paths[1:5], 10.0), resident_fraction(paths[5:])

    got, (window_came, beyond) = _restore(store, refs, 1, look)
    assert got == pages
    assert window_came and beyond == 0.0


def test_a_warm_restore_asks_for_nothing(stored):
    store, pages, refs, paths = stored
    evict(paths[-2:])  # the first pages warm: no read misses before the last two

    got, last_came = _restore(store, refs, 1, lambda: _in_page_cache(paths[-2:], 0.5))
    assert got == pages
    assert not last_came, "objects were asked for before any read missed the page cache"


@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30), window=st.integers(0, 120),
       data=st.data())
def test_each_object_in_the_window_is_asked_for_once_from_the_first_miss_on(sizes, window, data):
    miss = data.draw(st.integers(0, len(sizes) - 1), label="miss")
    reads = sorted(data.draw(st.sets(st.integers(0, len(sizes) - 1)), label="reads") | {miss})
    asked: list[int] = []
    ahead = ReadAhead(sizes, asked.append, window)
    for i in reads:
        ahead.reading(i)
        if i == miss:
            assert ahead.on_miss(i) is not None
            ahead.on_miss(i)()
        elif i > miss:
            assert ahead.on_miss(i) is None  # known cold: no more asking the page cache first

    def window_of(i: int) -> set[int]:
        end, total = i + 1, 0
        while end < len(sizes) and total + sizes[end] <= window:
            total += sizes[end]
            end += 1
        return set(range(i, end))

    assert len(asked) == len(set(asked)), "an object was asked for twice"
    assert set(asked) == set().union(*(window_of(i) for i in reads if i >= miss))
