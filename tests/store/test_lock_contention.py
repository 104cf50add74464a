"""Contention on the store's lock is counted, not logged per event: another process holding
``locks/gc.lock`` makes every bounded wait give up, and only a wait long enough to suggest a
stopped or hung holder is logged, at most once per interval with the count. The holder is a
real process; the waits are the store's own."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import subprocess
import sys

import pytest

from sparkcache.store import PassBudget, run_pass
from sparkcache.store.locks import (LONG_WAIT_S, LockTimeout, exclusive_lock, shared_lock,
                                    take_lock_timeouts)
from store_helpers import IDENT, conv_keys, conv_pages, open_store


@contextlib.contextmanager
def holder(lock_path: str, operation: int):
    """Another process holding ``lock_path`` with flock(``operation``) until the block ends."""
    code = ("import fcntl, os, sys\n"
            f"fd = os.open({lock_path!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            f"fcntl.flock(fd, {operation})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _lock_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "sparkcache.store" and r.levelno >= logging.WARNING and "lock" in r.getMessage()]


@pytest.fixture
def store(tmp_path, caplog):
    """A store with one entry, its counts taken, every log line of the store captured."""
    store = open_store(tmp_path / "s")
    store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    take_lock_timeouts(store.layout)
    caplog.set_level(logging.DEBUG, logger="sparkcache.store")
    return store


def test_ordinary_contention_is_counted_and_not_logged(store, caplog):
    with holder(store.layout.gc_lock_path, fcntl.LOCK_EX):
        for _ in range(200):
            with pytest.raises(LockTimeout), shared_lock(store.layout, 0.002):
                pass
        # maintenance passes waiting 20% of a 100 ms budget (with a budget 20 times smaller, a
        # pass that reached the lock after its whole wait had gone, on a loaded machine, tried
        # without waiting: not a timeout)
        for _ in range(50):
            assert run_pass(store, PassBudget(max_ms=100), sweep_shards=0).stopped_by == "lock"
    assert _lock_warnings(caplog) == []
    assert take_lock_timeouts(store.layout) == {"shared": 200, "exclusive": 50}
    assert take_lock_timeouts(store.layout) == {}  # taken: the next interval starts at zero


def test_a_try_without_waiting_is_not_a_timeout(store, caplog):
    with holder(store.layout.gc_lock_path, fcntl.LOCK_SH):
        for _ in range(20):
            with pytest.raises(LockTimeout), exclusive_lock(store.layout, 0.0):
                pass
    assert take_lock_timeouts(store.layout) == {} and _lock_warnings(caplog) == []


def test_long_waits_are_logged_at_most_once_per_interval_with_the_count(store, caplog):
    with holder(store.layout.gc_lock_path, fcntl.LOCK_EX):
        for _ in range(3):
            with pytest.raises(LockTimeout), shared_lock(store.layout, LONG_WAIT_S):
                pass
    warnings = _lock_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert store.layout.gc_lock_path in warnings[0] and "fuser" in warnings[0], warnings[0]
    assert take_lock_timeouts(store.layout) == {"shared": 3}
