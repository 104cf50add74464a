"""The store's one cross-process lock (``locks/gc.lock``), taken with ``fcntl.flock``.

Shared holders: publishers claiming objects, readers taking pins. Exclusive holder: the
collector while it evicts manifests and deletes objects. Each use opens its own file
description, so the lock also separates threads of one process.

Every wait is bounded: the lock is polled without blocking, and a holder that never lets
go (a process stopped with SIGSTOP, a hung NFS client) makes the caller give up with
``LockTimeout`` after its time budget instead of hanging the server.

A wait that gives up is counted, per store and kind (``take_lock_timeouts``: the writing
worker exports them as ``vllm:sparkcache_lock_timeouts_total{lock}``), not logged: a
maintenance pass that waits 20 ms for the exclusive lock while another process publishes is
ordinary contention. Only waits of ``LONG_WAIT_S`` or more that gave up suggest a stopped or
hung holder; those are logged at most once per ``WARN_EVERY_S`` per store, with their count.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
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

# A wait at least this long that still failed: the holder may be stopped or hung (a pass
# holds the exclusive lock for about its budget, 100 ms by default); logged, rarely.
LONG_WAIT_S = 1.0
WARN_EVERY_S = 60.0


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
                why = ("a stopped or hung sparkcache process? find it with " if timeout_s >= LONG_WAIT_S
                       else "contention with another process's maintenance or publications; "
                       "if it persists, find the holder with ")
                raise LockTimeout(f"{what}: held by another process for more than {timeout_s:g} s "
                                  f"({why}`fuser {what}`)") from None
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
        except LockTimeout:
            if timeout_s > 0:  # a try without waiting (discard's) is not a timeout
                _contention.count(layout.base, operation, timeout_s, path)
            raise
        yield
    finally:
        os.close(fd)  # closing releases the lock


_LOCK_WORDS = {fcntl.LOCK_SH: "shared_lock", fcntl.LOCK_EX: "exclusive_lock"}
_KINDS = {fcntl.LOCK_SH: "shared", fcntl.LOCK_EX: "exclusive"}


class _Contention:
    """Waits that gave up, per store directory and kind, until taken; and the rare warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}
        self._long: dict[str, int] = {}  # long waits not yet in a warning, per store
        self._warned_at: dict[str, float] = {}

    def count(self, base: str, operation: int, timeout_s: float, path: str) -> None:
        with self._lock:
            counts = self._counts.setdefault(base, {})
            counts[_KINDS[operation]] = counts.get(_KINDS[operation], 0) + 1
            if timeout_s < LONG_WAIT_S:
                return
            self._long[base] = self._long.get(base, 0) + 1
            now = time.monotonic()
            if now - self._warned_at.get(base, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._warned_at[base], n = now, self._long.pop(base)
        log.warning("sparkcache: %d wait(s) of %g s or more for the store lock %s gave up since "
                    "the last such warning (at most one a minute; every wait that gives up is "
                    "counted in vllm:sparkcache_lock_timeouts_total): another process held it "
                    "that long, a stopped or hung one? find it with `fuser %s`",
                    n, LONG_WAIT_S, path, path)

    def take(self, base: str) -> dict[str, int]:
        with self._lock:
            return self._counts.pop(base, {})


_contention = _Contention()


def take_lock_timeouts(layout: StoreLayout) -> dict[str, int]:
    """Waits for this store's lock that gave up in this process since the last call, by kind
    (``shared``, ``exclusive``; absent: none); a try without waiting is not counted."""
    return _contention.take(layout.base)


def shared_lock(layout: StoreLayout, timeout_s: float):
    """The shared lock, within ``timeout_s`` (``LockTimeout`` after that)."""
    return _locked(layout, fcntl.LOCK_SH, timeout_s)


def exclusive_lock(layout: StoreLayout, timeout_s: float):
    """The exclusive lock, within ``timeout_s`` (``LockTimeout`` after that)."""
    return _locked(layout, fcntl.LOCK_EX, timeout_s)
