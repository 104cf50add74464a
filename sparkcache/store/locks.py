"""The store's one cross-process lock (``locks/gc.lock``), taken with ``fcntl.flock``.

Shared holders: publishers claiming objects, readers taking pins. Exclusive holder: the
collector while it evicts manifests and deletes objects. Each use opens its own file
description, so the lock also separates threads of one process.

Every wait is bounded: the lock is polled without blocking, and a holder that never lets
go (a process stopped with SIGSTOP, a hung NFS client) makes the caller give up with
``LockTimeout`` after its time budget instead of hanging the server.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from typing import Iterator

from .layout import StoreLayout
from ..settings import check_number

log = logging.getLogger("sparkcache.store")

# The longest waits for the shared lock (a maintenance pass holds the exclusive one for
# its budget, 100 ms by default, plus a slow fsync): a publication runs on a background
# thread and may wait longer than a leased lookup, which the scheduler waits on.
PUBLISH_WAIT_S = 10.0
PIN_WAIT_S = 2.0


class LockTimeout(TimeoutError):
    pass


def flock_within(fd: int, operation: int, timeout_s: float, what: str) -> None:
    """``flock(fd, operation)``, polled, giving up with ``LockTimeout`` after ``timeout_s``
    (a finite number of seconds >= 0; 0: one try)."""
    check_number("flock_within", "timeout_s", timeout_s, minimum=0, unit="seconds")
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{what}: held by another process for more than {timeout_s:g} s "
                                  "(a stopped or hung sparkcache process? find it with "
                                  f"`fuser {what}`)") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


@contextmanager
def _locked(layout: StoreLayout, operation: int, timeout_s: float) -> Iterator[None]:
    check_number(_LOCK_WORDS[operation], "timeout_s", timeout_s, minimum=0, unit="seconds")
    path = layout.gc_lock_path
    fd = layout.open_file(path, os.O_RDWR | os.O_CREAT, create_dirs=True)
    try:
        try:
            flock_within(fd, operation, timeout_s, path)
        except LockTimeout as exc:
            if timeout_s > 0:
                log.warning("sparkcache: gave up waiting for the store lock: %s", exc)
            raise
        yield
    finally:
        os.close(fd)  # closing releases the lock


_LOCK_WORDS = {fcntl.LOCK_SH: "shared_lock", fcntl.LOCK_EX: "exclusive_lock"}


def shared_lock(layout: StoreLayout, timeout_s: float):
    """The shared lock, within ``timeout_s`` (``LockTimeout`` after that)."""
    return _locked(layout, fcntl.LOCK_SH, timeout_s)


def exclusive_lock(layout: StoreLayout, timeout_s: float):
    """The exclusive lock, within ``timeout_s`` (``LockTimeout`` after that)."""
    return _locked(layout, fcntl.LOCK_EX, timeout_s)
