"""A fetch from the shared tier after a local miss: find, verify, write locally, or miss.

  1. the pointer search: the prompt's indexed block keys (``strides``) are asked for the deepest
     pointer present, ``SPARKCACHE_REMOTE_REQUESTS_IN_FLIGHT`` GETs at once a round
     (``deepest_indexed_rounds``: a prompt stored whole is found in one round, any other in about
     log(N / STRIDE) / log(k + 1)); a pointer found absent is not asked again for ``negative_s``
     seconds;
  2. the manifest the deepest pointer found so far names is GET as soon as a round finds it
     (beside the next round); it must decode (else it is removed from the bucket: ``corrupt``),
     be of this identity (``wrong_identity``) and hold the prompt's block keys up to the pointer
     (``diverged``); a missing one is ``manifest_absent``;
  3. its objects GET through the shard's ``S3Backend``, ``SPARKCACHE_REMOTE_REQUESTS_IN_FLIGHT``
     at once, each hashed once for the local store and verified by that hash (its BLAKE3 name,
     and the XXH3-128 the manifest records), and handed in order, as they come, to the
     local store's publication path (``adopt`` of a ``remote_feed.ObjectFeed``'s stream, written
     past the page cache where the filesystem allows: ``cached=False``), so the local writes
     overlap the GETs and the fetch holds a few objects, never the whole entry; the
     manifest's bytes, as they were, are placed only once every object is verified and written.
     One missing or short is ``absent``; one with wrong bytes is removed from the bucket (the
     next upload of its entry puts it back) and the fetch is ``corrupt``; either leaves no entry;
  4. the entry's access mark PUT on a thread of its own once the entry is local, not waited for
     (a mark that fails or is never sent leaves the entry dated by its last mark or its manifest).
It runs on a worker thread; the caller waits until the deadline, and past it returns a miss
(``deadline``) while the worker is told to write nothing more locally: its publication stops at
the next object it takes and leaves no entry (one that has taken every object finishes: the entry
then appears whole, never in part). The bucket given is one whose requests are bounded by the
deadline too, so an abandoned worker ends soon after it. Every failure is a miss with its
reason, counted; nothing raises.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout, wait
from dataclasses import dataclass
from typing import Sequence

from . import cpus
from .backend import ObjectError
from .identity import BlockHash, Identity, block_keys
from .layout import is_entry_id
from .manifests import MAX_MANIFEST_BYTES, Manifest, ManifestError, decode
from .reasons import Reason
from .remote_bucket import RemoteBucket, RemoteShard
from .remote_counts import (CORRUPT_REMOVED, DEADLINE_EXCEEDED, FETCH_HITS, FETCHED_BYTES, MISS_KEYS, FetchReason,
                            RemoteCounts)
from .remote_feed import ObjectFeed
from .remote_push import LocalEntries
from .strides import deepest_indexed_rounds

_NEGATIVE_ENTRIES = 4096  # pointers remembered absent at most (the oldest forgotten first)
_POINTER_BYTES = 64  # a pointer's body is an entry id (40 hex); a longer one is not ours


@dataclass(frozen=True)
class FetchResult:
    """How a fetch ended. ``blocks``: how many of the prompt's blocks the fetched entry holds (the
    manifest's keys agree with the prompt's that far); ``bytes_fetched``: object bytes read from
    the bucket."""

    reason: FetchReason
    entry_id: str | None = None
    blocks: int = 0
    bytes_fetched: int = 0
    detail: str = ""
    duration_s: float = 0.0

    @property
    def hit(self) -> bool:
        return self.reason is FetchReason.HIT


class _Miss(Exception):
    def __init__(self, reason: FetchReason, detail: str, entry_id: str | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.entry_id = reason, detail, entry_id


class NegativeCache:
    """Pointer keys found absent, each forgotten ``seconds`` after it was found so."""

    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.seconds, self._clock = seconds, clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def absent(self, key: str) -> bool:
        with self._lock:
            until = self._until.get(key)
            if until is not None and until <= self._clock():
                del self._until[key]
                return False
            return until is not None

    def note(self, key: str) -> None:
        if self.seconds <= 0:
            return
        with self._lock:
            if len(self._until) >= _NEGATIVE_ENTRIES:
                del self._until[next(iter(self._until))]
            self._until[key] = self._clock() + self.seconds


class Fetcher:
    """Fetches entries of ``local``'s namespace from ``bucket`` (the module docstring)."""

    def __init__(self, bucket: RemoteBucket, local: LocalEntries, counts: RemoteCounts, *, deadline_s: float,
                 negative_s: float, workers: int = 4) -> None:
        self.bucket, self.local, self.counts = bucket, local, counts
        self.deadline_s = deadline_s
        self.negative = NegativeCache(negative_s)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sparkcache-fetch",
                                        initializer=cpus.run_on_every_allowed_cpu)
        self._marks = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-fetch-mark")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._marks.shutdown(wait=False, cancel_futures=True)  # a mark not sent is harmless

    def marks_sent(self, timeout_s: float) -> bool:
        """Wait until the access marks asked so far were sent (or failed); False past ``timeout_s``."""
        return not wait([self._marks.submit(lambda: None)], timeout=timeout_s).not_done

    def fetch(self, identity: Identity, block_hashes: Sequence[BlockHash],
              deadline_s: float | None = None) -> FetchResult:
        """The deepest entry the bucket holds of the prompt ``block_hashes``, written into the
        local store; a miss (with its reason, counted) when there is none, it fails a check, or
        ``deadline_s`` (default ``SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS``) passes first."""
        started = time.monotonic()
        limit = self.deadline_s if deadline_s is None else deadline_s
        cancelled = threading.Event()
        future = self._pool.submit(self._fetch, identity, block_keys(block_hashes), cancelled)
        try:
            result = future.result(timeout=max(0.0, limit - (time.monotonic() - started)))
        except FutureTimeout:
            cancelled.set()
            future.cancel()  # one still waiting for a worker never starts
            self.counts.add(DEADLINE_EXCEEDED)
            result = FetchResult(FetchReason.DEADLINE, detail=f"not done within {limit:g} s "
                                 "(SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS); the request recomputes")
        self.counts.add(FETCH_HITS if result.hit else MISS_KEYS[result.reason])
        return FetchResult(result.reason, result.entry_id, result.blocks, result.bytes_fetched, result.detail,
                           time.monotonic() - started)

    # ------------------------------------------------------------------ the worker

    def _fetch(self, identity: Identity, keys: list[str], cancelled: threading.Event) -> FetchResult:
        try:
            if cancelled.is_set():
                raise _Miss(FetchReason.DEADLINE, "the deadline passed before a worker was free")
            if not keys:
                raise _Miss(FetchReason.NOT_FOUND, "no block keys asked")
            shard = self.bucket.shard(self.local.namespace, identity)
            at, entry_id, manifest_get = self._deepest_pointer(shard, keys)
            data = manifest_get.result()
            manifest = self._manifest(shard, identity, keys, at, entry_id, data)
            blocks = _common_prefix(manifest.block_keys, keys)
            if self.local.entry(entry_id) is not None:
                return FetchResult(FetchReason.HIT, entry_id, blocks, 0, "held locally already")
            self._adopt(shard, manifest, data, cancelled)
            nbytes = sum(r.size for r in manifest.objects)
            self.counts.add(FETCHED_BYTES, nbytes)
            self._mark_later(shard, entry_id)
            return FetchResult(FetchReason.HIT, entry_id, blocks, nbytes)
        except _Miss as miss:
            return FetchResult(miss.reason, miss.entry_id, detail=miss.detail)
        except OSError as exc:
            return FetchResult(FetchReason.IO_ERROR, detail=str(exc))
        except Exception as exc:  # noqa: BLE001 - a fetch never raises: anything else is a miss too
            return FetchResult(FetchReason.IO_ERROR, detail=f"{type(exc).__name__}: {exc}")

    def _deepest_pointer(self, shard: RemoteShard, keys: list[str]) -> tuple[int, str, Future]:
        """The deepest indexed position whose pointer is present, the entry it names, and the GET
        of that entry's manifest: the pointers asked ``requests_in_flight`` at once a round
        (``strides.deepest_indexed_rounds``), and the manifest of the deepest one found so far
        GET as soon as a round finds it (most prompts' pointers all name one entry)."""
        named: dict[int, str] = {}
        manifests: dict[str, Future] = {}

        def stored(p: int) -> bool:
            key = shard.keys.pointer_key(keys[p])
            if self.negative.absent(key):
                return False
            body = shard.plain.get(key, _POINTER_BYTES)
            entry_id = body.decode("ascii", "replace") if body is not None else None
            if entry_id is None or not is_entry_id(entry_id):
                self.negative.note(key)  # a body that is not an entry id points nowhere
                return False
            named[p] = entry_id
            return True

        def stored_many(positions: list[int]) -> list[bool]:
            answers = shard.objects.each(stored, positions)
            deepest = max((p for p, yes in zip(positions, answers) if yes), default=None)
            if deepest is not None and named[deepest] not in manifests:
                manifests[named[deepest]] = shard.objects.submit(self._manifest_get, shard, named[deepest])
            return answers

        at = deepest_indexed_rounds(len(keys), stored_many, shard.objects.location.requests_in_flight)
        if at < 0:
            raise _Miss(FetchReason.NOT_FOUND, f"no pointer to the prompt's first block under {shard.keys.base}")
        return at, named[at], manifests[named[at]]

    def _manifest_get(self, shard: RemoteShard, entry_id: str) -> bytes | None:
        return shard.plain.get(shard.keys.manifest_key(entry_id), MAX_MANIFEST_BYTES)

    def _manifest(self, shard: RemoteShard, identity: Identity, keys: list[str], at: int,
                  entry_id: str, data: bytes | None) -> Manifest:
        """``data``, the manifest the pointer at ``at`` names (None: absent), decoded and checked."""
        key = shard.keys.manifest_key(entry_id)
        where = shard.plain.location.where(key)
        if data is None:
            raise _Miss(FetchReason.MANIFEST_ABSENT, f"the pointer names entry {entry_id}, whose manifest "
                        f"{where} is not there", entry_id)
        try:
            manifest = decode(data, expected_entry_id=entry_id)
        except ManifestError as exc:
            if exc.reason == Reason.CORRUPT:
                shard.plain.delete(key)
                self.counts.add(CORRUPT_REMOVED)
            raise _Miss(FetchReason.CORRUPT, f"manifest {where}: {exc}; removed, the next upload of "
                        "the entry puts it back", entry_id) from None
        if manifest.identity != identity:
            raise _Miss(FetchReason.WRONG_IDENTITY, f"manifest {where} is of identity "
                        f"{manifest.identity_digest}, not {identity.digest()}", entry_id)
        if manifest.block_keys[: at + 1] != tuple(keys[: at + 1]):
            raise _Miss(FetchReason.DIVERGED, f"manifest {where}: its block keys are not the prompt's "
                        f"up to block {at}", entry_id)
        return manifest

    def _adopt(self, shard: RemoteShard, manifest: Manifest, data: bytes, cancelled: threading.Event) -> None:
        """The manifest's objects GET a few at a time (``remote_feed``) and written into the local
        store as they come, in order; the manifest placed only once every one is verified and
        written. A miss leaves no entry locally."""
        feed = ObjectFeed(shard.objects, manifest.objects, shard.objects.location.requests_in_flight, cancelled)
        entry_id = manifest.entry_id
        if cancelled.is_set():
            raise _Miss(FetchReason.DEADLINE, "the deadline passed before the local write", entry_id)
        feed.start()
        try:
            published = self.local.adopt(data, feed.stream(), cached=False)  # past the page cache: see adopt
        finally:
            feed.close()
        if published.ok:
            return
        exc = feed.error
        if exc is not None:
            if exc.reason == Reason.CORRUPT:
                try:
                    shard.objects.delete(exc.digest)
                    self.counts.add(CORRUPT_REMOVED)
                except ObjectError:
                    pass  # the bucket cannot be changed now: the next fetch that meets it tries again
            reason = {Reason.CORRUPT: FetchReason.CORRUPT, Reason.ABSENT: FetchReason.ABSENT}.get(
                exc.reason, FetchReason.IO_ERROR)
            raise _Miss(reason, str(exc), entry_id)
        if feed.stopped:
            raise _Miss(FetchReason.DEADLINE, "the deadline passed during the local write; nothing of "
                        "the entry is kept", entry_id)
        raise _Miss(FetchReason.LOCAL_REFUSED, f"the local store refused entry {entry_id}: "
                    f"{published.reason}: {published.detail}", entry_id)

    def _mark_later(self, shard: RemoteShard, entry_id: str) -> None:
        """The entry's access mark PUT on the mark thread; the fetch does not wait for it."""
        try:
            self._marks.submit(self._mark_access, shard, entry_id)
        except RuntimeError:
            pass  # the tier is closing: the mark is not sent (harmless, as a failed one)

    def _mark_access(self, shard: RemoteShard, entry_id: str) -> None:
        try:
            shard.plain.put(shard.keys.access_key(entry_id), b"")
        except OSError:
            pass  # the mark only dates the entry for the capacity sweeper; the next fetch marks it


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["FetchResult", "Fetcher", "NegativeCache"]
