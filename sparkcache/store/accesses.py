"""A lookup's hit recorded off the caller's thread: the manifest's mtime stamped with the
kernel's time and an ``a`` record journaled, by a background thread, so that vLLM's scheduler
thread never waits on a metadata write (one can wait behind another process's fsync).

Recording is best effort, as the mtime always was: a queue of ``MAX_QUEUED`` hits at most
(a hit beyond it is not recorded), a stamp that fails is skipped, and with less than
``MIN_FREE_FOR_RECORDS`` free on the filesystem nothing is journaled (the other processes read
the mtimes in their sweeps of last accesses). ``flush`` waits until what
was queued is recorded (a maintenance pass of this process first, so that it never evicts
an entry this process just used; ``PageStore.close``).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Callable

from . import cpus
from .index import IndexedEntry
from .journal import Journal, Op, Record
from .layout import StoreLayout, UnsafePathError

MAX_QUEUED = 4096
MIN_FREE_FOR_RECORDS = 1 << 20  # bytes free below which hits are stamped but not journaled
_IDLE_EXIT_S = 5.0  # the thread ends after this long without work (and starts again on demand)


class AccessRecorder:
    def __init__(self, layout: StoreLayout, journal: Journal,
                 done: Callable[[], Callable[[list[tuple[IndexedEntry, float]]], None] | None]) -> None:
        """``done()`` (a weak method) gives what receives each batch's (entry, stamped time),
        to set in the view; None once the store is gone."""
        self.layout = layout
        self.journal = journal
        self._done = done
        self._cond = threading.Condition()
        self._queue: collections.deque[IndexedEntry] = collections.deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.dropped = 0  # hits not recorded because the queue was full

    def record(self, entry: IndexedEntry) -> None:
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparkcache-accesses", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued hit is recorded; False when ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _run(self) -> None:
        cpus.run_off_model_cpus()
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue, _IDLE_EXIT_S):
                    self._thread = None
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                self._record(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

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
        receiver = self._done()
        if receiver is not None:
            receiver(stamped)


__all__ = ["AccessRecorder", "MAX_QUEUED"]
