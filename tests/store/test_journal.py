"""The view of another process's changes comes from the journal: a lookup after another
process published or evicted reads the one manifest that changed and lists no directory
(on 403da3e every lookup after a publication re-listed the identity's directory), a
rotation loses nothing, a publisher that died between its manifest's rename and its record
is found by the next pass's re-listing (and its objects are never swept meanwhile), and a
manifest that declares more than the store can hold is refused, not loaded."""

from __future__ import annotations

import os
import re

import pytest

from sparkcache.store import PassBudget, run_pass
from sparkcache.store.identity import entry_id_for
from sparkcache.store.index import MAX_ENTRY_KEYS
from sparkcache.store.locks import exclusive_lock
from sparkcache.store.manifests import Manifest, PageRef, encode
from sparkcache.store.reasons import Reason

from faultfs import FaultFS
from store_helpers import IDENT, conv_keys, conv_pages, open_store, stopped_clock

BUDGET = PassBudget(max_entries=1000, max_bytes=1 << 40, max_ms=1e9)


@pytest.mark.root
def test_a_lookup_after_another_process_publishes_lists_nothing(tmp_path):
    with FaultFS(tmp_path) as fs:
        reader = open_store(fs.mount)
        writer = open_store(fs.mount)
        for conv in range(20):
            assert writer.publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4)).ok
        assert reader.capacity().entries == 20  # caught up
        assert writer.publish(IDENT, conv_keys(99, 8), conv_pages(99, 8, 4)).ok
        fs.record(True)
        hit = reader.lookup(IDENT, conv_keys(99, 8))
        ops = fs.take_log()
    assert hit.hit and hit.hit_blocks == 8
    listings = [path for op, path in ops if op == "readdir"]
    opened = {path for op, path in ops if op == "open" and path.endswith(".mf")}
    assert listings == [], listings
    assert opened == {f"/default/manifests/{IDENT.digest()}/{hit.entry_id}.mf"}, opened


def test_another_process_s_eviction_leaves_the_view(tmp_path):
    reader = open_store(tmp_path)
    writer = open_store(tmp_path)
    for conv in range(3):
        assert writer.publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4)).ok
    before = reader.capacity()
    assert before.entries == 3
    gone = writer.lookup(IDENT, conv_keys(1, 8)).entry_id
    assert writer.discard([gone]) == (gone,)
    after = reader.capacity()
    assert after.entries == 2 and after.used_bytes < before.used_bytes
    assert reader.lookup(IDENT, conv_keys(1, 8)).reason == Reason.NOT_FOUND


def test_a_lookup_whose_best_match_was_removed_elsewhere_answers_the_next_best(tmp_path):
    """Found by the fault state machine: another process removed the best match (its record
    not applied yet: a lookup applies what fits in its budget, and a removal's record is
    best effort). The lookup found that entry's objects gone and missed, although a shorter
    entry of the same prefix was there; it must answer with that one."""
    store = open_store(tmp_path)
    assert store.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4)).ok
    assert store.publish(IDENT, conv_keys(2, 6), conv_pages(2, 6, 4)).ok
    shorter = entry_id_for(IDENT.digest(), conv_keys(2, 6)[-1])
    longer = store.entry(store.lookup(IDENT, conv_keys(2, 6)).entry_id)  # the longer one wins
    assert longer.entry_id != shorter
    kept = {p.digest for p in store.entry(shorter).unique_pages}
    os.unlink(longer.path)  # as another process's removal whose record this one has not read
    for page in longer.unique_pages:
        if page.digest not in kept:
            os.unlink(store.objects.path(page.digest))
    for _ in range(2):  # the first finds the removal; the second has the view without it
        hit = store.lookup(IDENT, conv_keys(2, 8))
        assert hit.hit and hit.entry_id == shorter and hit.hit_blocks == 6, hit
    assert store.entry(longer.entry_id) is None


def test_a_rotation_loses_no_record(tmp_path):
    reader = open_store(tmp_path)
    writer = open_store(tmp_path)
    assert writer.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4)).ok  # before: old file
    with exclusive_lock(writer.layout, timeout_s=5):
        assert writer.catalog.index.journal.rotate_if_large(limit=0)
    assert writer.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4)).ok  # after: new file
    assert reader.capacity().entries == 2
    assert all(reader.lookup(IDENT, conv_keys(c, 8)).hit for c in (1, 2))


def test_a_publisher_killed_between_rename_and_record_is_found_by_the_next_pass(tmp_path):
    reader = open_store(tmp_path)
    assert reader.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4)).ok
    pid = os.fork()
    if pid == 0:  # the publisher: dies right after its manifest's rename, before its record
        try:
            writer = open_store(tmp_path)
            writer.catalog.published = lambda *a: os._exit(9)
            writer.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert reader.lookup(IDENT, conv_keys(2, 8)).reason == Reason.NOT_FOUND  # not journaled
    objects = {p for p in _files(tmp_path) if "/objects/" in p}
    report = run_pass(reader, BUDGET, sweep_shards=256, timer=stopped_clock)
    assert report.orphans_collected == 0, report
    assert {p for p in _files(tmp_path) if "/objects/" in p} == objects
    assert reader.lookup(IDENT, conv_keys(2, 8)).hit  # the dead intent asked for a re-listing
    assert open_store(tmp_path).lookup(IDENT, conv_keys(2, 8)).hit


def _files(top) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs}


def _forge(store, keys: list[str], pages: list[PageRef]) -> str:
    """A well-formed manifest (valid checksum) for ``keys`` naming ``pages``."""
    from sparkcache.store.identity import entry_id_for
    idd = IDENT.digest()
    entry_id = entry_id_for(idd, keys[-1])
    bpp = -(-len(keys) // len(pages))
    path = store.layout.manifest_path(idd, entry_id)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode(Manifest(entry_id, IDENT, tuple(keys), bpp, tuple(pages), 1.0)))
    return entry_id


@pytest.mark.parametrize("what", ["bytes over the cap", "blocks over the bound"])
def test_a_manifest_declaring_more_than_the_store_holds_is_refused(tmp_path, what):
    store = open_store(tmp_path, max_bytes=1 << 20, low_watermark_bytes=1 << 19)
    if what == "bytes over the cap":
        entry_id = _forge(store, conv_keys(7, 4), [PageRef("ab" * 32, 2 << 20)])
    else:
        entry_id = _forge(store, [f"k{i}" for i in range(MAX_ENTRY_KEYS + 1)],
                          [PageRef("cd" * 32, 4096)])
    fresh = open_store(tmp_path, max_bytes=1 << 20, low_watermark_bytes=1 << 19)
    bad = {b.entry_id: b for b in fresh.bad_manifests()}
    assert entry_id in bad and fresh.entry(entry_id) is None
    assert re.search(r"cap|more than an entry may hold", bad[entry_id].detail), bad[entry_id].detail
    assert fresh.capacity().used_bytes < 1 << 20


def test_a_publication_larger_than_the_store_is_refused_before_writing(tmp_path):
    store = open_store(tmp_path, max_bytes=64 << 10, low_watermark_bytes=32 << 10)
    result = store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4, 16 << 10))
    assert not result.ok and result.reason == Reason.OVER_CAPACITY
    assert "larger than the store's cap" in result.detail and "SPARKCACHE_MAX_BYTES" in result.detail
    assert not any("/objects/" in p for p in _files(tmp_path))
