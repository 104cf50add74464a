"""What the shared tier counts, and the thread-safe tally the connector drains.

The data keys are ``vllm:sparkcache_remote_*`` counters' (declared in ``sparkcache/metrics.py``
from the tuples here, as the lookup misses are from ``reasons``): ``RemoteCounts.add`` refuses
any other key, and ``drain`` hands the deltas since the last drain to whoever ships them (the
connector's ``SparkcacheStats.add``, key by key).
"""

from __future__ import annotations

import threading
from enum import StrEnum


class FetchReason(StrEnum):
    """How a fetch from the shared tier ended; its value is its metric label."""

    HIT = "hit"
    NOT_FOUND = "not_found"  # no pointer to the prompt's first block (or a recent answer said so)
    MANIFEST_ABSENT = "manifest_absent"  # a pointer to an entry whose manifest is not there
    WRONG_IDENTITY = "wrong_identity"  # a manifest of another identity under this identity's keys
    DIVERGED = "diverged"  # the manifest's block keys are not the prompt's up to the pointer
    CORRUPT = "corrupt"  # a manifest or object whose bytes fail verification (removed from the bucket)
    ABSENT = "absent"  # an object of the entry missing or short (a 404 in the middle of an entry)
    IO_ERROR = "io_error"  # the remote store could not be asked (down, refusing, denying)
    DEADLINE = "deadline"  # not done within the fetch's deadline
    LOCAL_REFUSED = "local_refused"  # the local store refused the entry (its cap, its free space, its disk)


class UploadSkip(StrEnum):
    """Why an entry queued for upload was never uploaded; its value is its metric label."""

    QUEUE_FULL = "queue_full"  # the queue's bytes would pass REMOTE_UPLOAD_QUEUE_BYTES
    EVICTED = "evicted"  # the local store no longer held it when its turn came
    SUPERSEDED = "superseded"  # a longer entry of the same prompt was queued behind it
    UNREADABLE = "unreadable"  # its local manifest or an object failed verification
    REFUSED = "refused"  # it cannot be uploaded as it is (an object larger than one PUT carries)


FETCH_MISSES = tuple(r for r in FetchReason if r is not FetchReason.HIT)
UPLOADS_DONE, UPLOAD_BYTES, UPLOAD_FAILURES = "remote_uploads_done", "remote_upload_bytes", "remote_upload_failures"
FETCH_HITS, FETCHED_BYTES = "remote_fetch_hits", "remote_fetched_bytes"
DEADLINE_EXCEEDED, CORRUPT_REMOVED = "remote_deadline_exceeded", "remote_corrupt_removed"
SKIP_KEYS = {r: f"remote_upload_skipped_{r}" for r in UploadSkip}
MISS_KEYS = {r: f"remote_fetch_miss_{r}" for r in FETCH_MISSES}
COUNT_KEYS = frozenset({UPLOADS_DONE, UPLOAD_BYTES, UPLOAD_FAILURES, FETCH_HITS, FETCHED_BYTES, DEADLINE_EXCEEDED,
                        CORRUPT_REMOVED, *SKIP_KEYS.values(), *MISS_KEYS.values()})


class RemoteCounts:
    """Counter deltas by data key, added from any thread, drained by one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        if key not in COUNT_KEYS:
            raise ValueError(f"remote counter {key!r} is not one of sparkcache/store/remote_counts.py's "
                             "COUNT_KEYS; add it there and declare it in sparkcache/metrics.py")
        if n:
            with self._lock:
                self._counts[key] = self._counts.get(key, 0) + n

    def drain(self) -> dict[str, int]:
        """The deltas since the last drain (then zero)."""
        with self._lock:
            out, self._counts = self._counts, {}
        return out

    def peek(self) -> dict[str, int]:
        """The deltas since the last drain, left in place."""
        with self._lock:
            return dict(self._counts)


__all__ = ["CORRUPT_REMOVED", "COUNT_KEYS", "DEADLINE_EXCEEDED", "FETCHED_BYTES", "FETCH_HITS", "FETCH_MISSES",
           "FetchReason", "MISS_KEYS", "RemoteCounts", "SKIP_KEYS", "UPLOADS_DONE", "UPLOAD_BYTES",
           "UPLOAD_FAILURES", "UploadSkip"]
