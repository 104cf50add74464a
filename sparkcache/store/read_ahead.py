"""Disk reads asked for ahead of a restore whose objects are not in the page cache.

A restore reads its page objects one after another on few threads (on a CPU engine, often the
model's thread alone: ``layout.reader_cpus``). From the page cache that is as fast as a read
can be. From the disk, one reader waits for the kernel's readahead of one object at a time,
and the disk idles between its requests. So each read first asks the page cache alone
(``RWF_NOWAIT``: a warm read costs nothing more); the first that finds bytes missing marks
the restore cold, and from then on the objects ahead of the one being read are asked for
(``POSIX_FADV_WILLNEED``), up to ``window_bytes`` past it: their disk reads run together,
while the reader hashes what has come in. A warm restore never asks for anything.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Callable, Sequence

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_nowait_refused = False  # a filesystem said it cannot read without waiting: never try again


class ReadAhead:
    """The read-ahead state of one restore of objects whose sizes are ``sizes`` (in read
    order); ``ask(i)`` asks the kernel for object ``i`` (best effort: it never raises)."""

    def __init__(self, sizes: Sequence[int], ask: Callable[[int], None], window_bytes: int) -> None:
        self._sizes, self._ask, self._window = sizes, ask, window_bytes
        self._lock = threading.Lock()
        self._asked = 0  # objects [0, _asked) asked for
        self.cold = False

    def reading(self, i: int) -> None:
        """Object ``i``'s read begins: once the restore is cold, keep the window ahead of it
        asked for (object ``i`` itself included)."""
        if not self.cold:
            return
        with self._lock:
            end, ahead = i + 1, 0
            while end < len(self._sizes) and ahead + self._sizes[end] <= self._window:
                ahead += self._sizes[end]
                end += 1
            for j in range(max(self._asked, i), end):
                self._ask(j)
            self._asked = max(self._asked, end)

    def missed(self, i: int) -> None:
        """A read of object ``i`` found bytes that are not in the page cache."""
        self.cold = True
        self.reading(i)

    def on_miss(self, i: int) -> Callable[[], None] | None:
        """What the read of object ``i`` calls when it finds bytes missing (``preadv_nowait``);
        None once the restore is known cold (its reads then simply wait)."""
        return None if self.cold else lambda: self.missed(i)


def preadv_nowait(fd: int, buffers: list[memoryview], offset: int) -> int | None:
    """``os.preadv`` from the page cache first: the bytes read (fewer than asked when part of
    the range is not in the page cache), or None when none of it is there (the caller then
    reads again, waiting). Where the filesystem cannot read without waiting, a plain read
    (and no later call asks it again). Other errors are raised as ``os.preadv``'s."""
    global _nowait_refused
    if _NOWAIT and not _nowait_refused:
        try:
            return os.preadv(fd, buffers, offset, _NOWAIT)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _nowait_refused = True
    return os.preadv(fd, buffers, offset)


def ask_for(fd: int, size: int) -> None:
    """Ask the kernel to read ``size`` bytes of ``fd`` into the page cache now (best effort)."""
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # only a hint: the read itself says what is wrong
