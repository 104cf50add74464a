"""The shared tier: the local store backed by an S3-compatible bucket (docs/REMOTE.md).

``RemoteTier`` puts the parts together for one local store (anything that gives
``remote_push.LocalEntries``; a ``PageStore`` does, and is never imported here):

- ``upload(entry_id)`` (or ``published(result)`` after a local publication): the entry is queued
  and uploaded in the background (``remote_upload.UploadQueue``, ``remote_push.push_entry``);
- ``fetch(identity, block_hashes)`` on a local miss: the deepest remote entry of the prompt,
  verified and written into the local store, or a miss with its reason
  (``remote_fetch.Fetcher``), within ``SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS``;
- ``counts``: what it did, for the connector to drain (``remote_counts.RemoteCounts``);
- ``check()``: the bucket check of the namespace (``remote_check``).
Uploads use the bucket's bounds (``SPARKCACHE_REMOTE_TIMEOUT_SECONDS``); fetches a client of their
own whose every request is bounded by the fetch deadline too.
"""

from __future__ import annotations

import dataclasses

from ..settings import Settings
from .identity import BlockHash, Identity
from .remote_bucket import RemoteBucket
from .remote_check import CheckReport, remote_check
from .remote_counts import SKIP_KEYS, RemoteCounts, UploadSkip
from .remote_fetch import Fetcher, FetchResult
from .remote_push import LocalEntries, push_entry
from .remote_upload import RETRY_FIRST_S, RETRY_MAX_S, UploadJob, UploadQueue
from .s3_location import S3Location


class RemoteTier:
    """The shared tier of ``local`` on ``location``'s bucket (the module docstring)."""

    def __init__(self, location: S3Location, local: LocalEntries, *, queue_bytes: int = 8 << 30,
                 deadline_s: float = 5.0, negative_s: float = 2.0, retry_first_s: float = RETRY_FIRST_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        self.local = local
        self.counts = RemoteCounts()
        self.bucket = RemoteBucket(location)
        bounded = dataclasses.replace(location, timeout_s=min(location.timeout_s, deadline_s),
                                      connect_timeout_s=min(location.connect_timeout_s, deadline_s))
        self.fetch_bucket = RemoteBucket(bounded)
        self.uploads = UploadQueue(lambda entry_id: push_entry(local, self.bucket, entry_id), self.counts,
                                   queue_bytes, retry_first_s=retry_first_s, retry_max_s=retry_max_s)
        self.fetcher = Fetcher(self.fetch_bucket, local, self.counts, deadline_s=deadline_s, negative_s=negative_s)

    @classmethod
    def from_settings(cls, settings: Settings, local: LocalEntries) -> "RemoteTier | None":
        """The tier the settings configure, or None without ``SPARKCACHE_REMOTE_BUCKET``."""
        if not settings.remote_bucket:
            return None
        return cls(S3Location.from_settings(settings), local, queue_bytes=settings.remote_upload_queue_bytes,
                   deadline_s=settings.remote_fetch_deadline_seconds,
                   negative_s=settings.remote_negative_cache_seconds)

    def upload(self, entry_id: str) -> bool:
        """Queue the local entry for upload; False when it is not queued (counted: the local
        store no longer holds it, or the queue is full)."""
        entry = self.local.entry(entry_id)
        if entry is None:
            self.counts.add(SKIP_KEYS[UploadSkip.EVICTED])
            return False
        m = entry.manifest
        job = UploadJob(entry_id, m.identity_digest, m.block_keys[-1], sum(r.size for r in m.objects),
                        m.state is not None)
        return self.uploads.submit(job, m.block_keys)

    def published(self, result) -> bool:
        """After a local publication (a ``PublishResult``): queue its entry when it was published."""
        return bool(result.ok and result.entry_id) and self.upload(result.entry_id)

    def fetch(self, identity: Identity, block_hashes: list[BlockHash], deadline_s: float | None = None) -> FetchResult:
        return self.fetcher.fetch(identity, block_hashes, deadline_s)

    def check(self) -> CheckReport:
        return remote_check(self.bucket, self.local.namespace)

    def close(self) -> None:
        self.uploads.close()
        self.fetcher.close()
        self.bucket.close()
        self.fetch_bucket.close()


__all__ = ["RemoteTier"]
