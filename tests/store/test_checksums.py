"""A restore checks each page against the XXH3-128 its manifest records (issue 41: BLAKE3 alone
cost more than an unchecked load); objects stay named by BLAKE3. Format 2 manifests, written
before the checksum, still restore, verified by their BLAKE3 names."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import xxhash

from sparkcache.store.manifests import MAGIC, ManifestError, decode
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
        body["pages"][1][2] = "0" * 32

    _rewrite(entry.path, wrong_checksum)
    result = _read(_reopen(store))
    assert result.reason == "corrupt" and "XXH3-128" in result.detail, result


def test_a_flipped_byte_is_refused_by_the_checksum(stored):
    store, _ = stored
    ref = store.lookup(IDENT, conv_keys(1, N)).handle.pages[2]
    flip_bit(store.objects.path(ref.digest), 100)
    result = _read(store)
    assert result.reason == "corrupt" and result.bad_digest == ref.digest and "XXH3-128" in result.detail


def test_a_format_2_manifest_still_restores_verified_by_the_names(stored):
    store, pages = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)

    def format_2(body):
        body["format"] = 2
        body["pages"] = [ref[:2] for ref in body["pages"]]

    _rewrite(entry.path, format_2)
    reopened = _reopen(store)
    handle = reopened.lookup(IDENT, conv_keys(1, N)).handle
    assert all(ref.checksum is None for ref in handle.pages)
    assert [bytes(p) for p in _read(reopened).pages] == pages
    flip_bit(reopened.objects.path(handle.pages[0].digest), 0)  # the BLAKE3 name no longer matches
    result = _read(reopened)
    assert result.reason == "corrupt" and "BLAKE3" in result.detail, result


def test_a_longer_entry_reuses_a_format_2_page_with_its_two_fields(stored):
    """Growth over an old entry: its pages are reused as they are recorded (no checksum); the new
    pages get one; the new manifest reads back and restores."""
    store, pages = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, lambda body: body.update(format=2, pages=[ref[:2] for ref in body["pages"]]))
    reopened = _reopen(store)
    longer = conv_pages(1, N + 8, BPP)
    published = reopened.publish(IDENT, conv_keys(1, N + 8), [None, None, *longer[2:]])
    assert published.ok, published
    hit = reopened.lookup(IDENT, conv_keys(1, N + 8))
    assert [ref.checksum is None for ref in hit.handle.pages] == [True, True, False, False, False]
    assert [bytes(p) for p in reopened.read(hit.handle).pages] == [*pages[:2], *longer[2:]]


@pytest.mark.parametrize("bad", ["0" * 31, "0" * 33, "G" * 32, "A" * 32, 7, None, ["0" * 32]])
def test_a_checksum_that_is_not_32_lower_case_hex_is_corrupt(stored, bad):
    store, _ = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)

    def set_bad(body):
        body["pages"][0][2] = bad

    _rewrite(entry.path, set_bad)
    with open(entry.path, "rb") as f:
        data = f.read()
    with pytest.raises(ManifestError, match="checksum|not \\[name, size"):
        decode(data)


def test_a_format_2_page_with_three_fields_is_corrupt(stored):
    store, _ = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    _rewrite(entry.path, lambda body: body.update(format=2))
    with open(entry.path, "rb") as f:
        data = f.read()
    with pytest.raises(ManifestError, match=r"is not \[name, size\]"):
        decode(data)


def test_verify_names_a_manifest_whose_checksum_is_not_its_objects(stored):
    from store_helpers import run_cli

    store, _ = stored
    entry = store.entry(store.lookup(IDENT, conv_keys(1, N)).entry_id)
    root = os.path.dirname(store.layout.base)
    assert run_cli("verify", "--root", root).returncode == 0

    def wrong_checksum(body):
        body["pages"][1][2] = "0" * 32

    _rewrite(entry.path, wrong_checksum)
    cli = run_cli("verify", "--root", root)
    assert cli.returncode == 1 and entry.path in cli.stdout and "XXH3-128" in cli.stdout, cli.stdout
