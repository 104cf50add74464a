"""``read_pages_into``: a page read straight into the caller's buffers (a restore's destination
blocks), in order, whatever their number and sizes (more than one ``preadv``'s iovec limit
included), hashed as it is read and verified against what its manifest records: XXH3-128, or
the BLAKE3 name of a page that records none. A wrong byte or size is refused; an object gone
before the read writes nothing into the buffers."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcache.store import ObjectError, Reason
from store_helpers import IDENT, conv_keys, flip_bit, open_store

_DIR = tempfile.TemporaryDirectory(prefix="sc-read-into-")
_STORE = []


def _store():
    if not _STORE:
        _STORE.append(open_store(os.path.join(_DIR.name, "s"), page_blocks=1))
    return _STORE[0]


def _split(data: bytes, cuts: list[int]) -> list[memoryview]:
    bounds = [0, *sorted(set(c % (len(data) + 1) for c in cuts)), len(data)]
    return [memoryview(bytearray(hi - lo)) for lo, hi in zip(bounds, bounds[1:])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=1, max_size=3 << 20), cuts=st.lists(st.integers(0, 3 << 20), max_size=40),
       recorded=st.booleans())
def test_any_split_reads_the_page_and_verifies_it(data, cuts, recorded):
    store = _store()
    keys = conv_keys(abs(hash((data[:64], len(data)))) % 10**9, 1)
    result = store.publish(IDENT, keys, [data])
    assert result.ok, result
    ref = store.lookup(IDENT, keys).handle.pages[0]
    if not recorded:  # a manifest written before checksums: verified by the BLAKE3 name
        ref = dataclasses.replace(ref, checksum=None)
    views = _split(data, cuts)
    store.read_pages_into([ref], lambda i: views)
    assert b"".join(bytes(v) for v in views) == data


def test_more_buffers_than_one_preadv_takes(tmp_path):
    store = open_store(tmp_path / "s", page_blocks=1)
    data = os.urandom(5000 * 7)
    assert store.publish(IDENT, conv_keys(1, 1), [data]).ok
    ref = store.lookup(IDENT, conv_keys(1, 1)).handle.pages[0]
    views = [memoryview(bytearray(7)) for _ in range(5000)]  # past IOV_MAX (1,024 on Linux)
    store.read_pages_into([ref], lambda i: views)
    assert b"".join(bytes(v) for v in views) == data


@pytest.mark.parametrize("recorded", [True, False], ids=["xxh3", "blake3-name"])
def test_a_flipped_byte_is_refused(tmp_path, recorded):
    store = open_store(tmp_path / "s", page_blocks=1)
    data = os.urandom(1 << 20)
    assert store.publish(IDENT, conv_keys(1, 1), [data]).ok
    ref = store.lookup(IDENT, conv_keys(1, 1)).handle.pages[0]
    ref = ref if recorded else dataclasses.replace(ref, checksum=None)
    flip_bit(store.objects.path(ref.digest), 123_456)
    views = _split(data, [1000, 500_000])
    with pytest.raises(ObjectError) as err:
        store.read_pages_into([ref], lambda i: views)
    assert err.value.reason is Reason.CORRUPT


def test_an_object_gone_writes_nothing_and_sizes_must_add_up(tmp_path):
    store = open_store(tmp_path / "s", page_blocks=1)
    pages = [os.urandom(4096), os.urandom(4096)]
    assert store.publish(IDENT, conv_keys(1, 2), pages).ok
    refs = store.lookup(IDENT, conv_keys(1, 2)).handle.pages
    os.unlink(store.objects.path(refs[1].digest))
    views = [[memoryview(bytearray(4096))], [memoryview(bytearray(4096))]]
    with pytest.raises(ObjectError) as err:
        store.read_pages_into(refs, lambda i: views[i])
    assert err.value.reason is Reason.ABSENT
    assert not any(bytes(views[0][0])), "the first page was read although the second was gone"
    with pytest.raises(ValueError, match="views of 4095 bytes for an object of 4096"):
        store.read_pages_into(refs[:1], lambda i: [memoryview(bytearray(4095))])
