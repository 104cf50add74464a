"""A lookup's hit recorded off the caller's thread: the manifest's mtime stamped with the
kernel's time and an ``a`` record journaled, by a background thread, so that vLLM's scheduler
thread never waits on a metadata write (one can wait behind another process's fsync).

The caller shares no lock with that thread: a hit is appended to a queue (one atomic deque
operation) and the thread takes what is queued every ``POLL_S``; what it stamped goes back
the same way (``stamped``), for the view's owner to apply under its own lock at its next
refresh (``Catalog.refresh``). A lock shared with a background thread makes the caller wait
whenever that thread holds it and is not running (on a busy host, milliseconds).

Recording is best effort, as the mtime always was: a queue of ``MAX_QUEUED`` hits at most
(a hit beyond it is not recorded), a stamp that fails is skipped, and with less than
``MIN_FREE_FOR_RECORDS`` free on the filesystem nothing is journaled (the other processes read
the mtimes in their sweeps of last accesses). ``flush`` waits until what was queued is
recorded (a maintenance pass of this process first, so that it never evicts an entry this
process just used; ``PageStore.close``).
"""

from __future__ import annotations

import collections
import os
import threading
import time

from . import cpus
from .index import IndexedEntry
from .journal import Journal, Op, Record
from .layout import StoreLayout, UnsafePathError

MAX_QUEUED = 4096
MIN_FREE_FOR_RECORDS = 1 << 20  # bytes free below which hits are stamped but not journaled
POLL_S = 0.05  # how often the thread takes what is queued (recency needs no finer grain)
_IDLE_EXIT_S = 5.0  # the thread ends after this long without work (and starts again on demand)


class AccessRecorder:
    def __init__(self, layout: StoreLayout, journal: Journal,
                 stamped: collections.deque[tuple[IndexedEntry, float]]) -> None:
        """``stamped`` receives each recorded hit's (entry, stamped time), for the view."""
        self.layout = layout
        self.journal = journal
        self.stamped = stamped
        self._queue: collections.deque[IndexedEntry | threading.Event] = collections.deque()
        self._start = threading.Lock()  # starting and ending the thread (never held by a hit)
        self._thread: threading.Thread | None = None
        self.dropped = 0  # hits not recorded because the queue was full

    def record(self, entry: IndexedEntry) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append(entry)
        if self._thread is None:
            self._ensure_thread()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every hit queued before it is recorded; False when ``timeout`` passed
        first."""
        done = threading.Event()
        self._queue.append(done)
        self._ensure_thread()
        return done.wait(timeout)

    def _ensure_thread(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparkcache-accesses",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # an ending (or a failing) thread is never taken for a running one
            with self._start:
                if self._thread is threading.current_thread():
                    self._thread = None
            if self._queue:  # queued while it ended: ``record`` saw it still running
                self._ensure_thread()

    def _loop(self) -> None:
        cpus.run_off_model_cpus()
        idle_since = time.monotonic()
        while True:
            if not self._queue:
                if time.monotonic() - idle_since >= _IDLE_EXIT_S:
                    return
                time.sleep(POLL_S)
                continue
            batch, events = [], []
            while self._queue:
                item = self._queue.popleft()
                (events if isinstance(item, threading.Event) else batch).append(item)
            try:
                self._record(batch)
            finally:
                for event in events:
                    event.set()
                idle_since = time.monotonic()

    def _record(self, batch: list[IndexedEntry]) -> None:
        stamped = []
        for entry in dict.fromkeys(batch):  # one stamp per entry, however many hits
            try:
                stamped.append((entry, self.layout.touch(entry.path)))
            except (OSError, UnsafePathError):
                continue  # a read-only or full disk keeps the old time
        if not stamped:
            return
        try:
            st = os.statvfs(self.layout.base)
            roomy = st.f_bavail * st.f_frsize >= MIN_FREE_FOR_RECORDS
        except OSError:
            roomy = False
        try:
            if roomy:  # a nearly full disk keeps its last blocks for pins and publications
                self.journal.append([Record(Op.ACCESSED, e.manifest.identity_digest, e.entry_id)
                                     for e, _ in stamped])
        except OSError:
            pass  # the other processes read the mtime at their next sweep of last accesses
        self.stamped.extend(stamped)


__all__ = ["AccessRecorder", "MAX_QUEUED"]
