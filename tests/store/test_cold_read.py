"""A restore's read of objects that are not in the page cache (``read_many_verified`` on one
thread and on the pool): the same bytes as a warm read, and a flipped byte on disk still
refused; a lookup whose checks wait for the disk checks its pages in parallel."""

from __future__ import annotations

import os

import pytest

from bench.page_cache import evict
from faultfs import FaultFS
from sparkcache.store.objects import ObjectError
from sparkcache.store.reasons import Reason
from store_helpers import IDENT, conv_keys, conv_pages, flip_bit, open_store

N_BLOCKS, BPP, BLOCK_BYTES = 40, 4, 64 << 10  # 10 pages of 256 KiB


@pytest.fixture
def stored(tmp_path):
    store = open_store(tmp_path / "root", page_blocks=BPP)
    pages = conv_pages(1, N_BLOCKS, BPP, BLOCK_BYTES)
    assert store.publish(IDENT, conv_keys(1, N_BLOCKS), pages).ok
    handle = store.lookup(IDENT, conv_keys(1, N_BLOCKS)).handle
    return store, handle, pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_read_returns_the_stored_bytes(stored, parallel):
    store, handle, pages = stored
    evict([store.objects.path(ref.digest) for ref in handle.pages])  # raises unless all cold
    got = store.objects.read_many_verified(list(handle.pages), parallel=parallel)
    assert [bytes(m) for m in got] == pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_read_refuses_a_flipped_byte(stored, parallel):
    store, handle, _ = stored
    bad = handle.pages[6]
    flip_bit(store.objects.path(bad.digest), 1000)
    evict([store.objects.path(ref.digest) for ref in handle.pages])  # raises unless all cold
    with pytest.raises(ObjectError) as exc:
        store.objects.read_many_verified(list(handle.pages), parallel=parallel)
    assert exc.value.reason == Reason.CORRUPT and exc.value.digest == bad.digest


def test_a_lookup_that_waits_for_the_disk_checks_the_rest_of_its_pages_in_parallel(tmp_path):
    """A page check that took as long as a disk read (its inode not in memory) hands the
    other pages' checks to parallel threads, so their reads overlap; here a real filesystem
    (FUSE) is made slow to give each object's attributes, and serves several callers at once."""
    with FaultFS(tmp_path / "fs") as fs:
        store = open_store(fs.mount / "s", page_blocks=1)
        n = 12
        assert store.publish(IDENT, conv_keys(1, n), [os.urandom(4096) for _ in range(n)]).ok
        fs.clear()
        fs.slow("getattr", r"/objects/[0-9a-f]{2}/", 0.05)
        assert store.lookup(IDENT, conv_keys(1, n)).hit
        assert fs.most_at_once("getattr") >= 2, "the pages were checked one after another"
