"""Content-addressed page objects: ``objects/ab/cdef...`` named by the BLAKE3 (256-bit) hash
of their bytes.

Reads are always verified: the bytes are re-hashed and compared with the name. BLAKE3 is a
cryptographic hash like sha256 but several times faster per core (docs/RESULTS.md,
"Measurements behind the code"); verifying every restored byte is what a restore pays over an
unverified one. A missing
object or one shorter than its recorded size is ``absent``; wrong bytes, a wrong size, a
symlink or a non-regular file is ``corrupt``. Neither ever returns bytes.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from collections import deque
from typing import Callable, Sequence

import blake3
import xxhash

from .manifests import PageRef
from .reasons import Reason
from .layout import (StoreLayout, UnsafePathError, close_quietly, occupied, open_regular_at, parallel_map,
                     per_cpu_map, pool_cpus, start_writeback, sync_all, write_all)


class ObjectError(Exception):
    """A page object failed verification. ``reason`` is ``absent``, ``corrupt`` or
    ``io_error`` (it could not be read: EIO, EACCES)."""

    def __init__(self, reason: Reason, digest: str, detail: str) -> None:
        super().__init__(f"object {digest}: {reason}: {detail}")
        self.reason = Reason(reason)
        self.digest = digest
        self.detail = detail


def digest_of(data: bytes | memoryview) -> str:
    """The object name for ``data``: its BLAKE3 hash, 64 lower-case hex characters."""
    return blake3.blake3(data).hexdigest()


def checksum_of(data: bytes | memoryview) -> str:
    """What a restore checks ``data`` against: its XXH3-128, 32 lower-case hex characters."""
    return xxhash.xxh3_128_hexdigest(data)


def name_and_checksum(data: bytes | memoryview) -> tuple[str, str]:
    """``(digest_of(data), checksum_of(data))``: what a publication records for an object."""
    return digest_of(data), checksum_of(data)


_HASH_CHUNK = 8 << 20  # check_verified reads and hashes this much at a time


class ObjectStore:
    def __init__(self, layout: StoreLayout, alloc_unit: int = 4096) -> None:
        self.layout = layout
        self.alloc_unit = alloc_unit

    def path(self, digest: str) -> str:
        return self.layout.object_path(digest)

    def check_present(self, digest: str, size: int) -> None:
        """Cheap check (no read): exists, regular, not a symlink, recorded size."""
        try:
            st = self.layout.lstat(self.path(digest))
        except UnsafePathError as exc:
            raise ObjectError(Reason.CORRUPT, digest, str(exc)) from None
        except FileNotFoundError:
            raise ObjectError(Reason.ABSENT, digest, "missing") from None
        except OSError as exc:
            raise ObjectError(Reason.IO_ERROR, digest, str(exc)) from None
        _check_stat(digest, st, size)

    def read_verified(self, digest: str, size: int, checksum: str | None = None) -> bytearray:
        """The object's bytes, checked against ``checksum`` (its XXH3-128, as its manifest
        records it) or, without one, re-hashed against its BLAKE3 name; raises ``ObjectError``
        rather than return bad bytes.
        Read with system calls into one buffer (no mapping: an I/O error or a file truncated
        under the reader is an ``ObjectError``, never a SIGBUS, and no descriptor outlives
        the call)."""
        data = bytearray(size)
        self.read_verified_into(PageRef(digest, size, checksum), [memoryview(data)])
        return data

    def read_verified_into(self, ref: PageRef, views: Sequence[memoryview]) -> None:
        """Read the object ``ref`` names into ``views`` (writable byte buffers whose sizes add
        up to ``ref.size``), in order, with as few ``preadv`` calls as the system's iovec
        limit allows, then check those bytes as ``read_verified`` does. On an ``ObjectError``
        the views may hold unverified bytes: the caller must not use them (a restore reports
        its blocks to vLLM as not loaded)."""
        if sum(v.nbytes for v in views) != ref.size:
            raise ValueError(f"views of {sum(v.nbytes for v in views)} bytes for an object of {ref.size}")
        hasher = blake3.blake3() if ref.checksum is None else xxhash.xxh3_128()
        fd = self._open_checked(ref.digest, ref.size)
        try:
            _read_exactly_into(fd, ref.digest, ref.size, views, hasher.update)
        finally:
            close_quietly(fd)
        if ref.checksum is None and hasher.hexdigest() != ref.digest:
            raise ObjectError(Reason.CORRUPT, ref.digest, "bytes do not match their BLAKE3 name")
        _check_checksum(ref, hasher.hexdigest())

    def read_many_verified_into(self, refs: list, views_of: Callable[[int], Sequence[memoryview]]) -> None:
        """``read_verified_into(refs[i], views_of(i))`` for every page: one run of consecutive
        pages per CPU, each on a thread held to its CPU (``per_cpu_map``). Reads and hashing
        release the GIL, so each core reads pages of its own and hashes each read while it is
        still in its cache (one thread per CPU: more would evict each other's reads before
        they are hashed; docs/RESULTS.md). Once every run has ended, raises the error of the
        first page in ``refs`` order that had one."""
        readers = max(1, min(len(refs), len(pool_cpus("io"))))
        runs = [range(len(refs) * k // readers, len(refs) * (k + 1) // readers) for k in range(readers)]

        present = threading.Barrier(readers)

        def read_run(run: range) -> None:
            try:
                for i in run:
                    self.check_present(refs[i].digest, refs[i].size)
            except BaseException:
                present.abort()  # whatever it is, the other runs stop before they write anything
                raise
            try:
                present.wait()
            except threading.BrokenBarrierError:
                return  # another run found an object gone: its error is raised
            for i in run:
                self.read_verified_into(refs[i], views_of(i))

        _each_in_parallel(read_run, runs, mapper=per_cpu_map)

    def start_readers(self) -> None:
        """Start the threads ``read_many_verified_into`` reads on (one per CPU) now, so the
        first restore does not pay for their start."""
        per_cpu_map(int, [0] * len(pool_cpus("io")))

    def check_verified(self, digest: str, size: int, shard_fd: int | None = None) -> str:
        """``read_verified`` without keeping the bytes: hashed (BLAKE3, against the name) a
        chunk at a time, so a page of any recorded size (a sparse file of 64 GiB included)
        costs bounded memory. Returns the bytes' XXH3-128, for the caller to compare with what
        manifests record. ``shard_fd``: its shard directory, open (a sweep of many objects)."""
        fd = self._open_checked(digest, size, shard_fd)
        try:
            hasher, checksum, got = blake3.blake3(), xxhash.xxh3_128(), 0
            while got < size:
                try:
                    chunk = os.read(fd, min(_HASH_CHUNK, size - got))
                except OSError as exc:
                    raise ObjectError(Reason.IO_ERROR, digest, f"read failed at {got}/{size}: {exc}") from None
                if not chunk:
                    raise ObjectError(Reason.ABSENT, digest, f"truncated while reading at {got}/{size}")
                hasher.update(chunk)
                checksum.update(chunk)
                got += len(chunk)
        finally:
            close_quietly(fd)
        if hasher.hexdigest() != digest:
            raise ObjectError(Reason.CORRUPT, digest, "bytes do not match their BLAKE3 name")
        return checksum.hexdigest()

    def check_ref(self, ref: PageRef) -> None:
        """``check_verified`` of the object ``ref`` names, and its bytes against the XXH3-128
        ``ref`` records (when it records one): what a restore of it would find."""
        _check_checksum(ref, self.check_verified(ref.digest, ref.size))

    def _open_checked(self, digest: str, size: int, shard_fd: int | None = None) -> int:
        """An fd of the object, opened without following links, with its size checked."""
        try:
            if shard_fd is None:
                fd = self.layout.open_file(self.path(digest), os.O_RDONLY)
            else:
                fd = open_regular_at(shard_fd, digest[2:], self.path(digest), os.O_RDONLY)
        except UnsafePathError as exc:
            raise ObjectError(Reason.CORRUPT, digest, str(exc)) from None
        except FileNotFoundError:
            raise ObjectError(Reason.ABSENT, digest, "missing") from None
        except OSError as exc:
            raise ObjectError(Reason.IO_ERROR, digest, str(exc)) from None
        try:
            _check_stat(digest, os.fstat(fd), size)
        except ObjectError:
            close_quietly(fd)
            raise
        return fd

    def read_many_verified(self, refs: list, *, parallel: bool = True) -> list[bytearray]:
        """``read_verified`` for several pages (each checked against its ref's checksum), in
        parallel threads (reads and hashing release the GIL), or with ``parallel=False`` on the
        calling thread, one after the other (for a caller whose cores are busy anyway: see
        ``WorkerSide``). Raises the first ``ObjectError`` in page order."""
        return _each_in_parallel(lambda ref: self.read_verified(ref.digest, ref.size, ref.checksum), refs,
                                 parallel=parallel)

    def check_many_present(self, refs: list) -> None:
        """``check_present`` for several pages, in parallel threads when there are many (a
        cold ``lstat`` is a disk read), else on this thread: a warm ``lstat`` takes
        microseconds and a hand-off to the pool milliseconds when the cores are busy
        (docs/RESULTS.md, "Measurements behind the code"). Raises the first
        ``ObjectError`` in page order."""
        _each_in_parallel(lambda ref: self.check_present(ref.digest, ref.size), refs,
                          parallel=len(refs) > _SERIAL_CHECK_PAGES)

    def exists_with_size(self, digest: str, size: int) -> bool:
        """Whether a regular file of ``size`` bytes holds ``digest`` (not re-hashed). A link
        or wrong file kind there is ``UnsafePathError`` on a shard that is one, else False,
        and the publisher's rename replaces it."""
        try:
            st = self.layout.lstat(self.path(digest))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def write(self, digest: str, data: bytes | memoryview, tmp_path: str) -> str:
        """Write one object durably (temp, fdatasync, rename). Returns its shard directory,
        which the caller fsyncs."""
        return next(iter(self.write_many([(digest, data, tmp_path)])))

    def write_many(self, items: list[tuple[str, bytes | memoryview, str]]) -> set[str]:
        """Write several objects: all temp files first, then one parallel round of
        fdatasync (the journal commits them together), then the renames. Returns the shard
        directories to fsync. Temp files are left for the caller's staging to remove on error."""
        fds: list[int] = []
        try:
            for _, data, tmp_path in items:
                fd = self.layout.open_file(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                fds.append(fd)
                write_all(fd, data)
                start_writeback(fd)  # the disk works while we write the next object
            sync_all(os.fdatasync, fds)
        finally:
            for fd in fds:
                os.close(fd)
        return self.place([(digest, tmp_path) for digest, _, tmp_path in items])

    def place(self, synced: list[tuple[str, str]]) -> set[str]:
        """Rename durable temp files (``(digest, temp path)``) to their object paths, making
        shard directories as needed. Returns the shard directories, which the caller fsyncs."""
        shards: set[str] = set()
        for digest, tmp_path in synced:
            final = self.path(digest)
            self.layout.rename(tmp_path, final, create_dirs=True)
            shards.add(os.path.dirname(final))
        return shards

    def remove(self, digest: str) -> int:
        """Delete an object; returns the bytes it occupied (0 if it was already gone)."""
        path = self.path(digest)
        try:
            size = occupied(self.layout.lstat(path), self.alloc_unit)
            self.layout.unlink(path)
            return size
        except FileNotFoundError:
            return 0
        except (OSError, UnsafePathError):
            return 0  # a directory or an unsafe shard: left in place, verify reports it

    def discard_corrupt(self, digest: str, size: int) -> bool:
        """Remove an object that fails verification as ``corrupt`` (wrong bytes or size, a
        symlink), so the next publication of its bytes writes it anew instead of finding
        its name taken; True when removed. It is verified again first: one rewritten good
        meanwhile stays, and so does anything that is neither a file nor a link inside the
        root (``verify`` reports those)."""
        try:
            self.check_verified(digest, size)
            return False
        except ObjectError as exc:
            if exc.reason != Reason.CORRUPT:
                return False
        path = self.path(digest)
        try:
            mode = self.layout.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                return False
            return self.layout.unlink(path)  # a link itself, never what it points to
        except (UnsafePathError, OSError):
            return False

    def iter_shard(self, shard: str) -> list[tuple[str, int]]:
        """(digest, bytes occupied) of the regular files in one shard directory (``"ab"``)."""
        try:
            found = self.layout.scandir_files(os.path.join(self.layout.objects_dir, shard))
        except (OSError, UnsafePathError):
            return []  # a link or a file in place of the shard: verify reports it
        return [(shard + name, occupied(st, self.alloc_unit)) for name, st in found
                if stat.S_ISREG(st.st_mode)]


_SERIAL_CHECK_PAGES = 8  # check_many_present: up to this many pages on the calling thread


def _each_in_parallel(fn, items: list, *, parallel: bool = True, mapper=parallel_map) -> list:
    """``[fn(item) for item in items]`` through ``mapper`` on the io pool (or, without
    ``parallel``, on this thread). Every call ends before anything is raised (so no thread
    still writes into a caller's buffers after it has been told of a failure); then the
    first failure in ``items`` order is raised."""
    def call(item):
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001 - raised below, once every call has ended
            return exc

    results = mapper(call, items) if parallel else [call(item) for item in items]
    for item in results:
        if isinstance(item, Exception):
            raise item
    return results


_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024  # -1: no limit said
_READ_BATCH = 512 << 10  # bytes one preadv reads at most: hashed next, while still in the core's cache


def _read_exactly_into(fd: int, digest: str, size: int, views: Sequence[memoryview],
                       hash_update: Callable[[memoryview], object]) -> None:
    """``size`` bytes from the start of ``fd`` into ``views`` in order, each read handed to
    ``hash_update`` right after it (in byte order): a short file is ``absent``, a failing
    read ``io_error``."""
    todo = deque(v for v in views if v.nbytes)
    got = 0
    while todo:
        batch, room = [], _READ_BATCH
        for v in itertools.islice(todo, _IOV_MAX):
            batch.append(v[:room])
            room -= batch[-1].nbytes
            if room <= 0:
                break
        try:
            n = os.preadv(fd, batch, got)
        except (OSError, MemoryError) as exc:
            raise ObjectError(Reason.IO_ERROR, digest, f"read failed at {got}/{size}: {exc!r}") from None
        if n == 0:
            raise ObjectError(Reason.ABSENT, digest, f"truncated while reading at {got}/{size}")
        got += n
        while n:  # hash and drop what was filled; a view filled in part goes on from where it stopped
            head = todo[0]
            if n >= head.nbytes:
                hash_update(head)
                n -= head.nbytes
                todo.popleft()
            else:
                hash_update(head[:n])
                todo[0], n = head[n:], 0


def _check_checksum(ref: PageRef, actual: str) -> None:
    """``corrupt`` when ``ref`` records an XXH3-128 and ``actual`` is another."""
    if ref.checksum is not None and actual != ref.checksum:
        raise ObjectError(Reason.CORRUPT, ref.digest, "bytes do not match the XXH3-128 their manifest records")


def _check_stat(digest: str, st: os.stat_result, size: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ObjectError(Reason.CORRUPT, digest, "is a symlink; the store never follows symlinks")
    if not stat.S_ISREG(st.st_mode):
        raise ObjectError(Reason.CORRUPT, digest, "not a regular file")
    if st.st_size < size:
        raise ObjectError(Reason.ABSENT, digest, f"truncated: {st.st_size} of {size} bytes present")
    if st.st_size > size:
        raise ObjectError(Reason.CORRUPT, digest, f"{st.st_size} bytes, manifest records {size}")
