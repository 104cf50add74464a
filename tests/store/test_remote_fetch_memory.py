"""A fetch from the shared tier holds a bounded number of an entry's objects in memory, not the
whole entry: its objects are GET a few at a time and handed to the local publication in order as
they come (``remote_feed.ObjectFeed``), on a real S3 server (SeaweedFS); each is verified by the
one hash it gets; a deadline that passes while the local write runs stops it, and no entry is
left."""

from __future__ import annotations

import os
import time
import tracemalloc

import pytest

from remote_helpers import fresh_prefix, tier_of, two_stores
from sparkcache.store import PageStore, Reason
from sparkcache.store.backend import NewObject, ObjectError, check_named
from sparkcache.store.manifests import PageRef
from sparkcache.store.remote_counts import FetchReason
from sparkcache.store.streams import PageStream
from sparkcache.store.remote_feed import held_at_most
from store_helpers import IDENT

PAGE = 512 << 10
KEYS = [f"{i:06x}{'9e' * 13}" for i in range(4 * 40)]  # 40 pages of 4 blocks


def test_a_fetch_holds_at_most_a_few_objects_of_a_larger_entry(seaweedfs, monkeypatch, tmp_path):
    a, b = two_stores(tmp_path)
    prefix = fresh_prefix()
    up, down = tier_of(seaweedfs, monkeypatch, a, prefix), tier_of(seaweedfs, monkeypatch, b, prefix)
    try:
        published = a.publish(IDENT, KEYS, [os.urandom(PAGE) for _ in range(len(KEYS) // 4)])
        assert published.ok, published
        assert up.upload(published.entry_id) and up.uploads.wait_idle(60), up.uploads.last_error
        entry_bytes = sum(r.size for r in a.entry(published.entry_id).manifest.objects)
        in_flight = down.fetch_bucket.location.requests_in_flight
        # the feed's objects, and what the client holds of the responses it is receiving
        bound = (held_at_most(in_flight) + in_flight) * PAGE
        assert entry_bytes > 3 * bound  # the entry is well past the bound
        tracemalloc.start()
        try:
            result = down.fetch(IDENT, KEYS)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert result.hit and result.bytes_fetched == entry_bytes, result
        assert peak <= bound, (peak, bound, entry_bytes)
        assert PageStore.verify_root(str(tmp_path / "b")).ok
    finally:
        up.close()
        down.close()


def test_an_object_hashed_once_is_verified_by_its_name_and_the_manifests_checksum():
    """What the fetch checks each object by (``check_named``): the BLAKE3 name, and the XXH3-128
    its manifest records; either wrong is ``corrupt``, naming the object."""
    data = os.urandom(1000)
    made = NewObject.of(data).ref
    check_named(made, made)
    check_named(PageRef(made.digest, made.size), made)  # no checksum recorded: the name alone
    other = NewObject.of(data[:-1] + bytes([data[-1] ^ 1])).ref
    for wanted in (PageRef(other.digest, other.size, made.checksum), PageRef(made.digest, made.size, other.checksum)):
        with pytest.raises(ObjectError, match=wanted.digest) as caught:
            check_named(wanted, made, "s3://b/k")
        assert caught.value.reason is Reason.CORRUPT


class _SlowLocal:
    """A local store whose publication, once it has written the first chunk of a fetched entry,
    stalls past the fetch's deadline before it asks for the next."""

    def __init__(self, store: PageStore, stall_s: float) -> None:
        self._store, self._stall_s = store, stall_s
        self.namespace = store.namespace
        self.results = []

    def __getattr__(self, name):
        return getattr(self._store, name)

    def adopt(self, data, stream: PageStream, *, cached: bool = True):
        def chunks():
            for n, chunk in enumerate(stream.chunks()):
                if n == 1:
                    time.sleep(self._stall_s)
                yield chunk

        result = self._store.adopt(data, PageStream(stream.sizes, chunks), cached=cached)
        self.results.append(result)
        return result


def test_a_deadline_during_the_local_write_stops_it_and_leaves_no_entry(seaweedfs, monkeypatch, tmp_path):
    a, b = two_stores(tmp_path)
    prefix = fresh_prefix()
    slow = _SlowLocal(b, stall_s=1.5)
    up, down = tier_of(seaweedfs, monkeypatch, a, prefix), tier_of(seaweedfs, monkeypatch, slow, prefix, deadline_s=1.0)
    try:
        published = a.publish(IDENT, KEYS, [os.urandom(PAGE) for _ in range(len(KEYS) // 4)])
        assert up.upload(published.entry_id) and up.uploads.wait_idle(60), up.uploads.last_error
        result = down.fetch(IDENT, KEYS)
        assert result.reason is FetchReason.DEADLINE, result
        deadline = time.monotonic() + 10
        while not slow.results and time.monotonic() < deadline:
            time.sleep(0.05)  # the abandoned worker's publication ends at the next object it takes
        assert slow.results and slow.results[0].reason is Reason.SOURCE_FAILED, slow.results
        assert b.entry(published.entry_id) is None and b.entries() == []
        assert PageStore.verify_root(str(tmp_path / "b")).ok
    finally:
        up.close()
        down.close()
