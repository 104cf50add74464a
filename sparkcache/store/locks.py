"""The store's one cross-process lock (``locks/gc.lock``), taken with ``fcntl.flock``.

Shared holders: publishers claiming objects, readers taking pins. Exclusive holder: the
collector while it evicts manifests and deletes objects. Each use opens its own file
description, so the lock also separates threads of one process.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def shared_lock(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class LockTimeout(TimeoutError):
    pass


@contextmanager
def exclusive_lock(path: str, timeout_s: float) -> Iterator[None]:
    """Exclusive lock, polled without blocking so a caller's time budget holds.

    Raises ``LockTimeout`` if it cannot be had within ``timeout_s``.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"{path}: held by another process") from None
                time.sleep(0.0005)
        yield
    finally:
        os.close(fd)
