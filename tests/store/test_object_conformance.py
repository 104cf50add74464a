"""The object backend's conformance suite, run on the working filesystem and on a real tmpfs.

The contract every filesystem the store sits on must give the page objects (restic's backend
tests are the model): a durable put (temp file, fdatasync, rename) leaves exactly the object;
every verified read returns the bytes that were put or raises with the reason; a listing
names what is there; a removal reports what it freed; damage (a flipped byte, a truncation, a
link, a wrong size) is refused, and only what is corrupt is discarded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hostile_helpers import small_tmpfs
from sparkcache.store import PageRef, Reason
from sparkcache.store.objects import ObjectError, digest_of
from store_helpers import open_store

pytestmark = [pytest.mark.root]  # the tmpfs is a real mount

SIZES = (1, 4096, (1 << 20) + 3)  # a byte, a page of the filesystem, more than a MiB and not aligned


@pytest.fixture(params=["working_fs", "tmpfs"])
def objects(request, tmp_path: Path):
    """A fresh store's object backend on one filesystem, with three objects put into it."""
    if request.param == "tmpfs":
        with small_tmpfs(tmp_path / "mnt", size="64m") as mnt:
            yield _with_objects(Path(mnt) / "store")
    else:
        yield _with_objects(tmp_path / "store")


def _with_objects(root: Path):
    store = open_store(str(root))
    datas = [bytes([n % 251]) * size for n, size in enumerate(SIZES)]
    items = [(digest_of(d), d, os.path.join(store.layout.staging_dir, f"put-{i}.tmp")) for i, d in enumerate(datas)]
    shards = store.objects.write_many(items)
    return store.objects, {digest: data for digest, data, _ in items}, shards, store.layout


def test_a_put_leaves_exactly_the_object_and_names_its_shard(objects):
    backend, put, shards, layout = objects
    assert os.listdir(layout.staging_dir) == []  # every temp file was renamed into place
    assert shards == {os.path.dirname(backend.path(d)) for d in put}
    for digest, data in put.items():
        assert os.path.getsize(backend.path(digest)) == len(data)


def test_every_read_returns_the_bytes_that_were_put(objects):
    backend, put, _, _ = objects
    refs = [PageRef(d, len(data)) for d, data in put.items()]
    for ref in refs:
        assert backend.read_verified(ref.digest, ref.size) == put[ref.digest]
        backend.check_verified(ref.digest, ref.size)
        backend.check_present(ref.digest, ref.size)
        assert backend.exists_with_size(ref.digest, ref.size)
        assert not backend.exists_with_size(ref.digest, ref.size + 1)
    for parallel in (True, False):
        got = backend.read_many_verified(refs, parallel=parallel)
        assert [bytes(g[:]) for g in got] == [put[r.digest] for r in refs]


def test_a_listing_names_what_is_there(objects):
    backend, put, _, layout = objects
    listed = {digest for shard in os.listdir(layout.objects_dir) for digest, _ in backend.iter_shard(shard)}
    assert listed == set(put)
    assert all(occupied >= len(put[d]) for shard in {d[:2] for d in put} for d, occupied in backend.iter_shard(shard))


def test_a_removal_reports_what_it_freed_once(objects):
    backend, put, _, _ = objects
    digest, data = next(iter(put.items()))
    assert backend.remove(digest) >= len(data)
    assert backend.remove(digest) == 0
    with pytest.raises(ObjectError) as caught:
        backend.read_verified(digest, len(data))
    assert caught.value.reason is Reason.ABSENT


def _damage(path: str, how: str, size: int) -> None:
    if how == "flipped byte":
        with open(path, "r+b") as fh:
            fh.seek(size // 2)
            byte = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([byte[0] ^ 0x01]))
    elif how == "truncated":
        os.truncate(path, size - 1)
    elif how == "grown":
        with open(path, "ab") as fh:
            fh.write(b"x")
    elif how == "symlink":
        target = path + ".elsewhere"
        os.rename(path, target)
        os.symlink(target, path)


@pytest.mark.parametrize("how, reason", [("flipped byte", Reason.CORRUPT), ("truncated", Reason.ABSENT),
                                         ("grown", Reason.CORRUPT), ("symlink", Reason.CORRUPT)])
def test_damage_is_refused_by_every_read_and_only_corruption_is_discarded(objects, how, reason):
    backend, put, _, _ = objects
    digest, data = max(put.items(), key=lambda item: len(item[1]))
    _damage(backend.path(digest), how, len(data))
    reads = [lambda: backend.read_verified(digest, len(data)),
             lambda: backend.check_verified(digest, len(data)),
             lambda: backend.read_many_verified([PageRef(digest, len(data))], parallel=False)]
    for read in reads:
        with pytest.raises(ObjectError) as caught:
            read()
        assert caught.value.reason is reason and caught.value.digest == digest
    assert backend.discard_corrupt(digest, len(data)) is (reason is Reason.CORRUPT)
    assert os.path.lexists(backend.path(digest)) is (reason is not Reason.CORRUPT)
    others = {d: v for d, v in put.items() if d != digest}
    for other, value in others.items():  # the neighbours are untouched
        assert backend.read_verified(other, len(value)) == value
        assert backend.discard_corrupt(other, len(value)) is False
