"""A restore's mapped read of objects that are not in the page cache (``map_verified``'s
cold branch, with the fetch-ahead of ``read_many_verified``): the same bytes as a warm
read, and a flipped byte on disk still refused."""

from __future__ import annotations

import os

import pytest

from bench.store_throughput import drop_caches
from sparkcache.store.objects import CORRUPT, ObjectError, _in_page_cache
from store_helpers import IDENT, conv_keys, conv_pages, open_store

N_BLOCKS, BPP, BLOCK_BYTES = 40, 4, 64 << 10  # 10 pages of 256 KiB


def _evict(path: str) -> None:
    """Drop the file's pages from the page cache: fsync, then ``POSIX_FADV_DONTNEED``; the
    kernel skips a page still held elsewhere (a CPU's LRU batch), so if one stays, drop the
    whole page cache (``/proc/sys/vm/drop_caches``, root: CI runs as root)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _in_page_cache(fd, os.fstat(fd).st_size):
            drop_caches()
        assert not _in_page_cache(fd, os.fstat(fd).st_size), (
            f"{path}: still in the page cache after POSIX_FADV_DONTNEED and drop_caches; run "
            "the tests as root on a disk filesystem (tmpfs cannot drop pages)")
    finally:
        os.close(fd)


@pytest.fixture
def stored(tmp_path):
    store = open_store(tmp_path / "root", page_blocks=BPP)
    pages = conv_pages(1, N_BLOCKS, BPP, BLOCK_BYTES)
    assert store.publish(IDENT, conv_keys(1, N_BLOCKS), pages).ok
    handle = store.lookup(IDENT, conv_keys(1, N_BLOCKS)).handle
    return store, handle, pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_mapped_read_returns_the_stored_bytes(stored, parallel):
    store, handle, pages = stored
    for ref in handle.pages:
        _evict(store.objects.path(ref.digest))
    got = store.objects.read_many_verified(list(handle.pages), mapped=True, parallel=parallel)
    assert [bytes(m) for m in got] == pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_mapped_read_refuses_a_flipped_byte(stored, parallel):
    store, handle, _ = stored
    bad = handle.pages[6]
    path = store.objects.path(bad.digest)
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x01]))
    for ref in handle.pages:
        _evict(store.objects.path(ref.digest))
    with pytest.raises(ObjectError) as exc:
        store.objects.read_many_verified(list(handle.pages), mapped=True, parallel=parallel)
    assert exc.value.reason == CORRUPT and exc.value.digest == bad.digest
