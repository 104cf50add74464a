"""``PageStore.adopt``: an entry another store published, written here through the publication
path with its manifest's bytes kept: the same entry, objects and manifest, ``verify`` clean; an
object whose bytes are not the manifest's is refused before the manifest is placed."""

from __future__ import annotations

import pytest

from sparkcache.store import PageStore, Reason
from sparkcache.store.manifests import ManifestError
from sparkcache.store.streams import PageSourceError, PageStream
from store_helpers import IDENT, conv_keys, conv_pages, open_store


def _published(store: PageStore, state: bytes | None = None) -> str:
    result = store.publish(IDENT, conv_keys(3, 10), conv_pages(3, 10, 4), state=state)
    assert result.ok, result
    return result.entry_id


@pytest.mark.parametrize("state", [None, b"recurrent" * 100], ids=["attention", "hybrid"])
def test_an_adopted_entry_is_the_published_one(tmp_path, state):
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    entry_id = _published(a, state)
    manifest, data = a.manifest_bytes(entry_id)
    objects = a.read_pages(manifest.objects)
    result = b.adopt(data, objects)
    assert result.ok and result.entry_id == entry_id, result
    assert b.manifest_bytes(entry_id)[1] == data
    assert b.read_pages(manifest.objects) == objects
    assert b.lookup(IDENT, conv_keys(3, 10), with_state=state is not None).hit_blocks == 10
    assert PageStore.verify_root(str(tmp_path / "b")).ok


def test_an_object_that_is_not_the_manifests_is_refused_and_no_entry_appears(tmp_path):
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    entry_id = _published(a)
    manifest, data = a.manifest_bytes(entry_id)
    objects = a.read_pages(manifest.objects)
    objects[1][0] ^= 1
    result = b.adopt(data, objects)
    assert not result.ok and result.reason is Reason.CORRUPT and manifest.pages[1].digest in result.detail
    assert b.entry(entry_id) is None and not b.lookup(IDENT, conv_keys(3, 10)).hit
    assert PageStore.verify_root(str(tmp_path / "b")).ok
    with pytest.raises(ValueError, match="2 objects given"):
        b.adopt(data, objects[:2])
    with pytest.raises(ManifestError):
        b.adopt(data[:-1], objects)


def test_an_entry_adopted_from_a_stream_and_a_stream_that_fails_midway(tmp_path):
    """Objects handed a chunk at a time (as a fetch hands them while it GETs the next): the same
    entry; a source that fails after some objects were written leaves no entry."""
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    entry_id = _published(a)
    manifest, data = a.manifest_bytes(entry_id)
    objects = a.read_pages(manifest.objects)
    sizes = tuple(len(o) for o in objects)

    def failing():
        yield objects[:1]
        raise PageSourceError("the source failed after one object")

    result = b.adopt(data, PageStream(sizes, failing))
    assert not result.ok and result.reason is Reason.SOURCE_FAILED, result
    assert b.entry(entry_id) is None and PageStore.verify_root(str(tmp_path / "b")).ok
    result = b.adopt(data, PageStream(sizes, lambda: ([o] for o in objects)))
    assert result.ok and result.entry_id == entry_id, result
    assert b.manifest_bytes(entry_id)[1] == data and b.read_pages(manifest.objects) == objects
    assert PageStore.verify_root(str(tmp_path / "b")).ok
