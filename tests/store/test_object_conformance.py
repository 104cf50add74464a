"""The object backend's conformance suite: every backend in ``BACKENDS``, its objects put by
the store's own publication path (``PageStore.publish`` -> ``PublicationWriter`` -> the
backend's put batch).

The contract every backend gives the page objects (restic's backend tests are the model): a
put is durable and leaves exactly the object; a put of an object already there is a no-op
(the first writer wins, nothing is rewritten); every get returns the bytes that were put or
raises with the reason, naming the object; a batch ``exists`` and a listing by prefix name
what is there; a deletion reports what it freed, and deleting twice is no error; damage (a
flipped byte, a truncation, a file grown, a link) is refused by every read. A backend with
the local filesystem's own doors (``local``) is held to them too: its reads into buffers and
its re-hash refuse the same damage, and only what is corrupt is discarded.

Adding a backend is one line in ``BACKENDS``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import pytest

from hostile_helpers import small_tmpfs
from sparkcache.store import PageRef, Reason
from sparkcache.store.backend import NewObject, ObjectError
from sparkcache.store.layout import UnsafePathError
from sparkcache.store.objects import LocalBackend
from sparkcache.store.staging import Staging
from store_helpers import IDENT, conv_keys, open_store

pytestmark = [pytest.mark.root]  # the tmpfs is a real mount


def _damage_file(backend: LocalBackend, digest: str, how: str, size: int) -> None:
    path = backend.path(digest)
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


@contextlib.contextmanager
def _working_fs(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


@contextlib.contextmanager
def _tmpfs(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "mnt", size="64m") as mnt:
        yield Path(mnt) / "store"


@dataclass(frozen=True)
class BackendCase:
    """One backend under the suite: where its store's root goes, how the backend is made from
    the store's layout, how an object of it is damaged (each of ``DAMAGE``), and whether it
    has the local filesystem's doors."""

    name: str
    root: Callable[[Path], ContextManager[Path]]
    backend: Callable = LocalBackend
    damage: Callable[[object, str, str, int], None] = _damage_file
    local: bool = True


BACKENDS = [
    BackendCase("local", _working_fs),
    BackendCase("local-tmpfs", _tmpfs),
]
DAMAGE = [("flipped byte", Reason.CORRUPT), ("truncated", Reason.ABSENT), ("grown", Reason.CORRUPT),
          ("symlink", Reason.CORRUPT)]
SIZES = (1, 4096, (1 << 20) + 3)  # a byte, a page of the filesystem, more than a MiB and not aligned


@dataclass(frozen=True)
class Subject:
    case: BackendCase
    store: object  # the PageStore that put the objects
    backend: object
    put: dict  # digest -> the bytes published under it
    pages: tuple[PageRef, ...]  # as the published manifest records them


@pytest.fixture(params=BACKENDS, ids=[case.name for case in BACKENDS])
def subject(request, tmp_path: Path):
    """A fresh store on one backend, with three objects published into it."""
    case = request.param
    with case.root(tmp_path) as root:
        store = open_store(str(root), backend=case.backend)
        datas = [bytes([n % 251]) * size for n, size in enumerate(SIZES)]
        result = store.publish(IDENT, conv_keys(1, 4 * len(datas)), datas)
        assert result.ok and result.pages_written == len(datas), result
        try:
            pages = store.entry(result.entry_id).manifest.pages
            yield Subject(case, store, store.objects, {NewObject.of(d).ref.digest: d for d in datas}, pages)
        finally:
            store.close()


def _local(subject: Subject) -> None:
    if not subject.case.local:
        pytest.skip(f"{subject.case.name} has no local filesystem doors")


def test_a_put_leaves_exactly_the_object(subject):
    assert os.listdir(subject.store.layout.staging_dir) == []  # every temp file was renamed into place
    held = subject.backend.exists(list(subject.put))
    assert {d: s.size for d, s in held.items()} == {d: len(v) for d, v in subject.put.items()}
    assert all(held[d].stored_bytes >= len(v) for d, v in subject.put.items())
    assert [r.digest for r in subject.pages] == list(subject.put)  # the manifest names them in order


def test_every_read_returns_the_bytes_that_were_put(subject):
    backend = subject.backend
    for ref in subject.pages:
        assert backend.get(ref) == subject.put[ref.digest]
        assert backend.get(PageRef(ref.digest, ref.size)) == subject.put[ref.digest]  # by its BLAKE3 name
        with pytest.raises(ObjectError) as caught:
            backend.get(PageRef(ref.digest, ref.size, "0" * 32))  # a manifest that records other bytes
        assert caught.value.reason is Reason.CORRUPT and ref.digest in str(caught.value)


def test_the_local_doors_read_the_bytes_that_were_put(subject):
    _local(subject)
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
    marks = {d: os.stat(backend.path(d)).st_ino for d in subject.put} if subject.case.local else {}
    again = store.publish(IDENT, conv_keys(2, 4 * len(SIZES)), list(subject.put.values()))
    assert again.ok and again.pages_written == 0 and again.pages_reused == len(SIZES), again
    with Staging(store.layout) as staging:  # a put straight to the backend, past publication's check
        batch = backend.put_batch(staging)
        for data in subject.put.values():
            batch.add(NewObject.of(data))
        receipt = batch.flush()
    assert receipt.written == frozenset() and receipt.present == frozenset(subject.put)
    assert receipt.bytes_written == 0
    assert backend.exists(list(subject.put)) == before
    if subject.case.local:
        assert {d: os.stat(backend.path(d)).st_ino for d in subject.put} == marks  # never rewritten
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
        won, lost = (batch.flush() for batch in batches)
        mark = os.stat(backend.path(new.ref.digest)).st_ino if subject.case.local else None
    assert won.written == {new.ref.digest} and won.bytes_written == new.ref.size
    assert lost.written == frozenset() and lost.present == {new.ref.digest}
    assert backend.get(new.ref) == new.data
    if subject.case.local:
        assert os.stat(backend.path(new.ref.digest)).st_ino == mark
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


@pytest.mark.parametrize("how, reason", DAMAGE)
def test_damage_is_refused_by_every_read(subject, how, reason):
    backend = subject.backend
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    ref = next(r for r in subject.pages if r.digest == digest)
    subject.case.damage(backend, digest, how, len(data))
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


@pytest.mark.parametrize("how, reason", DAMAGE)
def test_only_corruption_is_discarded(subject, how, reason):
    _local(subject)
    backend = subject.backend
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    subject.case.damage(backend, digest, how, len(data))
    assert backend.discard_corrupt(digest, len(data)) is (reason is Reason.CORRUPT)
    assert os.path.lexists(backend.path(digest)) is (reason is not Reason.CORRUPT)
    for other, value in subject.put.items():
        if other != digest:
            assert backend.discard_corrupt(other, len(value)) is False


@pytest.mark.parametrize("how", ["truncated", "grown", "symlink"])
def test_a_put_replaces_an_object_of_another_size_or_kind(subject, how):
    """What is at an object's name but not of its size (or not a file) is not the object: a
    publication of its bytes puts it anew. (One of the right size with other bytes is taken
    as present, unread: a restore that meets it removes it, ``test_only_corruption_is_discarded``.)"""
    backend, store = subject.backend, subject.store
    digest, data = max(subject.put.items(), key=lambda item: len(item[1]))
    subject.case.damage(backend, digest, how, len(data))
    again = store.publish(IDENT, conv_keys(3, 4), [data])
    assert again.ok and again.pages_written == 1, again
    assert backend.get(PageRef(digest, len(data))) == data
