"""The local filesystem's object backend: ``objects/ab/cdef...``, each named by the BLAKE3
(256-bit) hash of its bytes (``backend.ObjectBackend``; its puts: ``local_puts.py``).

Reads are always verified: the bytes are re-hashed and compared with the name, or with the
XXH3-128 their manifest records. BLAKE3 is a cryptographic hash like sha256 but several times
faster per core (docs/RESULTS.md, "Measurements behind the code"); verifying every restored
byte is what a restore pays over an unverified one. A missing object or one shorter than its
recorded size is ``absent``; wrong bytes, a wrong size, a symlink or a non-regular file is
``corrupt``. Neither ever returns bytes.

Besides the interface, the local backend has doors of its own: the restore's hot path
(``read_verified_into`` and ``read_many_verified_into``: ``preadv`` straight into the
caller's buffers, hashed as they land, one reader per CPU), a check that re-hashes without
keeping the bytes (``check_verified``), the removal of a corrupt object (``discard_corrupt``)
and what ``verify`` walks (``check_all``, ``survey``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import blake3
import xxhash

from .backend import (ObjectError, ObjectStat, TempFiles, check_checksum, check_hash, checksum_of,
                      digest_of, hasher_for, name_and_checksum)
from .layout import (StoreLayout, UnsafePathError, check_object_prefix, close_quietly, file_kind,
                     is_object_digest, occupied, open_regular_at, open_subdir_at, parallel_map, per_cpu_map,
                     reader_cpus)
from .local_puts import LocalPutBatch
from .manifests import PageRef
from .reasons import Reason

_HASH_CHUNK = 8 << 20  # check_verified reads and hashes this much at a time


class LocalBackend:
    """The object backend on the store's own filesystem (``backend.ObjectBackend``), with the
    local doors the module docstring lists."""

    def __init__(self, layout: StoreLayout, alloc_unit: int = 4096) -> None:
        self.layout = layout
        self.alloc_unit = alloc_unit

    def path(self, digest: str) -> str:
        return self.layout.object_path(digest)

    # ------------------------------------------------------------------ the interface

    def exists(self, digests: Iterable[str]) -> dict[str, ObjectStat]:
        """The regular files among ``digests``' objects (a link or another kind of file there
        is absent: a put replaces it), each shard opened once. A shard that is a link is
        ``UnsafePathError``; one that cannot be read, an ``OSError`` naming the object."""
        by_shard: dict[str, list[str]] = {}
        for digest in digests:
            self.path(digest)  # UnsafePathError for a name that is not a digest
            by_shard.setdefault(digest[:2], []).append(digest)
        found: dict[str, ObjectStat] = {}
        for shard, names in by_shard.items():
            with self._shard_dir(shard, names[0]) as fd:
                for digest in names if fd is not None else ():
                    try:
                        st = os.stat(digest[2:], dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        raise _unreadable(exc, digest, self.path(digest)) from None
                    if stat.S_ISREG(st.st_mode):
                        found[digest] = ObjectStat(digest, st.st_size, occupied(st, self.alloc_unit))
        return found

    def put_batch(self, temps: TempFiles, *, cached: bool = True) -> LocalPutBatch:
        """Puts through temp files named by ``temps`` (``local_puts.LocalPutBatch``); with
        ``cached=False`` written past the page cache (O_DIRECT) where the filesystem offers it."""
        return LocalPutBatch(self.layout, temps, direct=not cached)

    def get(self, ref: PageRef) -> bytearray:
        """The object's bytes, checked against ``ref.checksum`` (its XXH3-128, as its manifest
        records it) or, without one, re-hashed against its BLAKE3 name; raises ``ObjectError``
        rather than return bad bytes.
        Read with system calls into one buffer (no mapping: an I/O error or a file truncated
        under the reader is an ``ObjectError``, never a SIGBUS, and no descriptor outlives
        the call)."""
        data = bytearray(ref.size)
        self.read_verified_into(ref, [memoryview(data)])
        return data

    def list(self, prefix: str = "") -> list[ObjectStat]:
        """The objects (regular files named by a digest) whose names start with ``prefix``.
        A shard that cannot be listed (a link or a file in its place, EIO) lists as empty:
        ``verify`` reports it."""
        check_object_prefix(prefix)
        shards = [prefix[:2]] if len(prefix) >= 2 else [
            name for name in self._listing(self.layout.objects_dir) if name.startswith(prefix)]
        out = []
        for shard in shards:
            for name, st in self._files(shard):
                digest = shard + name
                if stat.S_ISREG(st.st_mode) and is_object_digest(digest) and digest.startswith(prefix):
                    out.append(ObjectStat(digest, st.st_size, occupied(st, self.alloc_unit)))
        return out

    def delete(self, digest: str) -> int:
        """Delete an object; returns the bytes it occupied (0 if it was already gone). A
        directory or a link on the way stays (``ObjectError``, ``corrupt``: verify reports
        it), as does one the filesystem refuses to remove (``io_error``)."""
        path = self.path(digest)
        try:
            size = occupied(self.layout.lstat(path), self.alloc_unit)
            return size if self.layout.unlink(path) else 0
        except FileNotFoundError:
            return 0
        except (UnsafePathError, IsADirectoryError) as exc:
            raise ObjectError(Reason.CORRUPT, digest, f"not a file the store can remove: {exc}", path) from None
        except OSError as exc:
            raise ObjectError(Reason.IO_ERROR, digest, f"cannot be removed: {exc}", path) from None

    # ------------------------------------------------------------------ the restore's reads

    def check_present(self, digest: str, size: int, objects_fd: int | None = None) -> None:
        """Cheap check (no read): exists, regular, not a symlink, recorded size. ``objects_fd``:
        ``objects/`` open (``_objects_dir``: several objects, one walk from the root)."""
        path = self.path(digest)
        try:
            if objects_fd is None:
                st = self.layout.lstat(path)
            else:
                with _shard_in(objects_fd, digest, path) as shard:
                    st = os.stat(digest[2:], dir_fd=shard, follow_symlinks=False)
        except (OSError, UnsafePathError) as exc:
            raise _not_looked_at(exc, digest, path) from None
        _check_stat(digest, st, size, path)

    def read_verified_into(self, ref: PageRef, views: Sequence[memoryview], objects_fd: int | None = None) -> None:
        """Read the object ``ref`` names into ``views`` (writable byte buffers whose sizes add
        up to ``ref.size``), in order, with as few ``preadv`` calls as the system's iovec
        limit allows, then check those bytes as ``get`` does. On an ``ObjectError``
        the views may hold unverified bytes: the caller must not use them (a restore reports
        its blocks to vLLM as not loaded). ``objects_fd``: as for ``check_present``."""
        if sum(v.nbytes for v in views) != ref.size:
            raise ValueError(f"views of {sum(v.nbytes for v in views)} bytes for an object of {ref.size}")
        hasher = hasher_for(ref)
        path = self.path(ref.digest)
        fd = self._open_checked(ref.digest, ref.size, path=path, objects_fd=objects_fd)
        try:
            _read_exactly_into(fd, ref, views, hasher.update, path)
        finally:
            close_quietly(fd)
        check_hash(ref, hasher.hexdigest(), path)

    def read_many_verified_into(self, refs: list, views_of: Callable[[int], Sequence[memoryview]]) -> None:
        """``read_verified_into(refs[i], views_of(i))`` for every page, on one reader per CPU of
        ``reader_cpus`` (none where the model's OpenMP threads spin but the caller's), each on a
        thread held to its CPU (``per_cpu_map``; the calling thread is one of them).
        Reads and hashing release the GIL, so each core reads pages of its own and hashes each
        read while it is still in its cache (one thread per CPU: more would evict each other's
        reads before they are hashed; docs/RESULTS.md). The readers take the pages one after
        another, whichever is free next (``_Claims``), not in fixed runs: a reader woken late,
        or sharing its CPU, holds up only the page it has. Every object is checked present
        (taken the same way) before any reader writes. Once every reader has ended, raises the
        error of the first page in ``refs`` order that had one. ``objects/`` is walked to once,
        each object found from there (``_objects_dir``)."""
        if not refs:
            return
        readers = max(1, min(len(refs), len(reader_cpus("io"))))
        checks, reads = _Claims(len(refs)), _Claims(len(refs))
        errors: dict[int, BaseException] = {}
        all_checked = threading.Event()   # every object present, or a check failed

        def stop(i: int, exc: BaseException) -> None:
            errors[i] = exc
            checks.stop()
            reads.stop()
            all_checked.set()  # the others stop waiting, and write nothing

        def reader(_: int) -> None:
            for i in checks:
                try:
                    self.check_present(refs[i].digest, refs[i].size, objects_fd)
                except BaseException as exc:  # noqa: BLE001 - whatever it is, raised below
                    stop(i, exc)
                    return
                if checks.done_one():
                    all_checked.set()
            all_checked.wait()
            for i in reads:
                try:
                    self.read_verified_into(refs[i], views_of(i), objects_fd)
                except BaseException as exc:  # noqa: BLE001 - raised below, once every reader has ended
                    stop(i, exc)
                    return

        with self._objects_dir(refs[0].digest) as objects_fd:
            per_cpu_map(reader, list(range(readers)))
        if errors:
            raise errors[min(errors)]

    def start_readers(self) -> None:
        """Start the threads ``read_many_verified_into`` reads on (one per ``reader_cpus``) now,
        so the first restore does not pay for their start."""
        per_cpu_map(int, [0] * len(reader_cpus("io")))

    def check_verified(self, digest: str, size: int, shard_fd: int | None = None) -> str:
        """``get`` without keeping the bytes: hashed (BLAKE3, against the name) a chunk at a
        time, so a page of any recorded size (a sparse file of 64 GiB included) costs bounded
        memory. Returns the bytes' XXH3-128, for the caller to compare with what manifests
        record. ``shard_fd``: its shard directory, open (a sweep of many objects)."""
        path = self.path(digest)
        fd = self._open_checked(digest, size, shard_fd, path=path)
        try:
            hasher, checksum, got = blake3.blake3(), xxhash.xxh3_128(), 0
            while got < size:
                try:
                    chunk = os.read(fd, min(_HASH_CHUNK, size - got))
                except OSError as exc:
                    raise ObjectError(Reason.IO_ERROR, digest, f"read failed at {got}/{size}: {exc}", path) from None
                if not chunk:
                    raise ObjectError(Reason.ABSENT, digest, f"truncated while reading at {got}/{size}", path)
                hasher.update(chunk)
                checksum.update(chunk)
                got += len(chunk)
        finally:
            close_quietly(fd)
        check_hash(PageRef(digest, size), hasher.hexdigest(), path)
        return checksum.hexdigest()

    def check_ref(self, ref: PageRef) -> None:
        """``check_verified`` of the object ``ref`` names, and its bytes against the XXH3-128
        ``ref`` records (when it records one): what a restore of it would find."""
        check_checksum(ref, self.check_verified(ref.digest, ref.size), self.path(ref.digest))

    def _open_checked(self, digest: str, size: int, shard_fd: int | None = None, *,
                      path: str | None = None, objects_fd: int | None = None) -> int:
        """An fd of the object (at ``path``, its path when known), opened without following
        links, with its size checked; found from its shard directory (``shard_fd``) or from
        ``objects/`` (``objects_fd``) when either is open, else from the root."""
        path = path or self.path(digest)
        try:
            if shard_fd is not None:
                fd = open_regular_at(shard_fd, digest[2:], path, os.O_RDONLY)
            elif objects_fd is not None:
                with _shard_in(objects_fd, digest, path) as shard:
                    fd = open_regular_at(shard, digest[2:], path, os.O_RDONLY)
            else:
                fd = self.layout.open_file(path, os.O_RDONLY)
        except (OSError, UnsafePathError) as exc:
            raise _not_looked_at(exc, digest, path) from None
        try:
            _check_stat(digest, os.fstat(fd), size, path)
        except ObjectError:
            close_quietly(fd)
            raise
        return fd

    def read_many_verified(self, refs: list, *, parallel: bool = True) -> list[bytearray]:
        """``get`` for several pages (each checked against its ref's checksum), in parallel
        threads (reads and hashing release the GIL), or with ``parallel=False`` on the
        calling thread, one after the other (for a caller whose cores are busy anyway: see
        ``WorkerSide``). Raises the first ``ObjectError`` in page order."""
        return _each_in_parallel(self.get, refs, parallel=parallel)

    def check_many_present(self, refs: list) -> None:
        """``check_present`` for several pages: on this thread while each check is quick (a
        warm ``lstat`` takes microseconds, a hand-off to the pool milliseconds when the cores
        are busy: docs/RESULTS.md, "Measurements behind the code"); from the first that took
        as long as a disk read (``_SLOW_CHECK_S``: the inodes are not in memory), the rest in
        parallel threads. Raises the first ``ObjectError`` in page order. ``objects/`` is
        walked to once (``_objects_dir``)."""
        if not refs:
            return
        with self._objects_dir(refs[0].digest) as objects_fd:
            def check(ref: PageRef) -> None:
                self.check_present(ref.digest, ref.size, objects_fd)

            for k, ref in enumerate(refs):
                started = time.monotonic()
                check(ref)
                if time.monotonic() - started > _SLOW_CHECK_S:
                    _each_in_parallel(check, refs[k + 1:])
                    return

    # ------------------------------------------------------------------ repair and verify

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

    def check_all(self, sizes: dict[str, int]) -> Iterator[tuple[str, str | ObjectError]]:
        """``check_verified`` of every object ``sizes`` names (digest -> recorded size), in
        digest order, each shard's directory opened once: (digest, the bytes' XXH3-128 or the
        ``ObjectError`` that refused them)."""
        for shard, digests in itertools.groupby(sorted(sizes), key=lambda d: d[:2]):
            digests = list(digests)
            try:
                with self._shard_dir(shard, digests[0]) as shard_fd:
                    for digest in digests:
                        try:
                            yield digest, self.check_verified(digest, sizes[digest], shard_fd)
                        except ObjectError as exc:
                            yield digest, exc
            except (OSError, UnsafePathError):  # each object then opened by its path says why
                for digest in digests:
                    try:
                        yield digest, self.check_verified(digest, sizes[digest])
                    except ObjectError as exc:
                        yield digest, exc

    def survey(self, referenced: set[str]) -> "Survey":
        """What lies under ``objects/`` besides the objects ``referenced``: how many regular
        files no entry references (orphans, which maintenance collects), and every path the
        store cannot use (a file where a shard belongs, a link or FIFO among the objects, a
        directory that cannot be listed), with what to do."""
        orphans, unsafe = 0, []
        shards, error = self._kinds(self.layout.objects_dir)
        if error:
            unsafe.append((self.layout.objects_dir, error))
        for shard, kind in shards:
            shard_path = os.path.join(self.layout.objects_dir, shard)
            if kind != "directory":
                unsafe.append((shard_path, f"a {kind} where a shard directory belongs; the store "
                               "never follows it: remove it"))
                continue
            files, error = self._kinds(shard_path)
            if error:
                unsafe.append((shard_path, error))
            for name, kind in files:
                if shard + name in referenced:
                    continue  # a referenced one that is not a regular file is reported as an object
                if kind != "file":
                    unsafe.append((os.path.join(shard_path, name), f"a {kind}, not a regular file; "
                                   "the store never follows links: remove it"))
                else:
                    orphans += 1
        return Survey(orphans, tuple(unsafe))

    # ------------------------------------------------------------------ directories

    @contextlib.contextmanager
    def _objects_dir(self, digest: str) -> Iterator[int]:
        """``objects/`` open, so that each of several objects is found from there (its shard,
        then itself: two opens without following links) rather than by a walk from the root
        (four). What stops the walk to it (nothing there, a link, an I/O error) is the
        ``ObjectError`` of ``digest``, the first object looked for."""
        try:
            handle = self.layout.open_dir(self.layout.objects_dir)
        except (OSError, UnsafePathError) as exc:
            raise _not_looked_at(exc, digest, self.path(digest)) from None
        with handle as d:
            yield d.fd

    @contextlib.contextmanager
    def _shard_dir(self, shard: str, digest: str) -> Iterator[int | None]:
        """The shard directory of ``digest`` open (one walk for all its objects), or None when
        it does not exist. A link in its place is ``UnsafePathError``; one that cannot be
        opened, an ``OSError`` naming ``digest``."""
        try:
            handle = self.layout.open_dir(os.path.join(self.layout.objects_dir, shard))
        except FileNotFoundError:
            yield None
            return
        except OSError as exc:
            raise _unreadable(exc, digest, self.path(digest)) from None
        with handle as d:
            yield d.fd

    def _listing(self, path: str) -> list[str]:
        """Names in a store directory; [] when it cannot be listed safely (verify reports it)."""
        try:
            return self.layout.listdir(path)
        except (OSError, UnsafePathError):
            return []

    def _files(self, shard: str) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of a shard's entries; [] when it cannot be listed safely."""
        try:
            return self.layout.scandir_files(os.path.join(self.layout.objects_dir, shard))
        except (OSError, UnsafePathError):
            return []

    def _kinds(self, path: str) -> tuple[list[tuple[str, str]], str]:
        """((name, kind) of a directory's entries, sorted; "") or ([], why) when it cannot be
        listed safely."""
        try:
            found = self.layout.scandir_files(path)
        except (OSError, UnsafePathError) as exc:
            return [], f"cannot be listed safely: {exc}"
        return sorted((name, file_kind(st.st_mode)) for name, st in found), ""


@dataclass(frozen=True)
class Survey:
    """``LocalBackend.survey``: orphan objects, and (path, what to do) for each path under
    ``objects/`` the store cannot use."""

    orphans: int
    unsafe: tuple[tuple[str, str], ...]


@contextlib.contextmanager
def _shard_in(objects_fd: int, digest: str, path: str) -> Iterator[int]:
    """The shard directory of ``digest`` (at ``path``), opened from ``objects/`` (open at
    ``objects_fd``) without following a link; closed after."""
    shard = open_subdir_at(objects_fd, digest[:2], path)
    try:
        yield shard
    finally:
        os.close(shard)


def _not_looked_at(exc: OSError | UnsafePathError, digest: str, path: str) -> ObjectError:
    """What a failure to look at or open an object means: a link or another kind of file on
    the way is ``corrupt``, nothing there ``absent``, anything else ``io_error``."""
    if isinstance(exc, UnsafePathError):
        return ObjectError(Reason.CORRUPT, digest, str(exc), path)
    if isinstance(exc, FileNotFoundError):
        return ObjectError(Reason.ABSENT, digest, "missing", path)
    return ObjectError(Reason.IO_ERROR, digest, str(exc), path)


def _unreadable(exc: OSError, digest: str, path: str) -> OSError:
    """``exc`` (its errno kept: what ``results.os_failure`` reads) with a message naming the
    object and where it is."""
    return type(exc)(exc.errno, f"object {digest} ({path}) cannot be looked at: {exc.strerror}; check "
                     "the disk and the store's permissions")


_SLOW_CHECK_S = 0.001  # check_many_present: a check this slow went to the disk; the rest in parallel


class _Claims:
    """Indices 0..n-1 handed out once each, in order, to whichever thread asks next, until
    ``stop``; ``done_one`` says whether the last of them has been done."""

    def __init__(self, n: int) -> None:
        self._n, self._next, self._done, self._stopped = n, 0, 0, False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[int]:
        while True:
            with self._lock:
                if self._stopped or self._next >= self._n:
                    return
                i, self._next = self._next, self._next + 1
            yield i

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def done_one(self) -> bool:
        with self._lock:
            self._done += 1
            return self._done == self._n


def _each_in_parallel(fn, items: list, *, parallel: bool = True) -> list:
    """``[fn(item) for item in items]`` on the io pool (or, without
    ``parallel``, on this thread). Every call ends before anything is raised (so no thread
    still writes into a caller's buffers after it has been told of a failure); then the
    first failure in ``items`` order is raised."""
    def call(item):
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001 - raised below, once every call has ended
            return exc

    results = parallel_map(call, items) if parallel else [call(item) for item in items]
    for item in results:
        if isinstance(item, Exception):
            raise item
    return results


_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024  # -1: no limit said
_READ_BATCH = 512 << 10  # bytes one preadv reads at most: hashed next, while still in the core's cache


def _read_exactly_into(fd: int, ref: PageRef, views: Sequence[memoryview],
                       hash_update: Callable[[memoryview], object], path: str) -> None:
    """``ref.size`` bytes from the start of ``fd`` (the object at ``path``) into ``views`` in
    order, each read handed to ``hash_update`` right after it (in byte order): a short file is
    ``absent``, a failing read ``io_error``."""
    todo = deque(v for v in views if v.nbytes)
    got, size = 0, ref.size
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
            raise ObjectError(Reason.IO_ERROR, ref.digest, f"read failed at {got}/{size}: {exc!r}", path) from None
        if n == 0:
            raise ObjectError(Reason.ABSENT, ref.digest, f"truncated while reading at {got}/{size}", path)
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


def _check_stat(digest: str, st: os.stat_result, size: int, path: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ObjectError(Reason.CORRUPT, digest, "is a symlink; the store never follows symlinks", path)
    if not stat.S_ISREG(st.st_mode):
        raise ObjectError(Reason.CORRUPT, digest, "not a regular file", path)
    if st.st_size < size:
        raise ObjectError(Reason.ABSENT, digest, f"truncated: {st.st_size} of {size} bytes present", path)
    if st.st_size > size:
        raise ObjectError(Reason.CORRUPT, digest, f"{st.st_size} bytes, manifest records {size}", path)


__all__ = ["LocalBackend", "ObjectError", "Survey", "checksum_of", "digest_of", "name_and_checksum"]
