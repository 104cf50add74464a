"""Entries that carry a hybrid model's recurrent state: exact-depth lookups, one unit with
their pages, counted, verified and evicted like pages."""

import os

from sparkcache.store import verify_store
from sparkcache.store.manifests import decode, encode
from store_helpers import IDENT, conv_keys, conv_pages, open_store

STATE = b"\x11" * 1000


def test_state_lookup_is_exact_depth_and_keeps_entries_apart(tmp_path):
    store = open_store(tmp_path)
    assert store.publish(IDENT, conv_keys(1, 6), conv_pages(1, 6, 4), state=STATE).ok
    # Attention-only lookups see the pages as before, to any depth within the entry ...
    assert store.lookup(IDENT, conv_keys(1, 4)).hit_blocks == 4
    # ... a state lookup resumes only where the state was taken (block 6), never inside it
    found = store.lookup(IDENT, conv_keys(1, 9), with_state=True)
    assert found.hit and found.hit_blocks == 6 and found.handle.state.size == len(STATE)
    assert not store.lookup(IDENT, conv_keys(1, 5), with_state=True).hit
    # an entry without a state is no resume point for a hybrid lookup
    store.publish(IDENT, conv_keys(2, 6), conv_pages(2, 6, 4))
    assert store.lookup(IDENT, conv_keys(2, 6)).hit_blocks == 6
    assert store.lookup(IDENT, conv_keys(2, 6), with_state=True).reason == "not_found"
    # the state's bytes come back verified
    read = store.objects.read_many_verified([found.handle.state])
    assert bytes(read[0]) == STATE


def test_a_deeper_state_entry_keeps_the_shallower_resume_point(tmp_path):
    # A prompt's boundary (block 4) and a decode-time checkpoint past it (block 8) are two
    # resume points: the next turn of a conversation whose history drops the reasoning
    # shares only the first 4 blocks, and resumes at 4 or recomputes everything. So a
    # longer entry does not supersede a shorter one that holds a state (it does supersede
    # a shorter one without: its pages are all in the longer entry).
    store = open_store(tmp_path)
    short = store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4), state=b"a" * 64)
    grown = store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4), state=b"b" * 64)
    assert grown.ok and grown.superseded == ()
    found = store.lookup(IDENT, conv_keys(1, 10), with_state=True)
    assert found.hit_blocks == 8 and found.entry_id == grown.entry_id
    diverged = conv_keys(1, 6) + ["c9-b6", "c9-b7", "c9-b8"]  # the same first 6 blocks, then not
    found = store.lookup(IDENT, diverged, with_state=True)
    assert found.hit_blocks == 4 and found.entry_id == short.entry_id
    assert bytes(store.objects.read_many_verified([found.handle.state])[0]) == b"a" * 64
    pages_only = store.publish(IDENT, conv_keys(2, 4), conv_pages(2, 4, 4))
    assert store.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4), state=b"c" * 64).superseded == (
        pages_only.entry_id,)


def test_state_is_counted_verified_and_freed_with_its_entry(tmp_path):
    store = open_store(tmp_path)
    before = store.capacity().used_bytes
    result = store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4), state=STATE)
    found = store.lookup(IDENT, conv_keys(1, 4), with_state=True)
    state_path = store.objects.path(found.handle.state.digest)
    assert os.path.isfile(state_path)
    assert store.capacity().used_bytes - before >= sum(map(len, conv_pages(1, 4, 4))) + len(STATE)
    # a flipped byte in the state is found by verify and by a verifying lookup
    data = bytearray(open(state_path, "rb").read())
    data[10] ^= 1
    os.chmod(state_path, 0o644)
    with open(state_path, "wb") as f:
        f.write(data)
    report = verify_store(store.layout)
    assert [p.kind for p in report.problems] == ["corrupt_object"]
    assert store.lookup(IDENT, conv_keys(1, 4), with_state=True, verify=True).reason == "corrupt"
    # a missing state makes the entry a miss for a state lookup (never pages without it)
    os.unlink(state_path)
    assert store.lookup(IDENT, conv_keys(1, 4), with_state=True).reason == "absent"
    # eviction frees the state object with the pages
    with store.collector.exclusive(timeout_s=5):
        protected = store.collector.refresh_view()
        store.collector.evict([result.entry_id], protected)
    assert store.capacity().entries == 0


def test_manifest_with_state_round_trips_and_old_manifests_encode_unchanged(tmp_path):
    store = open_store(tmp_path)
    store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4), state=STATE)
    store.publish(IDENT, conv_keys(2, 4), conv_pages(2, 4, 4))
    for entry in store.entries():
        raw = open(entry.path, "rb").read()
        m = decode(raw)
        assert encode(m) == raw
        assert (b'"state"' in raw) == (m.state is not None)
