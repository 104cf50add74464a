"""New files written past the page cache (``O_DIRECT``), a few at once: how a fetch from the
shared tier puts an entry into the local store.

A write into the page cache copies every byte into new page-cache pages, and on a host short of
free memory (a VM whose balloon took it back) taking those pages costs more than the network
did (docs/RESULTS.md, issue 44). With O_DIRECT the device reads the bytes from our own buffer:

- ``AlignedCopy``: one page-aligned buffer; ``load`` copies an object's bytes into it (the
  caller's buffer is free again when it returns), ``write_to`` writes them to a new file in
  aligned ``WRITE_CHUNK`` pieces, the last padded to ``DIRECT_ALIGN``, then cuts the file back
  to its length. Where the filesystem refuses O_DIRECT (``EINVAL``: tmpfs before Linux 6.6,
  some FUSE and network filesystems) it writes them the usual way instead and says so.
- ``DirectWrites``: ``DEPTH`` buffers; ``start`` loads one and writes it on the ``direct`` pool
  (its own threads, off the model's CPUs: a write waits on the device, never behind a restore's
  reads), waiting for the oldest write when all are busy, so a batch holds at most ``DEPTH``
  objects' bytes beside its caller's; ``wait`` returns once every write started is done
  (raising the first error), before the files are synced or closed.
Nothing here makes a file durable: the put batch's fdatasync does, as for any other write.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections import deque
from concurrent.futures import Future, wait

from .layout import WRITE_CHUNK, submit

DIRECT_ALIGN = 4096  # the offset, length and memory unit of an O_DIRECT write (a page: every block size fits)
DEPTH = 4  # files written at once, each from its own buffer
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # what a filesystem without O_DIRECT answers
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the system has none: every write the usual way


def _padded(n: int) -> int:
    """``n`` rounded up to the O_DIRECT unit."""
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def _set_direct(fd: int, flags: int) -> bool:
    """Add O_DIRECT to ``fd``'s ``flags``; False where the system or the filesystem refuses it."""
    if not _O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno not in _REFUSED:
            raise
        return False
    return True


class AlignedCopy:
    """One object's bytes in a page-aligned buffer, written to a new file past the page cache
    (the module docstring). The buffer is kept for the next object. Not thread-safe."""

    def __init__(self) -> None:
        self._buf: mmap.mmap | None = None
        self._size = 0

    def load(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in, ``WRITE_CHUNK`` at a time (other threads get the GIL between
        pieces), and zero the padding after it."""
        with memoryview(data) as given, given.cast("B") as view:
            n = len(view)
            padded = _padded(n)
            if self._buf is None or len(self._buf) < padded:
                self.close()
                self._buf = mmap.mmap(-1, max(padded, DIRECT_ALIGN), flags=mmap.MAP_PRIVATE)
            for at in range(0, n, WRITE_CHUNK):
                self._buf[at:min(n, at + WRITE_CHUNK)] = view[at:at + WRITE_CHUNK]
        self._buf[n:padded] = bytes(padded - n)
        self._size = n

    def write_to(self, fd: int) -> bool:
        """Write the loaded bytes to ``fd``, a new empty file: True past the page cache; False
        where the filesystem refused O_DIRECT, written the usual way then (``fd``'s flags as
        they were, unless an error is raised: the file is then abandoned)."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if not _set_direct(fd, flags):
            self._write_plain(fd, 0)
            return False
        try:
            self._write_direct(fd, flags)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # it took the flag and refused the write
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            self._write_plain(fd, 0)
            return False
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return True

    def close(self) -> None:
        buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.close()
            except BufferError:
                pass  # a view of it outlives us (a traceback's): unmapped once that goes

    def _write_direct(self, fd: int, flags: int) -> None:
        """Aligned pieces from the buffer; after a short write that ends off the 4 KiB unit
        (allowed, if rare), the rest the usual way. The file is then cut to its length."""
        n, at = self._size, 0
        padded = _padded(n)
        with memoryview(self._buf) as out:
            while at < padded:
                with out[at:min(padded, at + WRITE_CHUNK)] as piece:
                    wrote = os.write(fd, piece)
                if wrote <= 0:
                    raise OSError(errno.EIO, f"a direct write wrote nothing at byte {at} of {padded}")
                at += wrote
                if at % DIRECT_ALIGN and at < n:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                    self._write_plain(fd, at)
                    break
        if at != n:
            os.ftruncate(fd, n)

    def _write_plain(self, fd: int, at: int) -> None:
        """The loaded bytes from ``at`` on, written the usual way (no view outlives the call)."""
        with memoryview(self._buf) as out:
            while at < self._size:
                with out[at:min(self._size, at + WRITE_CHUNK)] as piece:
                    at += os.write(fd, piece)


class DirectWrites:
    """A put batch's files written past the page cache, ``DEPTH`` at once (the module
    docstring). ``refused`` turns True once the filesystem refused O_DIRECT: the batch then
    writes the usual way itself. Used from one thread."""

    def __init__(self, depth: int = DEPTH) -> None:
        self._idle = [AlignedCopy() for _ in range(max(1, depth))]
        self._busy: deque[tuple[Future, AlignedCopy]] = deque()
        self.refused = False

    def start(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` (free again on return) and write it to ``fd`` in the background."""
        if not self._idle:
            self._settle(*self._busy.popleft())
        copy = self._idle.pop()
        copy.load(data)
        self._busy.append((submit(copy.write_to, fd, pool="direct"), copy))

    def wait(self) -> None:
        """Return once every write started is done; the first error, once all are."""
        first = None
        while self._busy:
            try:
                self._settle(*self._busy.popleft())
            except Exception as exc:  # noqa: BLE001 - every write is waited for before any error is raised
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the writes still running (their errors are the abandoned batch's), then
        free the buffers."""
        wait([future for future, _ in self._busy])
        copies, self._idle = self._idle + [copy for _, copy in self._busy], []
        self._busy.clear()
        for copy in copies:
            copy.close()

    def _settle(self, future: Future, copy: AlignedCopy) -> None:
        self._idle.append(copy)
        if not future.result():
            self.refused = True


__all__ = ["AlignedCopy", "DEPTH", "DIRECT_ALIGN", "DirectWrites"]
