"""The object backend's conformance suite: every backend in ``BACKENDS``, each starting from the
objects a publication produced.

The contract every backend gives the page objects (restic's backend tests are the model): a
put is durable and leaves exactly the object; a put of an object already there is a no-op
(the first writer wins, nothing is rewritten); every get returns the bytes that were put or
raises with the reason, naming the object; a batch ``exists`` and a listing by prefix name
what is there; a deletion reports what it freed, and deleting twice is no error; damage (a
flipped byte, a truncation, a file grown, a link) is refused by every read. A backend with
the local filesystem's own doors (``local``) is held to them too: its reads into buffers and
its re-hash refuse the same damage, and only what is corrupt is discarded.

The local backends' objects are put by the store's own publication path (``PageStore.publish``
-> ``PublicationWriter`` -> the backend's put batch); the ``adopted`` ones by a fetch's path
(another store's entry ``adopt``-ed with ``cached=False``: written past the page cache with
O_DIRECT; on tmpfs, which is only memory, the flag changes nothing). The S3 backend (on the
tests' SeaweedFS, testing/seaweedfs.py) starts from the same bytes: a publication into a local store, whose objects
are then put through ``S3Backend.put_batch``. The real publication path to S3 (local publication
first, then the upload queue) arrives with the tier (issue 44, step 3); where a case publishes
again, the S3 backend's equivalent is a put batch of the same bytes. Its damage is done with the
raw client, past the backend (an object rewritten in place: S3 has no links).

Adding a backend is one line in ``BACKENDS``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import pytest

from bench.page_cache import resident_pages
from hostile_helpers import small_tmpfs
from sparkcache.store import PageRef, Reason
from sparkcache.store.backend import NewObject, ObjectError
from sparkcache.store.layout import UnsafePathError
from sparkcache.store.objects import LocalBackend
from sparkcache.store.staging import Staging
from s3_helpers import s3_backend
from store_helpers import IDENT, conv_keys, open_store

pytestmark = [pytest.mark.root]  # the tmpfs is a real mount


def _damage_file(subject: "Subject", digest: str, how: str, size: int) -> None:
    path = subject.backend.path(digest)
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


def _damage_object(subject: "Subject", digest: str, how: str, size: int) -> None:
    """The S3 object rewritten in place with the raw client: one byte flipped, one byte short,
    one byte more."""
    import obstore

    key = subject.backend.location.key(digest)
    data = bytearray(obstore.get(subject.raw, key).bytes())
    assert len(data) == size
    if how == "flipped byte":
        data[size // 2] ^= 0x01
    elif how == "truncated":
        del data[-1]
    elif how == "grown":
        data += b"x"
    obstore.put(subject.raw, key, bytes(data), use_multipart=False)


def _inode(subject: "Subject", digest: str):
    return os.stat(subject.backend.path(digest)).st_ino


def _version(subject: "Subject", digest: str):
    """What changes when an S3 object is written again: its ETag and its last modification."""
    import obstore

    meta = obstore.head(subject.raw, subject.backend.location.key(digest))
    return meta["e_tag"], meta["last_modified"], meta.get("version")


def _local_backend(request, store):
    return store.objects


def _s3_on_seaweedfs(request, store):
    return s3_backend(request.getfixturevalue("seaweedfs"), request.getfixturevalue("monkeypatch"))


@contextlib.contextmanager
def _working_fs(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


@contextlib.contextmanager
def _tmpfs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "mnt", size="64m") as mnt:
        yield Path(mnt) / "store"


@dataclass(frozen=True)
class BackendCase:
    """One backend under the suite: where the publishing store's root goes, the backend (the
    store's own, or one made beside it: ``backend(request, store)``), how an object of it is
    damaged (each of ``damages``, from ``DAMAGE``), what marks an object as written once
    (``mark``: unchanged unless it is written again), and whether it has the local filesystem's
    doors, and whether its objects came the fetch's way (``adopted``)."""

    name: str
    root: Callable[[Path], ContextManager[Path]]
    backend: Callable = _local_backend
    damage: Callable[["Subject", str, str, int], None] = _damage_file
    damages: tuple[str, ...] = ("flipped byte", "truncated", "grown", "symlink")
    mark: Callable[["Subject", str], object] = _inode
    local: bool = True
    adopted: bool = False  # the objects put as a fetch puts them: ``adopt(..., cached=False)``


BACKENDS = [
    BackendCase("local", _working_fs),
    BackendCase("local-tmpfs", _tmpfs),
    BackendCase("local-adopted", _working_fs, adopted=True),
    BackendCase("local-tmpfs-adopted", _tmpfs, adopted=True),
    BackendCase("s3-seaweedfs", _working_fs, _s3_on_seaweedfs, _damage_object,
                ("flipped byte", "truncated", "grown"), _version, local=False),
]
LOCAL = [case for case in BACKENDS if case.local]
DAMAGE = [("flipped byte", Reason.CORRUPT), ("truncated", Reason.ABSENT), ("grown", Reason.CORRUPT),
          ("symlink", Reason.CORRUPT)]
SIZES = (1, 4096, (1 << 20) + 3)  # a byte, a page of the filesystem, more than a MiB and not aligned


def _damaged(cases: list[BackendCase], hows: tuple[str, ...] | None = None) -> list:
    """(backend, damage, the reason a read gives) for every damage each backend can take."""
    return [pytest.param(case, how, reason, id=f"{case.name}-{how}") for case in cases
            for how, reason in DAMAGE if how in case.damages and (hows is None or how in hows)]


def _cases(cases: list[BackendCase]) -> dict:
    return {"argnames": "subject", "argvalues": cases, "ids": [c.name for c in cases], "indirect": True}


@dataclass(frozen=True)
class Subject:
    case: BackendCase
    store: object  # the PageStore that published the objects
    backend: object
    put: dict  # digest -> the bytes published under it
    pages: tuple[PageRef, ...]  # as the published manifest records them
    raw: object = field(default=None, repr=False)  # S3: the raw client, past the backend


@pytest.fixture(params=BACKENDS, ids=[case.name for case in BACKENDS])
def subject(request, tmp_path: Path):
    """A fresh store on one backend, with three objects published into it (S3: published into
    the local store, then put through the S3 backend's put batch, as the module docstring says)."""
    case = request.param
    with case.root(tmp_path) as root:
        store = open_store(str(root), backend=LocalBackend)
        datas = [bytes([n % 251]) * size for n, size in enumerate(SIZES)]
        result = _put_first(store, datas, tmp_path / "source" if case.adopted else None)
        assert result.ok and result.pages_written == len(datas), result
        try:
            pages = store.entry(result.entry_id).manifest.pages
            backend = case.backend(request, store)
            if backend is not store.objects:
                receipt = _put_through(backend, store, [NewObject(ref, store.objects.get(ref)) for ref in pages])
                assert receipt.written == {r.digest for r in pages}, receipt
            raw = request.getfixturevalue("seaweedfs").raw_store() if not case.local else None
            yield Subject(case, store, backend, {NewObject.of(d).ref.digest: d for d in datas}, pages, raw)
        finally:
            store.close()


def _put_first(store, datas: list[bytes], source_root: Path | None):
    """``datas`` published into ``store``; with ``source_root``, published there first and then
    adopted into ``store`` past the page cache, as a fetch from the shared tier puts them."""
    if source_root is None:
        return store.publish(IDENT, conv_keys(1, 4 * len(datas)), datas)
    source = open_store(str(source_root), backend=LocalBackend)
    try:
        first = source.publish(IDENT, conv_keys(1, 4 * len(datas)), datas)
        assert first.ok, first
        return store.adopt(source.manifest_bytes(first.entry_id)[1], datas, cached=False)
    finally:
        source.close()


def _put_through(backend, store, objects: list[NewObject]):
    """One put batch of ``objects`` straight to the backend (past publication's check)."""
    with Staging(store.layout) as staging:
        batch = backend.put_batch(staging)
        try:
            for obj in objects:
                batch.add(obj)
            return batch.flush()
        finally:
            batch.close()


def _publish_again(subject: Subject, datas: list[bytes], conv: int):
    """``datas`` put again the way this backend's objects are put: a publication into the
    store (local), or a put batch of them (S3, until the tier publishes there). The receipt's
    counts: (written, present)."""
    if subject.case.local:
        again = subject.store.publish(IDENT, conv_keys(conv, 4 * len(datas)), datas)
        assert again.ok, again
        return again.pages_written, again.pages_reused
    receipt = _put_through(subject.backend, subject.store, [NewObject.of(d) for d in datas])
    return len(receipt.written), len(receipt.present)


def test_a_put_leaves_exactly_the_object(subject):
    assert os.listdir(subject.store.layout.staging_dir) == []  # every temp file was renamed into place
    held = subject.backend.exists(list(subject.put))
    assert {d: s.size for d, s in held.items()} == {d: len(v) for d, v in subject.put.items()}
    assert all(held[d].stored_bytes >= len(v) for d, v in subject.put.items())
    assert [r.digest for r in subject.pages] == list(subject.put)  # the manifest names them in order


@pytest.mark.parametrize("subject", [c for c in BACKENDS if c.name == "local-adopted"], ids=["local-adopted"],
                         indirect=True)
def test_objects_put_past_the_page_cache_take_none_of_it(subject):
    """The working filesystem (ext4 or xfs under the tests' tmp) takes O_DIRECT: an adopted
    entry's objects are on the disk and none of their pages in memory (a cached put leaves them
    all there: the case ``local``)."""
    for ref in subject.pages:
        path = subject.backend.path(ref.digest)
        assert resident_pages(path)[0] == 0, (path, resident_pages(path))
        assert os.path.getsize(path) == ref.size


def test_every_read_returns_the_bytes_that_were_put(subject):
    backend = subject.backend
    for ref in subject.pages:
        assert backend.get(ref) == subject.put[ref.digest]
        assert backend.get(PageRef(ref.digest, ref.size)) == subject.put[ref.digest]  # by its BLAKE3 name
        with pytest.raises(ObjectError) as caught:
            backend.get(PageRef(ref.digest, ref.size, "0" * 32))  # a manifest that records other bytes
        assert caught.value.reason is Reason.CORRUPT and ref.digest in str(caught.value)


@pytest.mark.parametrize(**_cases(LOCAL))
def test_the_local_doors_read_the_bytes_that_were_put(subject):
    backend, refs = subject.backend, subject.pages
    for ref in refs:
        backend.check_present(ref.digest, ref.size)
        assert backend.check_verified(ref.digest, ref.size) == ref.checksum
        view = bytearray(ref.size)
        backend.read_verified_into(ref, [memoryview(view)])
        assert view == subject.put[ref.digest]
    for parallel in (True, False):
        got = backend.read_many_verified(refs, parallel=parallel)
        assert [bytes(g) for g in got] == [subject.put[r.digest] for r in refs]


def test_a_second_put_of_an_object_is_a_no_op(subject):
    backend, store = subject.backend, subject.store
    before = {d: s for d, s in backend.exists(list(subject.put)).items()}
    marks = {d: subject.case.mark(subject, d) for d in subject.put}
    assert _publish_again(subject, list(subject.put.values()), 2) == (0, len(SIZES))
    receipt = _put_through(backend, store, [NewObject.of(d) for d in subject.put.values()])
    assert receipt.written == frozenset() and receipt.present == frozenset(subject.put)
    assert receipt.bytes_written == 0
    assert backend.exists(list(subject.put)) == before
    assert {d: subject.case.mark(subject, d) for d in subject.put} == marks  # never rewritten
    assert os.listdir(store.layout.staging_dir) == []


def test_the_first_writer_wins(subject):
    """Two publications put the same new object; the one that flushes first places it, the
    other finds it there and leaves it."""
    backend, store = subject.backend, subject.store
    new = NewObject.of(b"both write this" * 1000)
    with Staging(store.layout) as first, Staging(store.layout) as second:
        batches = [backend.put_batch(first), backend.put_batch(second)]
        for batch in batches:
            batch.add(new)
        assert new.ref.digest not in backend.exists([new.ref.digest])  # nothing visible before a flush
        won = batches[0].flush()
        mark = subject.case.mark(subject, new.ref.digest)
        lost = batches[1].flush()
    assert won.written == {new.ref.digest} and won.bytes_written == new.ref.size
    assert lost.written == frozenset() and lost.present == {new.ref.digest}
    assert backend.get(new.ref) == new.data
    assert subject.case.mark(subject, new.ref.digest) == mark
    assert os.listdir(store.layout.staging_dir) == []  # the loser's temp file went with its staging


def test_a_batch_exists_names_exactly_what_is_there(subject):
    backend = subject.backend
    absent = NewObject.of(b"never put").ref.digest
    asked = [*subject.put, absent]
    held = backend.exists(asked)
    assert set(held) == set(subject.put) and all(held[d].digest == d for d in held)
    assert backend.exists([]) == {}
    with pytest.raises(UnsafePathError, match="not a 64-hex-char"):
        backend.exists(["../../etc/passwd"])


def test_a_listing_names_what_is_there(subject):
    backend = subject.backend
    assert {s.digest for s in backend.list()} == set(subject.put)
    for digest, data in subject.put.items():
        for prefix in (digest[:1], digest[:2], digest[:5], digest):
            listed = {s.digest: s for s in backend.list(prefix)}
            assert digest in listed and all(d.startswith(prefix) for d in listed)
            assert listed[digest].size == len(data) and listed[digest].stored_bytes >= len(data)
    assert backend.list("f" * 64 if "f" * 64 not in subject.put else "0" * 64) == []
    with pytest.raises(UnsafePathError, match="prefix"):
        backend.list("AB/")


def test_a_deletion_reports_what_it_freed_once(subject):
    backend = subject.backend
    digest, data = next(iter(subject.put.items()))
    assert backend.delete(digest) >= len(data)
    assert backend.delete(digest) == 0  # deleting twice is no error
    with pytest.raises(ObjectError) as caught:
        backend.get(PageRef(digest, len(data)))
    assert caught.value.reason is Reason.ABSENT and digest in str(caught.value)
    assert digest not in backend.exists([digest])
    assert digest not in {s.digest for s in backend.list()}
    assert backend.delete(NewObject.of(b"never put").ref.digest) == 0


@pytest.mark.parametrize("subject, how, reason", _damaged(BACKENDS), indirect=["subject"])
def test_damage_is_refused_by_every_read(subject, how, reason):
    backend = subject.backend
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    ref = next(r for r in subject.pages if r.digest == digest)
    subject.case.damage(subject, digest, how, len(data))
    reads = [lambda: backend.get(ref), lambda: backend.get(PageRef(digest, len(data)))]
    if subject.case.local:
        reads += [lambda: backend.check_verified(digest, len(data)),
                  lambda: backend.read_many_verified([ref], parallel=False),
                  lambda: backend.read_verified_into(ref, [memoryview(bytearray(len(data)))])]
    for read in reads:
        with pytest.raises(ObjectError) as caught:
            read()
        assert caught.value.reason is reason and caught.value.digest == digest
        assert digest in str(caught.value)
    for other, value in subject.put.items():  # the neighbours are untouched
        if other != digest:
            assert backend.get(PageRef(other, len(value))) == value


@pytest.mark.parametrize("subject, how, reason", _damaged(LOCAL), indirect=["subject"])
def test_only_corruption_is_discarded(subject, how, reason):
    backend = subject.backend
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    subject.case.damage(subject, digest, how, len(data))
    assert backend.discard_corrupt(digest, len(data)) is (reason is Reason.CORRUPT)
    assert os.path.lexists(backend.path(digest)) is (reason is not Reason.CORRUPT)
    for other, value in subject.put.items():
        if other != digest:
            assert backend.discard_corrupt(other, len(value)) is False


@pytest.mark.parametrize("subject, how, reason", _damaged(BACKENDS, ("truncated", "grown", "symlink")),
                         indirect=["subject"])
def test_a_put_replaces_an_object_of_another_size_or_kind(subject, how, reason):
    """What is at an object's name but not of its size (or not a file) is not the object: a
    publication of its bytes puts it anew. (One of the right size with other bytes is taken
    as present, unread: a restore that meets it removes it, ``test_only_corruption_is_discarded``.)"""
    backend = subject.backend
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    subject.case.damage(subject, digest, how, len(data))
    assert _publish_again(subject, [data], 3) == (1, 0)
    assert backend.get(PageRef(digest, len(data))) == data
