"""``PageStore.publish`` takes a page (and the recurrent state) as any C-contiguous buffer, by
its bytes: a 2-D or typed memoryview, a numpy array, an ``array.array``. What is published
reads back byte-identical; a buffer that is not C-contiguous is refused with a ValueError
that says so and how to fix it, before anything is written."""

from __future__ import annotations

import array
import itertools
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from store_helpers import IDENT, open_store

_DTYPES = st.sampled_from(["u1", "i1", "<u2", ">i2", "<f4", "<f8", "<i8", "<c8", "?"])
_ARRAYS = hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=6),
                     elements=None)
_KINDS = st.sampled_from(["memoryview", "array", "cast_view"])
_KEYS = itertools.count()
_DIR = tempfile.TemporaryDirectory(prefix="sc-buffers-")


def _store():
    """One store for every example (a fresh one each would cost the suite seconds)."""
    return open_store(os.path.join(_DIR.name, "s"), page_blocks=1)


def _as(kind: str, arr: np.ndarray):
    if kind == "memoryview":
        return memoryview(arr)  # typed ('f', 'H', ...) and n-dimensional
    if kind == "cast_view":  # a memoryview cast back to the array's own shape and format
        flat = memoryview(arr.tobytes())
        return flat.cast(arr.dtype.char, arr.shape) if arr.dtype.char in "bBhHiIlLqQfd?" else flat
    return arr


def _read_back(store, keys, with_state=False):
    found = store.lookup(IDENT, keys, with_state=with_state)
    assert found.hit and found.hit_blocks == len(keys), found
    read = store.read(found.handle)
    assert read.ok, read
    state = store.read_pages([found.handle.state])[0] if with_state else None
    return [bytes(p) for p in read.pages], state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages=st.lists(st.tuples(_ARRAYS, _KINDS), min_size=1, max_size=3),
       state=st.none() | st.tuples(_ARRAYS, _KINDS))
def test_any_c_contiguous_buffer_publishes_by_its_bytes_and_reads_back_identical(pages, state):
    store = _store()
    keys = [f"buf-{next(_KEYS)}" for _ in pages]
    given_pages = [_as(kind, arr) for arr, kind in pages]
    given_state = None if state is None else _as(state[1], state[0])
    result = store.publish(IDENT, keys, given_pages, state=given_state)
    assert result.ok, result
    entry = store.entry(result.entry_id).manifest
    assert [p.size for p in entry.pages] == [arr.nbytes for arr, _ in pages]
    got, got_state = _read_back(store, keys, with_state=state is not None)
    assert got == [arr.tobytes() for arr, _ in pages]
    if state is not None:
        assert entry.state.size == state[0].nbytes and bytes(got_state) == state[0].tobytes()


def test_the_buffers_the_adversary_used():
    """A 2-D memoryview (was: published "ok" with len() of its first dimension, the entry
    corrupt forever) and typed memoryviews 'f' and 'H' (was: a bare BufferError)."""
    store = _store()
    flat = bytes(range(256)) * 4
    two_d = memoryview(flat).cast("B", (32, 32))
    floats = memoryview(array.array("f", [1.5] * 64))
    shorts = memoryview(array.array("H", range(100)))
    for n, page in enumerate((two_d, floats, shorts)):
        keys = [f"adversary-{n}"]
        result = store.publish(IDENT, keys, [page])
        assert result.ok, result
        assert _read_back(store, keys)[0] == [page.tobytes()]


@pytest.mark.parametrize("where", ["page", "state"])
@pytest.mark.parametrize("make", [
    lambda: memoryview(bytes(64))[::2],
    lambda: np.arange(64, dtype="<f4").reshape(8, 8).T,
    lambda: np.asfortranarray(np.arange(64, dtype="u1").reshape(8, 8)),
    lambda: np.arange(64, dtype="<i2")[::3],
], ids=["strided_memoryview", "transposed", "fortran_order", "strided_array"])
def test_a_buffer_that_is_not_c_contiguous_is_refused_before_anything_is_written(where, make):
    store = _store()
    before = sorted(os.listdir(store.layout.objects_dir))
    keys = [f"strided-{next(_KEYS)}"]
    page, state = (make(), None) if where == "page" else (b"page", make())
    with pytest.raises(ValueError) as info:
        store.publish(IDENT, keys, [page], state=state)
    message = str(info.value)
    assert "C-contiguous" in message and where in message, message
    assert sorted(os.listdir(store.layout.objects_dir)) == before
    assert not store.lookup(IDENT, keys).hit


def test_something_that_is_not_a_buffer_is_refused():
    store = _store()
    with pytest.raises(TypeError, match="page 0.*bytes-like"):
        store.publish(IDENT, [f"nobuf-{next(_KEYS)}"], [[1, 2, 3]])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)),
       step=st.integers(1, 3), axis=st.integers(0, 2), transpose=st.booleans())
def test_a_view_of_an_array_is_published_exactly_when_it_is_c_contiguous(arr, step, axis, transpose):
    """Slices and transposes of random arrays: C-contiguous ones publish their bytes, every
    other one is refused, never stored with the wrong bytes."""
    axis = axis % arr.ndim
    view = arr[(slice(None),) * axis + (slice(None, None, step),)]
    view = view.T if transpose else view
    store = _store()
    keys = [f"view-{next(_KEYS)}"]
    if not view.flags.c_contiguous:
        with pytest.raises(ValueError, match="C-contiguous"):
            store.publish(IDENT, keys, [memoryview(view)])
        return
    assert store.publish(IDENT, keys, [memoryview(view)]).ok
    assert _read_back(store, keys)[0] == [view.tobytes()]
