"""A restore checks each page against the XXH3-128 its manifest records (issue 41: BLAKE3 alone
cost more than an unchecked load); objects stay named by BLAKE3. The checksums are optional fields
of the same manifest format: manifests written before them still restore, verified by their BLAKE3
names, and a sparkcache that predates them reads the new ones."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import xxhash

from sparkcache.store.manifests import MAGIC, ManifestError, decode
from sparkcache.store.objects import ObjectError
from store_helpers import IDENT, conv_keys, conv_pages, flip_bit, open_store

N, BPP = 10, 4


def _rewrite(path: str, edit) -> None:
    """Apply ``edit`` to a manifest's JSON body and write it back with a valid header, as
    another writer could."""
    with open(path, "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    edit(body)
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)


@pytest.fixture
def stored(tmp_path):
    store = open_store(tmp_path / "root", page_blocks=BPP)
    pages = conv_pages(1, N, BPP)
    assert store.publish(IDENT, conv_keys(1, N), pages).ok
    return store, pages


def _reopen(store):
    """A new store on the same root (the one the fixture made)."""
    return open_store(os.path.dirname(store.layout.base), page_blocks=BPP)  # base: root/namespace


def _read(store):
    hit = store.lookup(IDENT, conv_keys(1, N))
    assert hit.hit, hit
    return store.read(hit.handle)


def test_each_page_records_its_xxh3_128_and_a_restore_returns_its_bytes(stored):
    store, pages = stored
    handle = store.lookup(IDENT, conv_keys(1, N)).handle
    assert [ref.checksum for ref in handle.pages] == [xxhash.xxh3_128_hexdigest(p) for p in pages]
    assert [bytes(p) for p in _read(store).pages] == pages


def test_a_restore_checks_the_recorded_checksum_not_the_name(stored):
    """The object's bytes match its BLAKE3 name, but the manifest records another XXH3-128:
    refused as corrupt. So the checksum, not the name, is what a restore checks."""
    store, _ = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)

    def wrong_checksum(body):
        body["checksums"][1] = "0" * 32

    _rewrite(entry.path, wrong_checksum)
    result = _read(_reopen(store))
    assert result.reason == "corrupt" and "XXH3-128" in result.detail, result


def test_a_flipped_byte_is_refused_by_the_checksum(stored):
    store, _ = stored
    ref = store.lookup(IDENT, conv_keys(1, N)).handle.pages[2]
    flip_bit(store.objects.path(ref.digest), 100)
    result = _read(store)
    assert result.reason == "corrupt" and result.bad_digest == ref.digest and "XXH3-128" in result.detail


def _without_checksums(body):
    """A manifest as sparkcache wrote it before the checksums."""
    body.pop("checksums")


def test_a_manifest_without_checksums_still_restores_verified_by_the_names(stored):
    store, pages = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, _without_checksums)
    reopened = _reopen(store)
    handle = reopened.lookup(IDENT, conv_keys(1, N)).handle
    assert all(ref.checksum is None for ref in handle.pages)
    assert [bytes(p) for p in _read(reopened).pages] == pages
    flip_bit(reopened.objects.path(handle.pages[0].digest), 0)  # the BLAKE3 name no longer matches
    result = _read(reopened)
    assert result.reason == "corrupt" and "BLAKE3" in result.detail, result


def test_a_longer_entry_reuses_an_old_page_without_a_checksum(stored):
    """Growth over an entry written before the checksums: its pages are reused as they are
    recorded (no checksum, null in the new manifest); the new pages get one; the new manifest
    reads back and restores."""
    store, pages = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, _without_checksums)
    reopened = _reopen(store)
    longer = conv_pages(1, N + 8, BPP)
    published = reopened.publish(IDENT, conv_keys(1, N + 8), [None, None, *longer[2:]])
    assert published.ok, published
    hit = reopened.lookup(IDENT, conv_keys(1, N + 8))
    assert [ref.checksum is None for ref in hit.handle.pages] == [True, True, False, False, False]
    assert [bytes(p) for p in reopened.read(hit.handle).pages] == [*pages[:2], *longer[2:]]


def _decode_edited(store, edit):
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, edit)
    with open(entry.path, "rb") as f:
        return decode(f.read())


@pytest.mark.parametrize("bad", ["0" * 31, "0" * 33, "G" * 32, "A" * 32, 7, True, ["0" * 32]])
def test_a_checksum_that_is_not_32_lower_case_hex_is_corrupt(stored, bad):
    def set_bad(body):
        body["checksums"][0] = bad

    with pytest.raises(ManifestError, match="checksum"):
        _decode_edited(stored[0], set_bad)


@pytest.mark.parametrize("edit", [
    lambda body: body["checksums"].pop(),                      # one short
    lambda body: body["checksums"].append("0" * 32),           # one more than the pages
    lambda body: body.update(checksums={"0": "0" * 32}),       # not a list
    lambda body: body.update(state_checksum="0" * 32),         # no state to check
    lambda body: body["pages"][0].append(body["checksums"][0]),  # inside the page's [name, size]
], ids=["short", "long", "not-a-list", "state-checksum-without-state", "inside-the-page"])
def test_checksums_that_do_not_line_up_with_the_pages_are_corrupt(stored, edit):
    with pytest.raises(ManifestError):
        _decode_edited(stored[0], edit)


def test_verify_names_a_manifest_whose_checksum_is_not_its_objects(stored):
    from store_helpers import run_cli

    store, _ = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    root = os.path.dirname(store.layout.base)
    assert run_cli("verify", "--root", root).returncode == 0

    def wrong_checksum(body):
        body["checksums"][1] = "0" * 32

    _rewrite(entry.path, wrong_checksum)
    cli = run_cli("verify", "--root", root)
    assert cli.returncode == 1 and entry.path in cli.stdout and "XXH3-128" in cli.stdout, cli.stdout


def test_quarantine_removes_the_object_whose_bytes_are_wrong_or_the_entry_whose_checksum_is(stored):
    """What a writing worker does after a refused restore (``WorkerSide._quarantine``): a flipped
    object goes (the next capture writes it anew); an entry whose manifest records another
    checksum for intact bytes goes (with the objects only it referenced, as any discard).
    Nothing goes while nothing is wrong."""
    store, pages = stored
    hit = store.lookup(IDENT, conv_keys(1, N))
    good = hit.handle.pages[0]
    assert store.quarantine(hit.entry_id, good) == ""
    flip_bit(store.objects.path(hit.handle.pages[2].digest), 10)
    assert store.quarantine(hit.entry_id, hit.handle.pages[2]) == "object"
    assert not os.path.exists(store.objects.path(hit.handle.pages[2].digest))

    assert store.publish(IDENT, conv_keys(1, N), pages).ok  # written anew
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, lambda body: body["checksums"].__setitem__(1, "0" * 32))
    reopened = _reopen(store)
    hit = reopened.lookup(IDENT, conv_keys(1, N))
    assert _read(reopened).reason == "corrupt"
    assert reopened.check_verified(hit.handle.pages[0]) is None
    with pytest.raises(ObjectError, match="XXH3-128"):
        reopened.check_verified(hit.handle.pages[1])
    assert reopened.quarantine(hit.entry_id, hit.handle.pages[1]) == "entry"
    assert not reopened.lookup(IDENT, conv_keys(1, N)).hit
