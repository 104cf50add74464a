"""A restore's mapped read of objects that are not in the page cache (``map_verified``'s
cold branch, with the fetch-ahead of ``read_many_verified``): the same bytes as a warm
read, and a flipped byte on disk still refused."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from bench.store_throughput import drop_caches
from sparkcache.store.objects import CORRUPT, ObjectError
from store_helpers import IDENT, conv_keys, conv_pages, open_store

N_BLOCKS, BPP, BLOCK_BYTES = 40, 4, 64 << 10  # 10 pages of 256 KiB
_LIBC = ctypes.CDLL(None, use_errno=True)


def _resident_pages(path: str) -> int:
    """Pages of the file in the page cache, by ``mincore`` (which, unlike a read, never
    brings one in)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        assert _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)
    finally:
        m.close()


def _evict(path: str) -> None:
    """Drop the file's pages from the page cache: fsync, then ``POSIX_FADV_DONTNEED``; the
    kernel skips a page still held elsewhere (a CPU's LRU batch), so if one stays, drop the
    whole page cache (``/proc/sys/vm/drop_caches``, root: CI runs as root)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident_pages(path):
        drop_caches()
    assert not _resident_pages(path), (
        f"{path}: still in the page cache after POSIX_FADV_DONTNEED and drop_caches; run the "
        "tests as root on a disk filesystem (tmpfs cannot drop pages)")


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
