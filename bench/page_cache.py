"""The OS page cache in a known state, for benchmarks and tests: drop all of it, evict some
files, count the pages of a file it holds."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

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


def read_rate(paths: list[str], *, cold: bool, reps: int = 1) -> dict:
    """The raw read rate of the files: each read whole (``readinto``, no hashing, no placement)
    into its own place in one buffer (of them all, or of ``BUFFER_CAP`` reused in turn),
    faulted in but out of the CPU's caches, as the KV cache blocks a restore writes into are
    (``evict_cpu_caches``), from disk (``cold``: evicted first) or from the page cache (read
    just before the timed read, as a warm restore finds them). ``{"bytes", "seconds",
    "gb_per_s"}``; warm, also ``hot_destination_seconds`` and ``hot_destination_gb_per_s``:
    the same read once more into the same buffer, now in the CPU's caches (what a buffer read
    twice measures, no restore's state). ``reps`` > 1: measured that many times, the median
    by ``seconds`` returned, with every rate in ``samples_gb_per_s`` (one read of a few
    milliseconds varies by a third between runs on a shared machine)."""
    runs = sorted((_read_rate_once(paths, cold=cold) for _ in range(max(1, reps))), key=lambda r: r["seconds"])
    out = dict(runs[len(runs) // 2])
    if len(runs) > 1:
        out["samples_gb_per_s"] = [r["gb_per_s"] for r in runs]
    return out


def _read_rate_once(paths: list[str], *, cold: bool) -> dict:
    import time

    if cold:
        evict(paths)
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    view = memoryview(bytearray(min(total, BUFFER_CAP)))
    _fill(view, 0)  # every page faulted in
    evict_cpu_caches()
    if not cold:  # the files just read, as before a warm restore; the buffer not touched
        _read_all(paths, sizes, None)
    t = time.perf_counter()
    _read_all(paths, sizes, view)
    seconds = time.perf_counter() - t
    out = {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9 if seconds > 0 else 0.0}
    if not cold:
        t = time.perf_counter()
        _read_all(paths, sizes, view)
        out["hot_destination_seconds"] = hot = time.perf_counter() - t
        out["hot_destination_gb_per_s"] = total / hot / 1e9 if hot > 0 else 0.0
    return out


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache ``caches`` (CPU 0's, in sysfs) names; 0 where it names none."""
    sizes = [0]
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


# The most a benchmark's stand-in destination holds: far past any CPU cache, so a buffer of it
# reused in turn is as cold to the CPU as one of the whole size, and an entry of a 70B rank at
# 128K tokens is measured without a second copy of itself in memory.
BUFFER_CAP = 1 << 30
_FLUSH_FLOOR = 64 << 20  # the buffer written when sysfs names no cache
_flush: bytearray | None = None


def evict_cpu_caches() -> None:
    """Push what the CPU's caches hold out to memory: write a buffer twice the last-level
    cache (allocated and faulted in once per process)."""
    global _flush
    if _flush is None:
        _flush = bytearray(max(2 * last_level_cache_bytes(), _FLUSH_FLOOR))
    _fill(memoryview(_flush), 1)


def _fill(view: memoryview, byte: int) -> None:
    ctypes.memset((ctypes.c_char * view.nbytes).from_buffer(view), byte, view.nbytes)


_CHUNK = 1 << 20  # the reused buffer a read goes through when it keeps nothing


def _read_all(paths: list[str], sizes: list[int], view: memoryview | None) -> None:
    """Each file whole into its place in ``view`` (back at its start for a file that does not
    fit in what is left), or (None) through one small reused buffer."""
    scratch = memoryview(bytearray(_CHUNK)) if view is None else None
    at = 0
    for path, size in zip(paths, sizes):
        if view is not None and at + size > view.nbytes:
            if size > view.nbytes:
                raise ValueError(f"{path}: {size} bytes, more than the read's buffer of {view.nbytes}")
            at = 0
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < size:
                dest = scratch[:min(_CHUNK, size - got)] if scratch is not None else view[at + got:at + size]
                n = f.readinto(dest)
                if not n:
                    break
                got += n
        at += size
