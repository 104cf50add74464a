"""A restore's read of objects that are not in the page cache (``read_many_verified`` on one
thread and on the pool): the same bytes as a warm read, and a flipped byte on disk still
refused."""

from __future__ import annotations

import pytest

from bench.page_cache import evict
from sparkcache.store.objects import ObjectError
from sparkcache.store.reasons import Reason
from store_helpers import IDENT, conv_keys, conv_pages, flip_bit, open_store

N_BLOCKS, BPP, BLOCK_BYTES = 40, 4, 64 << 10  # 10 pages of 256 KiB


@pytest.fixture
def stored(tmp_path):
    store = open_store(tmp_path / "root", page_blocks=BPP)
    pages = conv_pages(1, N_BLOCKS, BPP, BLOCK_BYTES)
    assert store.publish(IDENT, conv_keys(1, N_BLOCKS), pages).ok
    handle = store.lookup(IDENT, conv_keys(1, N_BLOCKS)).handle
    return store, handle, pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_read_returns_the_stored_bytes(stored, parallel):
    store, handle, pages = stored
    evict([store.objects.path(ref.digest) for ref in handle.pages])  # raises unless all cold
    got = store.objects.read_many_verified(list(handle.pages), parallel=parallel)
    assert [bytes(m) for m in got] == pages


@pytest.mark.parametrize("parallel", [False, True])
def test_cold_read_refuses_a_flipped_byte(stored, parallel):
    store, handle, _ = stored
    bad = handle.pages[6]
    flip_bit(store.objects.path(bad.digest), 1000)
    evict([store.objects.path(ref.digest) for ref in handle.pages])  # raises unless all cold
    with pytest.raises(ObjectError) as exc:
        store.objects.read_many_verified(list(handle.pages), parallel=parallel)
    assert exc.value.reason == Reason.CORRUPT and exc.value.digest == bad.digest
