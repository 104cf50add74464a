"""Publication, identity binding, longest-prefix lookup and copy-on-write growth."""

import os

import pytest

from sparkcache.store import Identity
from store_helpers import IDENT, conv_keys, conv_pages, open_store, page_bytes


def _object_files(store):
    out = {}
    for dirpath, _, files in os.walk(store.layout.objects_dir):
        for f in files:
            out[os.path.join(dirpath, f)] = os.path.getsize(os.path.join(dirpath, f))
    return out


def test_publish_then_fetch_returns_verified_bytes(tmp_path):
    store = open_store(tmp_path)
    pages = conv_pages(1, 10, 4)
    result = store.publish(IDENT, conv_keys(1, 10), pages)
    assert result.ok and result.pages_written == 3 and result.bytes_written == sum(map(len, pages))
    lookup, read = store.fetch(IDENT, conv_keys(1, 10))
    assert lookup.hit and lookup.hit_blocks == 10 and lookup.entry_id == result.entry_id
    assert read.ok and list(read.pages) == pages and read.blocks_per_page == 4
    from sparkcache.store.objects import digest_of
    assert [p.digest for p in lookup.handle.pages] == [digest_of(p) for p in pages]  # BLAKE3 names


def test_longest_prefix_and_divergent_request(tmp_path):
    store = open_store(tmp_path)
    store.publish(IDENT, conv_keys(1, 12), conv_pages(1, 12, 4))
    # a longer request: hit is what is stored
    assert store.lookup(IDENT, conv_keys(1, 20)).hit_blocks == 12
    # a request that diverges after block 7: the stored entry still serves 7 blocks
    request = conv_keys(1, 7) + ["other-7", "other-8"]
    lookup, read = store.fetch(IDENT, request)
    assert lookup.hit_blocks == 7 and read.ok
    assert list(read.pages) == conv_pages(1, 12, 4)[:2]  # pages holding blocks 0..6
    assert store.lookup(IDENT, ["nothing"]).reason == "not_found"


@pytest.mark.parametrize("field,value", [("model", "other"), ("kv_layout", "bf16"),
                                         ("block_size", 32), ("tp_rank", 1),
                                         ("runtime_lock_hash", "lock-new"), ("weights", "w2"),
                                         ("model_config", "quantized"), ("parallel", "tp=2"),
                                         ("key_scheme", "v3")])
def test_other_identity_never_returned(tmp_path, field, value):
    store = open_store(tmp_path)
    store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    other = Identity(**{**IDENT.to_dict(), field: value})
    result = store.lookup(other, conv_keys(1, 8))
    assert not result.hit and result.reason == "not_found"
    assert store.lookup(IDENT, conv_keys(1, 8)).hit_blocks == 8


def test_growing_conversation_writes_only_new_and_changed_pages(tmp_path):
    store = open_store(tmp_path, page_blocks=4)
    store.publish(IDENT, conv_keys(1, 30), conv_pages(1, 30, 4))  # pages 0..6 full, page 7: 2 blocks
    before = _object_files(store)
    grown = conv_pages(1, 37, 4)  # page 7 now full (changed), pages 8,9 new
    result = store.publish(IDENT, conv_keys(1, 37), grown)
    after = _object_files(store)
    new_files = {p: s for p, s in after.items() if p not in before}
    expected_bytes = len(grown[7]) + len(grown[8]) + len(grown[9])
    assert result.pages_written == 3 and result.pages_reused == 7
    assert result.bytes_written == expected_bytes == sum(new_files.values())
    assert len(new_files) == 3
    # the shorter entry was superseded; its old tail page is gone, the rest is shared
    assert len(after) == 10 and store.capacity().entries == 1
    lookup, read = store.fetch(IDENT, conv_keys(1, 30))
    assert lookup.hit_blocks == 30 and read.ok


def test_growth_without_recapture_uses_none_pages(tmp_path):
    store = open_store(tmp_path, page_blocks=4)
    store.publish(IDENT, conv_keys(2, 16), conv_pages(2, 16, 4))
    pages = [None] * 4 + [page_bytes(2, 4, 3)]
    result = store.publish(IDENT, conv_keys(2, 19), pages)
    assert result.ok and result.pages_written == 1 and result.pages_reused == 4
    lookup, read = store.fetch(IDENT, conv_keys(2, 19))
    assert read.ok and list(read.pages) == conv_pages(2, 19, 4)
    # a None page that no stored entry holds is refused with a fix, nothing published
    bad = store.publish(IDENT, conv_keys(3, 8), [None, page_bytes(3, 1, 4)])
    assert not bad.ok and bad.reason == "base_absent" and "pass its bytes" in bad.detail
    assert store.lookup(IDENT, conv_keys(3, 8)).reason == "not_found"


def test_shared_objects_counted_once(tmp_path):
    store = open_store(tmp_path, page_blocks=4)
    unit = store.catalog.alloc_unit
    store.publish(IDENT, conv_keys(1, 10), conv_pages(1, 10, 4))
    used_one = store.capacity().used_bytes
    # a second entry sharing the two full pages (divergent after 8 blocks)
    keys = conv_keys(1, 8) + ["x8", "x9"]
    store.publish(IDENT, keys, conv_pages(1, 8, 4) + [b"tail" * 100])
    cap = store.capacity()
    assert cap.entries == 2
    m2 = store.entry(store.lookup(IDENT, keys).entry_id)
    growth = cap.used_bytes - used_one
    assert growth == -(-400 // unit) * unit + -(-m2.manifest_bytes // unit) * unit


def test_publish_argument_errors(tmp_path):
    store = open_store(tmp_path, page_blocks=4)
    with pytest.raises(ValueError, match="expected 2"):
        store.publish(IDENT, conv_keys(1, 8), [b"x"])
    with pytest.raises(ValueError, match="empty"):
        store.publish(IDENT, [], [])


def test_reopen_sees_published_entries_and_other_processes_view(tmp_path):
    a = open_store(tmp_path)
    a.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    b = open_store(tmp_path)
    assert b.lookup(IDENT, conv_keys(1, 8)).hit_blocks == 8
    a.publish(IDENT, conv_keys(4, 4), conv_pages(4, 4, 4))
    # b refreshes from disk: a lookup applies the journal's new records within LOOKUP_REFRESH_S,
    # at least one each, so on a busy machine the publication shows within a few lookups (CI
    # once saw the first miss)
    hits = [b.lookup(IDENT, conv_keys(4, 4)).hit_blocks for _ in range(4)]
    assert 4 in hits, hits
