"""The shared tier on a real S3 server (SeaweedFS): an entry published in one local store is
uploaded, then fetched into a second, empty one, byte for byte, its ``verify`` clean, a local hit
after; the misses a fetch meets (nothing there, a pointer without its manifest, a manifest of
another identity, block keys that diverge, a flipped byte in a remote object) are misses with
their reason, counted, and a corrupt object is removed so the next upload puts it back."""

from __future__ import annotations

from types import SimpleNamespace

import obstore
import pytest

from bench.page_cache import resident_pages
from remote_helpers import (KillingLocal, fresh_prefix, manifest_file_bytes, random_pages, remote_keys_of, tier_of,
                            two_stores)
from sparkcache.store import Identity, PageStore
from sparkcache.store.remote_counts import (CORRUPT_REMOVED, FETCH_HITS, FETCHED_BYTES, MISS_KEYS, SKIP_KEYS,
                                            UPLOADS_DONE, FetchReason, UploadSkip)
from sparkcache.store.remote_keys import KeyKind, RemoteKeys
from store_helpers import IDENT, run_cli

OTHER = Identity("tiny-llama", "fp16:L2:H4:D32", 16, 1, "lock-abc")  # another rank's shard
HEX_KEYS = [f"{i:08x}{'ab' * 12}" for i in range(1, 41)]  # 40 chained-looking hex keys


@pytest.fixture
def pair(seaweedfs, monkeypatch, tmp_path):
    """Two local stores (a, b) under tmp_path, a tier on each under one fresh prefix."""
    a, b = two_stores(tmp_path)
    prefix = fresh_prefix()
    up, down = tier_of(seaweedfs, monkeypatch, a, prefix), tier_of(seaweedfs, monkeypatch, b, prefix)
    yield SimpleNamespace(a=a, b=b, up=up, down=down, prefix=prefix, mine=RemoteKeys(prefix, "default", IDENT.digest()))
    up.close()
    down.close()


def _publish(store: PageStore, keys, identity=IDENT, state=None, page_bytes=3000):
    result = store.publish(identity, keys, random_pages(-(-len(keys) // 4), page_bytes), state=state)
    assert result.ok, result
    return result.entry_id


def _upload(tier, entry_id):
    assert tier.upload(entry_id)
    assert tier.uploads.wait_idle(60), tier.uploads.last_error


def _same_entry(a: PageStore, b: PageStore, entry_id: str) -> None:
    assert manifest_file_bytes(b, entry_id) == manifest_file_bytes(a, entry_id)
    refs = list(a.entry(entry_id).manifest.objects)
    assert b.read_pages(refs) == a.read_pages(refs)
    assert PageStore.verify_root(str(b.layout.base.rsplit("/", 1)[0])).ok


@pytest.mark.parametrize("keys", [HEX_KEYS, [f"c7-b{i}" for i in range(37)]], ids=["hex-keys", "other-keys"])
def test_an_uploaded_entry_is_fetched_byte_for_byte_into_an_empty_store(pair, seaweedfs, keys):
    entry_id = _publish(pair.a, keys)
    _upload(pair.up, entry_id)
    report = pair.up.check()
    assert report.clean and report.entries == 1, report
    assert pair.up.counts.peek()[UPLOADS_DONE] == 1
    assert not pair.b.lookup(IDENT, keys).hit
    longer = keys + ["f00d", "beef"]  # a prompt that goes on past the entry
    result = pair.down.fetch(IDENT, longer)
    assert result.hit and result.entry_id == entry_id and result.blocks == len(keys), result
    for ref in pair.b.entry(entry_id).manifest.objects:  # written past the page cache (tmp is ext4)
        assert resident_pages(pair.b.objects.path(ref.digest))[0] == 0
    _same_entry(pair.a, pair.b, entry_id)
    assert pair.b.lookup(IDENT, longer).hit_blocks == len(keys)
    assert pair.down.fetcher.marks_sent(10)  # the access mark is PUT after the fetch returned
    assert pair.mine.access_key(entry_id) in remote_keys_of(seaweedfs, pair.prefix)
    counts = pair.down.counts.peek()
    assert counts[FETCH_HITS] == 1
    assert counts[FETCHED_BYTES] == sum(r.size for r in pair.a.entry(entry_id).manifest.objects)


def test_a_hybrid_entry_comes_with_its_state_object(pair):
    keys = HEX_KEYS[:20]
    entry_id = _publish(pair.a, keys, state=b"S" * 5000)
    _upload(pair.up, entry_id)
    assert pair.down.fetch(IDENT, keys).hit
    _same_entry(pair.a, pair.b, entry_id)
    assert pair.b.entry(entry_id).manifest.state is not None
    assert pair.b.lookup(IDENT, keys, with_state=True).hit_blocks == 20


def test_the_ranks_of_a_replicated_layout_store_their_shared_objects_once(pair, seaweedfs):
    """MLA's KV cache is replicated, not split by heads: every tensor-parallel rank's shard holds
    the same page bytes under its own identity (tests/connector/test_engine_mla.py). The bucket
    keeps a unit's objects once, under its rank 0's identity; each rank's manifest and pointers
    stay under its own, and each rank's shard is fetched whole from them."""
    pages = random_pages(10, 3000)
    shards = [pair.a.publish(identity, HEX_KEYS, pages) for identity in (IDENT, OTHER)]
    assert all(r.ok for r in shards) and shards[0].entry_id != shards[1].entry_id
    for r in shards:
        _upload(pair.up, r.entry_id)
    listed = remote_keys_of(seaweedfs, pair.prefix)
    objects = {k: n for k, n in listed.items() if f"/{KeyKind.OBJECT.value}/" in k}
    assert sorted(objects.values()) == [len(p) for p in pages]  # each page's bytes once
    assert all(k.startswith(pair.mine.kind_prefix(KeyKind.OBJECT)) for k in objects), sorted(objects)
    theirs = RemoteKeys(pair.prefix, "default", OTHER.digest())
    assert theirs.manifest_key(shards[1].entry_id) in listed and theirs.pointer_key(HEX_KEYS[0]) in listed
    report = pair.up.check()
    assert report.clean and report.entries == 2, report
    result = pair.down.fetch(OTHER, HEX_KEYS)
    assert result.hit and result.entry_id == shards[1].entry_id, result
    _same_entry(pair.a, pair.b, shards[1].entry_id)
    assert pair.down.fetch(IDENT, HEX_KEYS).hit
    assert pair.b.lookup(IDENT, HEX_KEYS).hit_blocks == pair.b.lookup(OTHER, HEX_KEYS).hit_blocks == 40


def test_nothing_there_is_a_miss_and_asked_again_only_after_the_negative_cache(pair):
    pair.down.fetcher.negative.seconds = 3600
    assert pair.down.fetch(IDENT, HEX_KEYS).reason is FetchReason.NOT_FOUND
    _upload(pair.up, _publish(pair.a, HEX_KEYS))
    assert pair.down.fetch(IDENT, HEX_KEYS).reason is FetchReason.NOT_FOUND  # the cached answer
    pair.down.fetcher.negative.seconds = 0
    pair.down.fetcher.negative._until.clear()
    assert pair.down.fetch(IDENT, HEX_KEYS).hit
    assert pair.down.counts.peek()[MISS_KEYS[FetchReason.NOT_FOUND]] == 2


def test_a_flipped_byte_is_refused_removed_and_put_back_by_the_next_upload(pair, seaweedfs, tmp_path):
    entry_id = _publish(pair.a, HEX_KEYS)
    _upload(pair.up, entry_id)
    ref = pair.a.entry(entry_id).manifest.pages[3]
    key = pair.mine.object_key(ref.digest)
    raw = seaweedfs.raw_store()
    data = bytearray(obstore.get(raw, key).bytes())
    data[100] ^= 1
    obstore.put(raw, key, bytes(data), use_multipart=False)  # unconditional: the damage
    assert not pair.up.check().clean
    result = pair.down.fetch(IDENT, HEX_KEYS)
    assert result.reason is FetchReason.CORRUPT and ref.digest in result.detail, result
    assert key not in remote_keys_of(seaweedfs, pair.prefix)
    counts = pair.down.counts.peek()
    assert counts[CORRUPT_REMOVED] == 1 and counts[MISS_KEYS[FetchReason.CORRUPT]] == 1
    assert pair.b.entry(entry_id) is None and PageStore.verify_root(str(tmp_path / "b")).ok
    _upload(pair.up, entry_id)  # the next upload of the entry puts the object back
    assert pair.up.check().clean
    assert pair.down.fetch(IDENT, HEX_KEYS).hit
    _same_entry(pair.a, pair.b, entry_id)


def test_a_pointer_to_a_missing_manifest_another_identity_and_diverging_keys_are_misses(pair, seaweedfs, tmp_path):
    raw, mine = seaweedfs.raw_store(), pair.mine
    theirs = RemoteKeys(pair.prefix, "default", OTHER.digest())
    gone = _publish(pair.a, HEX_KEYS[:16])
    _upload(pair.up, gone)
    obstore.delete(raw, mine.manifest_key(gone))
    assert pair.down.fetch(IDENT, HEX_KEYS[:16]).reason is FetchReason.MANIFEST_ABSENT

    other_keys = [f"{k}1" for k in HEX_KEYS[:8]]
    other = _publish(pair.a, other_keys, identity=OTHER)
    _upload(pair.up, other)
    copied = obstore.get(raw, theirs.manifest_key(other)).bytes().to_bytes()
    obstore.put(raw, mine.manifest_key(other), copied, use_multipart=False)
    obstore.put(raw, mine.pointer_key(other_keys[0]), other.encode(), use_multipart=False)
    assert pair.down.fetch(IDENT, other_keys).reason is FetchReason.WRONG_IDENTITY

    diverging = [f"{k}2" for k in HEX_KEYS[:8]]
    kept = _publish(pair.a, HEX_KEYS[16:32])
    _upload(pair.up, kept)
    obstore.put(raw, mine.pointer_key(diverging[0]), kept.encode(), use_multipart=False)
    assert pair.down.fetch(IDENT, diverging).reason is FetchReason.DIVERGED

    counts = pair.down.counts.peek()
    for reason in (FetchReason.MANIFEST_ABSENT, FetchReason.WRONG_IDENTITY, FetchReason.DIVERGED):
        assert counts[MISS_KEYS[reason]] == 1, counts
    assert pair.b.entries() == [] and PageStore.verify_root(str(tmp_path / "b")).ok


def test_remote_check_on_the_command_line_names_a_broken_entry(pair, seaweedfs, tmp_path):
    entry_id = _publish(pair.a, HEX_KEYS)
    _upload(pair.up, entry_id)
    env = {"SPARKCACHE_ROOT": str(tmp_path / "a"), "SPARKCACHE_REMOTE_BUCKET": seaweedfs.endpoint.bucket,
           "SPARKCACHE_REMOTE_ENDPOINT": seaweedfs.endpoint.url, "SPARKCACHE_REMOTE_PREFIX": pair.prefix}
    done = run_cli("remote-check", env=env)
    assert done.returncode == 0 and "entries=1 " in done.stdout and "-> ok" in done.stdout, done
    obstore.delete(seaweedfs.raw_store(), pair.mine.object_key(pair.a.entry(entry_id).manifest.pages[0].digest))
    done = run_cli("remote-check", env=env)
    assert done.returncode == 1 and "BAD absent" in done.stdout and pair.mine.manifest_key(entry_id) in done.stdout, done
    assert seaweedfs.endpoint.secret_key not in done.stdout + done.stderr


def test_an_object_missing_in_the_middle_of_an_entry_is_an_absent_miss(pair, seaweedfs, tmp_path):
    entry_id = _publish(pair.a, HEX_KEYS)
    _upload(pair.up, entry_id)
    middle = pair.a.entry(entry_id).manifest.pages[5]
    obstore.delete(seaweedfs.raw_store(), pair.mine.object_key(middle.digest))
    result = pair.down.fetch(IDENT, HEX_KEYS)
    assert result.reason is FetchReason.ABSENT and middle.digest in result.detail, result
    assert pair.down.counts.peek()[MISS_KEYS[FetchReason.ABSENT]] == 1
    assert pair.b.entries() == [] and PageStore.verify_root(str(tmp_path / "b")).ok


def test_an_entry_evicted_before_its_upload_is_dropped_and_counted(pair, seaweedfs, monkeypatch):
    entry_id = _publish(pair.a, HEX_KEYS)
    local = KillingLocal(pair.a, "manifest_bytes", 1, lambda: pair.a.discard([entry_id]))
    tier = tier_of(seaweedfs, monkeypatch, local, pair.prefix)
    try:
        _upload(tier, entry_id)
        assert tier.counts.peek() == {SKIP_KEYS[UploadSkip.EVICTED]: 1}
        assert remote_keys_of(seaweedfs, pair.prefix) == {}
    finally:
        tier.close()
