"""``direct_writes``: files written past the page cache (what a fetch from the shared tier puts
locally) hold exactly their bytes, whatever their length against the 4 KiB unit and the 1 MiB
write size, one buffer after a larger object, several files at once; a filesystem that refuses
O_DIRECT gets the bytes the usual way, on the same descriptor."""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.page_cache import resident_pages
from faultfs import FaultFS
from sparkcache.store import PageStore
from sparkcache.store.direct_writes import DIRECT_ALIGN, AlignedCopy, DirectWrites
from sparkcache.store.layout import WRITE_CHUNK
from store_helpers import IDENT, conv_keys, open_store

_EDGES = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + 1, WRITE_CHUNK - 1, WRITE_CHUNK, WRITE_CHUNK + 1,
          2 * WRITE_CHUNK + DIRECT_ALIGN + 7]
_OBJECT_TEMP = r"/staging/[0-9a-f]+-[0-9a-f]{64}\.tmp$"  # an object's temp file (not the intent, not the manifest)
_SIZES = st.one_of(st.sampled_from(_EDGES), st.integers(0, 3 * WRITE_CHUNK))


def _new(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _bytes(size: int, seed: int) -> bytes:
    return (bytes((seed + j) % 251 for j in range(4096)) * (size // 4096 + 1))[:size]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(_SIZES, min_size=1, max_size=4), seed=st.integers(0, 255))
def test_every_file_holds_exactly_its_bytes_and_none_of_them_in_the_page_cache(tmp_path_factory, sizes, seed):
    where = tmp_path_factory.mktemp("direct")
    copy = AlignedCopy()  # one buffer for all: a shorter object after a longer one gets none of its bytes
    try:
        for i, size in enumerate(sizes):
            data = _bytes(size, seed + i)
            fd = _new(where / str(i))
            try:
                copy.load(bytearray(data))
                assert copy.write_to(fd), "the tests' working filesystem (ext4) takes O_DIRECT"
                assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # the descriptor as it was
                os.fdatasync(fd)
            finally:
                os.close(fd)
            assert resident_pages(str(where / str(i)))[0] == 0
            assert (where / str(i)).read_bytes() == data
    finally:
        copy.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(_SIZES, min_size=1, max_size=9), depth=st.integers(1, 4))
def test_files_written_several_at_once_each_hold_their_own_bytes(tmp_path_factory, sizes, depth):
    """More files than buffers: a buffer is reused only once its write is done, and each
    caller's buffer may be overwritten as soon as ``start`` returns."""
    where = tmp_path_factory.mktemp("many")
    writes, fds, scratch = DirectWrites(depth), [], bytearray()
    try:
        for i, size in enumerate(sizes):
            scratch[:] = _bytes(size, i)
            fds.append(_new(where / str(i)))
            writes.start(fds[-1], scratch)
            scratch[:] = b"\xff" * size  # the caller's buffer changes at once
        writes.wait()
    finally:
        writes.close()
        for fd in fds:
            os.close(fd)
    assert not writes.refused
    for i, size in enumerate(sizes):
        assert (where / str(i)).read_bytes() == _bytes(size, i)


def test_a_filesystem_that_refuses_a_direct_write_gets_the_bytes_the_usual_way(tmp_path):
    """A real FUSE filesystem (tests/faultfs.py) answering the first write EINVAL, as one
    without O_DIRECT does after the kernel took the flag (a kernel that refuses the flag
    itself is answered the same way, one step earlier)."""
    with FaultFS(tmp_path / "fs") as fs:
        path = fs.mount / "object"
        fs.fail("write", r"/object$", errno.EINVAL, times=1)
        fd = _new(path)
        copy = AlignedCopy()
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            copy.load(b"x" * 5000)
            assert not copy.write_to(fd)
            assert fs.fired() == 1  # the kernel took the flag; the filesystem refused the write
            assert fcntl.fcntl(fd, fcntl.F_GETFL) == flags
        finally:
            copy.close()
            os.close(fd)
        assert path.read_bytes() == b"x" * 5000
        writes = DirectWrites()
        fs.fail("write", r"/second$", errno.EINVAL, times=1)
        fd = _new(fs.mount / "second")
        try:
            writes.start(fd, b"y" * 9000)
            writes.wait()
            assert writes.refused  # a put batch writes its next objects the usual way
        finally:
            writes.close()
            os.close(fd)
        assert (fs.mount / "second").read_bytes() == b"y" * 9000


def test_an_error_writing_one_file_is_raised_once_every_write_is_done(tmp_path):
    with FaultFS(tmp_path / "fs") as fs:
        fs.fail("write", r"/b$", errno.EIO, times=99)
        writes = DirectWrites(2)
        fds = [_new(fs.mount / name) for name in "abc"]
        try:
            for fd in fds:
                writes.start(fd, b"z" * 10000)
            try:
                writes.wait()
                raise AssertionError("the failed write was not raised")
            except OSError as exc:
                assert exc.errno == errno.EIO
            assert not writes._busy  # nothing still runs on a descriptor the caller will close
        finally:
            writes.close()
            for fd in fds:
                os.close(fd)
        assert (fs.mount / "a").read_bytes() == b"z" * 10000
        assert (fs.mount / "c").read_bytes() == b"z" * 10000


def test_a_usual_write_that_fails_after_a_refusal_raises_its_own_error(tmp_path):
    """Refused O_DIRECT, then the usual write fails too (EIO): that error comes out of ``wait``
    (no ``BufferError`` from a buffer a traceback still views), and ``close`` frees the rest."""
    with FaultFS(tmp_path / "fs") as fs:
        fs.fail("write", r"/object$", errno.EINVAL, times=1)
        fs.fail("write", r"/object$", errno.EIO, times=-1)
        writes = DirectWrites(2)
        fd = _new(fs.mount / "object")
        try:
            writes.start(fd, b"w" * 70000)
            try:
                writes.wait()
                raise AssertionError("the failed write was not raised")
            except OSError as exc:
                assert exc.errno == errno.EIO, exc
            writes.close()
        finally:
            os.close(fd)
        assert fs.fired() >= 2


def test_an_entry_adopted_on_a_filesystem_that_refuses_o_direct_is_written_the_usual_way(tmp_path):
    """The put batch's side of a refusal: the first object's direct write is refused (EINVAL
    from a real FUSE filesystem), the batch writes that one and every later one the usual way,
    and the adopted entry reads back whole and verifies."""
    source = open_store(str(tmp_path / "source"))
    datas = [os.urandom(size) for size in (5000, 1 << 20, 3 * DIRECT_ALIGN + 1)]
    try:
        first = source.publish(IDENT, conv_keys(1, 4 * len(datas)), datas)
        assert first.ok, first
        manifest = source.manifest_bytes(first.entry_id)[1]
    finally:
        source.close()
    with FaultFS(tmp_path / "fs") as fs:
        store = open_store(str(fs.mount / "store"))
        try:
            fs.record(True)
            fs.fail("write", _OBJECT_TEMP, errno.EINVAL, times=1)
            result = store.adopt(manifest, datas, cached=False)
            assert result.ok and result.pages_written == len(datas), result.detail
            assert fs.fired() == 1
            staged_writes = [path for op, path in fs.take_log() if op == "write" and re.search(_OBJECT_TEMP, path)]
            assert len(set(staged_writes)) == len(datas)  # every object written, the refused one again too
            refs = list(store.entry(first.entry_id).manifest.objects)
            assert store.read_pages(refs) == datas
        finally:
            store.close()
        assert PageStore.verify_root(str(fs.mount / "store")).ok
