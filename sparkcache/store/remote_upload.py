"""The shared tier's upload queue: entries published locally, uploaded in the background.

``submit`` queues an entry (its identity digest, its last block key, its objects' bytes) unless
the bytes queued would pass the bound (``SPARKCACHE_REMOTE_UPLOAD_QUEUE_BYTES``): then it is
skipped (``queue_full``), never held. An entry queued behind a shorter one of the same prompt
(the shorter one's last block key is among its keys, same identity) takes its place: the shorter
one is dropped (``superseded``), as the local store drops it too (one holding a recurrent state
stays: it is a resume point the longer one does not hold).

One thread, started with the first entry, off the model's CPUs and at the publisher's priority
(``cpus.run_as_publisher``), uploads them in order (``remote_push.push_entry``). An entry the
local store no longer holds is dropped (``evicted``); one whose local bytes fail verification is
dropped (``unreadable``), one the remote store cannot take as it is too (``refused``: an object
larger than one PUT carries). A failed upload (the remote store down, slow, refusing) stays at the
head of the queue and is tried again after a backoff that doubles from ``retry_first_s`` to
``retry_max_s``; the entries behind it wait (the remote store that failed one would fail them),
and once the remote store answers again they all go.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import cpus
from .remote_counts import SKIP_KEYS, UPLOAD_BYTES, UPLOAD_FAILURES, UPLOADS_DONE, RemoteCounts, UploadSkip
from .remote_push import EntryGone, EntryUnreadable, Pushed

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5  # the first wait after a failed upload; it doubles on each failure
RETRY_MAX_S = 30.0  # the longest wait between two tries of a failed upload


@dataclass(frozen=True)
class UploadJob:
    """An entry waiting for its upload."""

    entry_id: str
    identity_digest: str
    last_block_key: str
    nbytes: int
    holds_state: bool = False  # a hybrid entry: a resume point no longer entry holds, never superseded


class UploadQueue:
    """Entries waiting for upload, and the thread that uploads them (the module docstring)."""

    def __init__(self, push: Callable[[str], Pushed], counts: RemoteCounts, max_bytes: int, *,
                 retry_first_s: float = RETRY_FIRST_S, retry_max_s: float = RETRY_MAX_S) -> None:
        self._push = push
        self.counts = counts
        self.max_bytes = max_bytes
        self.retry_first_s, self.retry_max_s = retry_first_s, retry_max_s
        self._jobs: collections.OrderedDict[str, UploadJob] = collections.OrderedDict()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last_error = ""  # what the last failed upload said

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def submit(self, job: UploadJob, block_keys: tuple[str, ...]) -> bool:
        """Queue ``job`` (``block_keys``: its entry's, to find the shorter ones it supersedes);
        False when it was skipped (counted) or is queued already."""
        keys = set(block_keys)
        with self._cond:
            if self._closed or job.entry_id in self._jobs:
                return False
            for old in [j for j in self._jobs.values() if j.identity_digest == job.identity_digest
                        and j.last_block_key in keys and j.entry_id != job.entry_id and not j.holds_state]:
                if not (self._busy and next(iter(self._jobs)) == old.entry_id):  # not the one uploading
                    self._drop(old, UploadSkip.SUPERSEDED)
            if self._bytes + job.nbytes > self.max_bytes:
                self.counts.add(SKIP_KEYS[UploadSkip.QUEUE_FULL])
                return False
            self._jobs[job.entry_id] = job
            self._bytes += job.nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparkcache-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is queued or uploading (True), or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def retry_now(self) -> None:
        """Try the failed upload at the head of the queue now, not after its backoff."""
        with self._cond:
            self._retry_at = 0.0
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the upload under way (what is queued is not uploaded)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    _retry_at = 0.0

    def _run(self) -> None:
        cpus.run_as_publisher()
        backoff = self.retry_first_s
        while True:
            with self._cond:
                while not self._closed and (not self._jobs or time.monotonic() < self._retry_at):
                    self._cond.wait(max(0.0, self._retry_at - time.monotonic()) if self._jobs else None)
                if self._closed:
                    return
                job = next(iter(self._jobs.values()))
                self._busy = True
            failed = self._upload(job)
            with self._cond:
                self._busy = False
                if failed:
                    self._retry_at = time.monotonic() + backoff
                    backoff = min(backoff * 2, self.retry_max_s)
                else:
                    backoff = self.retry_first_s
                    self._retry_at = 0.0
                    self._remove(job)
                self._cond.notify_all()

    def _upload(self, job: UploadJob) -> bool:
        """One try of ``job``; True when it failed and is to be tried again."""
        try:
            pushed = self._push(job.entry_id)
        except EntryGone:
            self.counts.add(SKIP_KEYS[UploadSkip.EVICTED])
        except EntryUnreadable as exc:
            log.warning("sparkcache: not uploading %s", exc)
            self.counts.add(SKIP_KEYS[UploadSkip.UNREADABLE])
        except ValueError as exc:  # what no retry changes (an object larger than one PUT carries)
            log.warning("sparkcache: not uploading entry %s: %s", job.entry_id, exc)
            self.counts.add(SKIP_KEYS[UploadSkip.REFUSED])
        except Exception as exc:  # noqa: BLE001 - any failure is tried again: the thread must not die
            self.counts.add(UPLOAD_FAILURES)
            self.last_error = f"entry {job.entry_id}: {exc}"
            log.warning("sparkcache: upload of entry %s failed, to be tried again: %s", job.entry_id, exc)
            return True
        else:
            self.counts.add(UPLOADS_DONE)
            self.counts.add(UPLOAD_BYTES, pushed.bytes_written)
        return False

    def _drop(self, job: UploadJob, why: UploadSkip) -> None:
        self.counts.add(SKIP_KEYS[why])
        self._remove(job)

    def _remove(self, job: UploadJob) -> None:
        if self._jobs.pop(job.entry_id, None) is not None:
            self._bytes -= job.nbytes


__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "UploadJob", "UploadQueue"]
