"""The OS page cache in a known state, for benchmarks and tests: drop all of it, evict some
files, count the pages of a file it holds."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_LIBC = ctypes.CDLL(None, use_errno=True)


def drop_caches() -> bool:
    """Drop the whole page cache (``/proc/sys/vm/drop_caches``; root only). False if refused."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def resident_pages(path: str) -> tuple[int, int]:
    """``(pages in the page cache, pages)`` of the file, by ``mincore``, which (unlike a
    read, or a ``RWF_NOWAIT`` probe) never brings a page in."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    total = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data  # the view is gone before close
        vec = (ctypes.c_ubyte * total)()
        if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        return sum(v & 1 for v in vec), total
    finally:
        m.close()


def files_under(root: str) -> list[str]:
    return sorted(os.path.join(d, name) for d, _, names in os.walk(root) for name in names)


def resident_fraction(paths: list[str]) -> float:
    """Of all the files' pages, the fraction in the page cache (1.0 for no pages)."""
    counts = [resident_pages(p) for p in paths]
    total = sum(t for _, t in counts)
    return sum(r for r, _ in counts) / total if total else 1.0


def evict(paths: list[str]) -> None:
    """Take the files out of the page cache: fsync and ``POSIX_FADV_DONTNEED`` each; the
    kernel skips a page still held elsewhere (a CPU's LRU batch), so if any stays, drop the
    whole page cache. Raises, with the fix, when a page still stays."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = [p for p in paths if resident_pages(p)[0]]
    if left:
        drop_caches()
        left = [p for p in left if resident_pages(p)[0]]
    if left:
        raise RuntimeError(f"{left[0]} (and {len(left) - 1} more): still in the page cache after "
                           "POSIX_FADV_DONTNEED and drop_caches; fix: run as root, on a disk "
                           "filesystem (tmpfs cannot drop pages)")


def read_rate(paths: list[str], *, cold: bool) -> dict:
    """The raw read rate of the files: each read whole (``readinto``, no hashing, no placement)
    into its own place in one buffer that holds them all, already faulted in (as the KV cache
    a restore writes into is), from disk (``cold``: evicted first) or from the page cache (read
    once before the timed read). ``{"bytes", "seconds", "gb_per_s"}``."""
    import time

    if cold:
        evict(paths)
    sizes = [os.path.getsize(p) for p in paths]
    view = memoryview(bytearray(sum(sizes)))  # zero-filled: every page faulted in
    if not cold:
        _read_all(paths, sizes, view)
    t = time.perf_counter()
    _read_all(paths, sizes, view)
    seconds = time.perf_counter() - t
    total = sum(sizes)
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9 if seconds > 0 else 0.0}


def _read_all(paths: list[str], sizes: list[int], view: memoryview) -> None:
    at = 0
    for path, size in zip(paths, sizes):
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < size:
                n = f.readinto(view[at + got:at + size])
                if not n:
                    break
                got += n
        at += size
