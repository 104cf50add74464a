"""The index finds the longest stored prefix of a request as a scan of every entry would: the
block index holds only every ``STRIDE``-th key of an entry (and its first), and the depth is
found by bisection, so conversations that branch anywhere (inside a stride, at its edge, in
the first blocks), entries of any length and requests longer or shorter than every entry are
drawn against the obvious answer."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcache.store.identity import entry_id_for
from sparkcache.store.index import STRIDE, EntryIndex, IndexedEntry
from sparkcache.store.layout import StoreLayout
from sparkcache.store.manifests import Manifest, PageRef
from sparkcache.store.objects import LocalBackend

from store_helpers import IDENT

BPP = 4


def _path(branches: tuple[int, ...]) -> list[str]:
    """Chained keys of a walk down a tree: the key at i names the whole walk up to i."""
    out, digest = [], b"root"
    for b in branches:
        digest = hashlib.sha256(digest + bytes([b])).digest()
        out.append(digest.hex()[:40])
    return out


walks = st.lists(st.integers(0, 2), min_size=1, max_size=3 * STRIDE + 5).map(tuple)


def _entry(keys: list[str], seq: int) -> IndexedEntry:
    pages = tuple(PageRef(hashlib.sha256(f"{k}".encode()).hexdigest(), 1)
                  for k in keys[BPP - 1::BPP] + ([keys[-1]] if len(keys) % BPP else []))
    m = Manifest(entry_id_for(IDENT.digest(), keys[-1]), IDENT, tuple(keys), BPP, pages, 1.0)
    return IndexedEntry(m, f"/nowhere/{seq}", seq, 100, float(seq))


@settings(max_examples=400, deadline=None)
@given(st.lists(walks, min_size=1, max_size=8), walks)
def test_the_longest_stored_prefix_is_found(tmp_path_factory, stored, request):
    layout = StoreLayout.create(str(tmp_path_factory.mktemp("s")))
    index = EntryIndex(layout, 4096, objects=LocalBackend(layout, 4096))
    entries = {}
    for seq, walk in enumerate(stored):
        entry = _entry(_path(walk), seq)
        index.add(entry)
        entries[entry.entry_id] = entry
    keys = _path(request)
    expected = max(_common(list(e.manifest.block_keys), keys) for e in index.entries.values())
    found, depth = index.longest_match(IDENT.digest(), keys)
    assert depth == expected
    if depth:
        assert list(found.manifest.block_keys[:depth]) == keys[:depth]
    else:
        assert found is None


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
