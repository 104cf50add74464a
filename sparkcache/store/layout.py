"""On-disk layout of one store and the durable file operations it is built from.

    ROOT/NAMESPACE/
      objects/ab/cdef...   page objects, named by the BLAKE3 of their bytes
      manifests/<identity digest>/<entry id>.mf   one per published entry
      staging/<token>.intent + staging/<token>/    one per in-flight publication
      pins/<entry id>.<token>.pin                  leases protecting entries
      locks/gc.lock                                 publishers (shared) vs collector (exclusive)
      journal/current                               what changed, for the other processes' views
      locks/writers.lock, cap.lock, cap.json        the writers alive and their one cap (writers.py)

Every path the store opens is built here from validated names; a name that is not a
lower-case hex digest of the right length is refused (so a manifest cannot smuggle in
``..`` or an absolute path). Every file operation under the root goes through
``StoreLayout``'s own methods, which walk from the store directory one component at a time
with ``openat(O_DIRECTORY | O_NOFOLLOW)`` and act on the last name relative to that
directory descriptor (``unlinkat``, ``renameat``, ``openat(O_NOFOLLOW | O_NONBLOCK)``,
``utimensat(AT_SYMLINK_NOFOLLOW)``): a symbolic link or a non-directory anywhere below the
root is refused as ``UnsafePathError``, never followed, even if it is swapped in while the
store works, and only regular files are ever read or written (a FIFO cannot block an open).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from . import cpus
from ..settings import check_namespace, check_root

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX_PREFIX = re.compile(r"[0-9a-f]{0,64}")
MANIFEST_SUFFIX = ".mf"


class UnsafePathError(ValueError):
    """A name from disk would leave the store root or go through a symlink."""


def is_object_digest(name: object) -> bool:
    return isinstance(name, str) and _HEX64.fullmatch(name) is not None


def check_object_digest(digest: object) -> str:
    """``digest`` if it names an object (``is_object_digest``); else ``UnsafePathError``."""
    if not is_object_digest(digest):
        raise UnsafePathError(f"object name {digest!r} is not a 64-hex-char BLAKE3 digest")
    return digest


def check_object_prefix(prefix: object) -> str:
    """``prefix`` if it can start an object's name (lower-case hex, at most 64 characters);
    else ``UnsafePathError``."""
    if not isinstance(prefix, str) or not _HEX_PREFIX.fullmatch(prefix):
        raise UnsafePathError(f"object prefix {prefix!r} is not lower-case hex of at most 64 "
                              "characters; pass a digest's first characters")
    return prefix


def is_identity_digest(name: object) -> bool:
    return isinstance(name, str) and _HEX32.fullmatch(name) is not None


def is_entry_id(name: object) -> bool:
    return isinstance(name, str) and _HEX40.fullmatch(name) is not None


@dataclass(frozen=True)
class StoreLayout:
    """Paths of one store (ROOT/NAMESPACE). ``base`` is resolved (realpath) once."""

    base: str

    @classmethod
    def create(cls, root: str, namespace: str = "default", *, make: bool = True) -> "StoreLayout":
        """The layout of ROOT/NAMESPACE, its directories made unless ``make`` is false (a
        reader that must not write: restore-only, ``status``, ``verify``, ``inspect``)."""
        check_root(root)  # SettingsError (a ValueError) naming SPARKCACHE_ROOT and the fix
        check_namespace(namespace)
        base = os.path.join(os.path.realpath(root), namespace)
        layout = cls(base)
        try:
            if make:
                os.makedirs(os.path.dirname(base), exist_ok=True)
                try:
                    os.mkdir(base)
                except FileExistsError:
                    pass
            layout.open_dir(base).close()  # the namespace must be a real directory
        except UnsafePathError:
            raise UnsafePathError(f"SPARKCACHE_ROOT={root!r}: the store directory {base} (ROOT/"
                                f"SPARKCACHE_NAMESPACE={namespace!r}) is a symbolic link or not "
                                "a directory; allowed: a directory. Fix: move it away, or choose "
                                "another SPARKCACHE_NAMESPACE or SPARKCACHE_ROOT") from None
        except OSError as exc:
            fix = ("open a writer of it first (a reader never creates a store), or check "
                   "SPARKCACHE_ROOT and SPARKCACHE_NAMESPACE" if isinstance(exc, FileNotFoundError)
                   else "give this user access to it, or point SPARKCACHE_ROOT elsewhere")
            raise type(exc)(exc.errno, f"SPARKCACHE_ROOT={root!r}: cannot open the store "
                            f"directory {base}: {exc.strerror}. Fix: {fix}") from None
        for sub in (layout.objects_dir, layout.manifests_dir, layout.staging_dir,
                    layout.pins_dir, layout.locks_dir, layout.journal_dir) if make else ():
            try:
                layout.make_dir(sub)
            except UnsafePathError:
                pass  # a link or a file in its place: never used; verify lists it
        return layout

    @property
    def objects_dir(self) -> str:
        return os.path.join(self.base, "objects")

    @property
    def manifests_dir(self) -> str:
        return os.path.join(self.base, "manifests")

    @property
    def staging_dir(self) -> str:
        return os.path.join(self.base, "staging")

    @property
    def pins_dir(self) -> str:
        return os.path.join(self.base, "pins")

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.base, "locks")

    @property
    def journal_dir(self) -> str:
        return os.path.join(self.base, "journal")

    @property
    def journal_path(self) -> str:
        return os.path.join(self.journal_dir, "current")

    @property
    def snapshot_path(self) -> str:
        return os.path.join(self.journal_dir, "snapshot")

    @property
    def gc_lock_path(self) -> str:
        return os.path.join(self.locks_dir, "gc.lock")

    def object_path(self, digest: str) -> str:
        check_object_digest(digest)
        return os.path.join(self.objects_dir, digest[:2], digest[2:])

    def identity_dir(self, identity_digest: str) -> str:
        if not is_identity_digest(identity_digest):
            raise UnsafePathError(f"identity directory {identity_digest!r} is not a digest")
        return os.path.join(self.manifests_dir, identity_digest)

    def manifest_path(self, identity_digest: str, entry_id: str) -> str:
        if not is_entry_id(entry_id):
            raise UnsafePathError(f"entry id {entry_id!r} is not a 40-hex-char id")
        return os.path.join(self.identity_dir(identity_digest), entry_id + MANIFEST_SUFFIX)

    # ------------------------------------------------------------------ file operations
    # Each one walks from ``base`` without following links (see the module docstring).

    def _parts(self, path: str) -> list[str]:
        prefix = self.base + os.sep
        parts = path[len(prefix):].split(os.sep) if path.startswith(prefix) else [".."]
        if any(part in ("", ".", "..") for part in parts):
            raise UnsafePathError(f"{path}: not a path inside the store {self.base}")
        return parts

    @contextmanager
    def _parent(self, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """(descriptor of ``path``'s directory, its last name); with ``create`` the missing
        directories on the way are made."""
        parts = self._parts(path)
        fd = _open_base(self.base)
        try:
            for part in parts[:-1]:
                nxt = _open_subdir(fd, part, path, create)
                os.close(fd)
                fd = nxt
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def open_dir(self, path: str) -> "DirHandle":
        """A descriptor of the directory ``path`` (the store directory itself included)."""
        if path == self.base:
            return DirHandle(_open_base(self.base))
        with self._parent(path) as (fd, name):
            return DirHandle(_open_subdir(fd, name, path, False))

    def make_dir(self, path: str) -> bool:
        """Make the directory ``path`` (and any missing one above it, inside the root); True
        when it was made. An existing non-directory there is ``UnsafePathError``."""
        with self._parent(path, create=True) as (fd, name):
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                return True
            except FileExistsError:
                os.close(_open_subdir(fd, name, path, False))  # a directory, not a link or file
                return False

    def listdir(self, path: str) -> list[str]:
        """Names in the directory ``path``; [] when it does not exist."""
        try:
            with self.open_dir(path) as d:
                return os.listdir(d.fd)
        except FileNotFoundError:
            return []

    def scandir_files(self, path: str) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of every entry of the directory ``path``; [] when it is absent."""
        try:
            with self.open_dir(path) as d:
                out = []
                for name in os.listdir(d.fd):
                    try:
                        out.append((name, os.stat(name, dir_fd=d.fd, follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
                return out
        except FileNotFoundError:
            return []

    def lstat(self, path: str) -> os.stat_result:
        with self._parent(path) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def open_file(self, path: str, flags: int, mode: int = 0o644, *, create_dirs: bool = False) -> int:
        """An fd of the regular file ``path``: never through a link, never blocking on a
        FIFO; anything but a regular file is ``UnsafePathError``."""
        with self._parent(path, create=create_dirs) as (dfd, name):
            return open_regular_at(dfd, name, path, flags, mode)

    def unlink(self, path: str) -> bool:
        """Remove the file (or link) ``path`` itself; False when it was already gone."""
        try:
            with self._parent(path) as (fd, name):
                os.unlink(name, dir_fd=fd)
                return True
        except FileNotFoundError:
            return False

    def rename(self, src: str, dst: str, *, create_dirs: bool = False) -> None:
        """Rename inside the root; with ``create_dirs`` the destination's directories are made."""
        with self._parent(src) as (sfd, sname), self._parent(dst, create=create_dirs) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def rename_if_absent(self, src: str, dst: str, *, create_dirs: bool = False) -> bool:
        """``rename`` unless something is at ``dst`` already: False then, and ``src`` stays.
        Atomic where the filesystem has ``renameat2(RENAME_NOREPLACE)``; elsewhere (FUSE,
        some network filesystems) ``dst`` is looked at first, and a writer racing this one
        may be replaced by it."""
        with self._parent(src) as (sfd, sname), self._parent(dst, create=create_dirs) as (dfd, dname):
            done = _rename_noreplace(sfd, sname, dfd, dname)
            if done is not None:
                return done
            try:
                os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                return False
            except FileNotFoundError:
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                return True

    def touch(self, path: str, when: float | None = None) -> float:
        """Set ``path``'s access and modification times (never through a link) to ``when``,
        or by default to the kernel's current time (``utimensat(UTIME_NOW)``: the
        filesystem's clock, never this process's; see ``clocks``). Returns the mtime now."""
        with self._parent(path) as (fd, name):
            os.utime(name, None if when is None else (when, when), dir_fd=fd,
                     follow_symlinks=False)
            return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime

    def fsync_dir(self, path: str) -> None:
        with self.open_dir(path) as d:
            os.fsync(d.fd)


class DirHandle:
    """An open directory descriptor (a context manager that closes it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        close_quietly(self.fd)  # a directory's close says nothing the caller needs

    def __enter__(self) -> "DirHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular_at(dir_fd: int, name: str, path: str, flags: int, mode: int = 0o644) -> int:
    """``StoreLayout.open_file`` of ``name`` in the directory open at ``dir_fd`` (``path``:
    its whole path, for messages)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise UnsafePathError(f"{path}: {_KIND_WORDS.get(exc.errno)}; the store "
                                  "opens only regular files, never through a link") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path}: not a regular file (a {file_kind(st.st_mode)}); the "
                              "store opens only regular files")
    return fd


_KIND_WORDS = {errno.ELOOP: "is a symbolic link", errno.EISDIR: "is a directory",
               errno.ENXIO: "is a FIFO or socket with no peer"}


def close_quietly(fd: int) -> None:
    """Close a descriptor whose close can fail (a FUSE or network filesystem's flush: EIO)
    when that failure says nothing the caller needs: a read-only one, or one being dropped."""
    try:
        os.close(fd)
    except OSError:
        pass


def file_kind(mode: int) -> str:
    """A file's kind in words, for messages and ``verify`` ("file" for a regular one)."""
    for test, word in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "special file"


def _open_base(base: str) -> int:
    try:
        return os.open(base, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{base}: the store directory is a symbolic link or not a "
                                  "directory; point SPARKCACHE_ROOT at the real directory") from None
        raise


def open_subdir_at(dir_fd: int, name: str, path: str) -> int:
    """The directory ``name`` in the directory open at ``dir_fd``, never through a link
    (``path``: its whole path, for messages); a link or a file there is ``UnsafePathError``."""
    return _open_subdir(dir_fd, name, path, False)


def _open_subdir(fd: int, name: str, path: str, create: bool) -> int:
    for attempt in (0, 1):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create or attempt:
                raise
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePathError(f"{path}: {name!r} on the way is a symbolic link or not a "
                                      "directory; the store never follows links: remove it "
                                      "(sparkcache verify lists such files)") from None
            raise
    raise AssertionError("unreachable")


_POOLS: dict = {}
# io: a cold object read waits on the disk 128 KiB of readahead at a time, so reads need
# depth (bench.store_throughput, cold: 16 threads beat 8 and 32; docs/RESULTS.md); a
# restore's reads run on every allowed CPU (the model waits for them).
# publish: a publication's hashing and syncs; maintenance: one unlink batch at once. Both
# are background work and keep off the model's CPUs (``cpus.run_off_model_cpus``).
# direct: the writes past the page cache of fetched objects (``direct_writes.py``): each waits
# on the device, so they get threads of their own, off the model's CPUs.
_POOL_SIZES = {"io": 16, "publish": 16, "maintenance": 16, "direct": 16}
_POOL_PLACEMENT = {"io": cpus.run_on_every_allowed_cpu, "publish": cpus.run_as_publisher,
                   "maintenance": cpus.run_off_model_cpus, "direct": cpus.run_off_model_cpus}


def _forget_pools_in_child() -> None:
    # A forked child has none of the parent's threads: the pools must be rebuilt there.
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _executor(pool: str):
    """The pool's executor; a new one when the model's CPUs were noted after its threads
    were placed (the old one's threads finish their work and exit)."""
    return _pool(pool)[0]


def _pool(pool: str) -> tuple:
    """``(executor, the CPUs its threads run on)``, made anew as ``_executor`` says."""
    placed, executor, where = _POOLS.get(pool, (None, None, ()))
    if executor is None or placed != cpus.model_cpus():
        from concurrent.futures import ThreadPoolExecutor
        if executor is not None:
            executor.shutdown(wait=False)
        executor = ThreadPoolExecutor(max_workers=_POOL_SIZES[pool], thread_name_prefix=f"sparkcache-{pool}",
                                      initializer=_POOL_PLACEMENT[pool])
        where = tuple(sorted(executor.submit(cpus.own_cpus).result()))
        _POOLS[pool] = (cpus.model_cpus(), executor, where)
    return executor, where


def pool_cpus(pool: str = "io") -> tuple[int, ...]:
    """The CPUs the pool's threads may run on (empty where the system does not say)."""
    return _pool(pool)[1]


def reader_cpus(pool: str = "io") -> tuple[int, ...]:
    """The CPUs ``per_cpu_map`` runs items on: the pool's, less those the model's OpenMP
    threads spin on (``cpus.spinning_cpus``), but for the first the calling thread may run
    on (vLLM's model thread, pinned to one of them, reads there itself)."""
    where = pool_cpus(pool)
    own = cpus.own_cpus()
    mine = next((c for c in where if c in own), None)
    spinning = cpus.spinning_cpus()
    return tuple(c for c in where if c == mine or c not in spinning)


def per_cpu_map(fn, items: list, pool: str = "io") -> list:
    """``[fn(x) for x in items]`` with item k on a thread of the pool held to the k-th of
    ``reader_cpus`` for the call (``cpus.held_to``), so that every CPU works from the first
    moment: left to the kernel, threads woken after an idle spell started on the waker's
    CPU and shared it (docs/RESULTS.md, "A page reader per CPU"). The calling thread, which
    waits for them anyway, takes the item of the first CPU it may run on (vLLM pins the
    model's thread to its CPU), or else the first: only the others wait for a pool thread to
    wake. Every item has ended before anything is raised. At most one item per CPU; where
    the system names none, as ``parallel_map``."""
    executor, where = _pool(pool)[0], reader_cpus(pool)
    if len(items) > max(1, len(where)):
        raise ValueError(f"{len(items)} items for {len(where)} CPUs")
    if len(items) <= 1 or not where:
        return parallel_map(fn, items, pool)

    def on_its_cpu(k: int):
        with cpus.held_to(where[k]):
            return fn(items[k])

    own = cpus.own_cpus()
    mine = next((k for k in range(len(items)) if where[k] in own), 0)
    others = {k: executor.submit(on_its_cpu, k) for k in range(len(items)) if k != mine}
    try:
        result = on_its_cpu(mine)
    finally:
        wait(others.values())
    return [result if k == mine else others[k].result() for k in range(len(items))]


def submit(fn, *args, pool: str = "io") -> Future:
    """``fn(*args)`` on a thread of the pool; its future."""
    return _executor(pool).submit(fn, *args)


def done_now(fn, *args) -> Future:
    """``fn(*args)`` run on this thread, as a finished future (what it returned or raised):
    ``submit``'s stand-in where the work must not leave the calling thread."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # raised where the result is taken
        future.set_exception(exc)
    return future


def parallel_imap(fn, items: list, pool: str = "io"):
    """Submit ``fn(x)`` for every item now; yield the results in order as they finish, so
    the caller can work on the first results while the pool computes the rest."""
    return _executor(pool).map(fn, items)


def parallel_map(fn, items: list, pool: str = "io") -> list:
    """``[fn(x) for x in items]``, on a small thread pool when there are several items.
    For work that releases the GIL: fsync, reads, unlinks, hashing large buffers.
    ``pool`` names the pool ("io" for reads, "publish" for publication, "maintenance" for
    passes), so a restore never queues behind a publication's hashing, nor a maintenance
    pass."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(_executor(pool).map(fn, items))


def sync_all(sync, fds: list, pool: str = "io") -> None:
    """Run ``sync`` (os.fsync / os.fdatasync / fsync_dir) on every item in parallel threads,
    so the filesystem can group them into one journal commit."""
    parallel_map(sync, fds, pool)


_LIBC_FUNCTIONS: dict = {}


def _libc_function(name: str, *argtypes: str):
    """libc's ``name``, its arguments of the ``ctypes`` types named (False where there is
    none), looked up once."""
    fn = _LIBC_FUNCTIONS.get(name)
    if fn is None:
        try:
            import ctypes
            fn = getattr(ctypes.CDLL(None, use_errno=True), name)
            fn.argtypes = [getattr(ctypes, t) for t in argtypes]
        except (OSError, AttributeError):
            fn = False
        _LIBC_FUNCTIONS[name] = fn
    return fn


def _sync_file_range():
    return _libc_function("sync_file_range", "c_int", "c_longlong", "c_longlong", "c_uint")


_RENAME_NOREPLACE = 1


def _rename_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> bool | None:
    """``renameat2(..., RENAME_NOREPLACE)``: True when renamed, False when ``dst`` exists, None
    where the system or the filesystem does not offer it. Other failures raise ``OSError``."""
    fn = _libc_function("renameat2", "c_int", "c_char_p", "c_int", "c_char_p", "c_uint")
    if not fn:
        return None
    if fn(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    import ctypes
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return None
    raise OSError(err, os.strerror(err), dst)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now (Linux sync_file_range
    with SYNC_FILE_RANGE_WRITE; no durability promise, fdatasync still follows). A no-op
    where it is unavailable."""
    fn = _sync_file_range()
    if fn:
        fn(fd, 0, 0, 2)


def wait_writeback(fd: int) -> None:
    """Wait until ``fd``'s data written so far has reached the device (WAIT_BEFORE | WRITE |
    WAIT_AFTER; still no durability promise: no metadata, no cache flush). Used to keep the
    bytes in flight bounded, so other I/O (and unlinks that discard) queue behind at most
    that much. A no-op where unavailable."""
    fn = _sync_file_range()
    if fn:
        fn(fd, 0, 0, 7)


WRITE_CHUNK = 1 << 20  # bytes per write(2) call


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``, at most ``WRITE_CHUNK`` bytes per call.

    A single write(2) of several MiB into a fresh file was several times slower than the
    same bytes written 1 MiB at a time on a VM (the kernel backs a large single write with
    large page-cache folios, taken from free memory the hypervisor has reclaimed and must
    fault back in; docs/RESULTS.md, "Measurements behind the code"). Pages of several MiB
    are the normal case for real models, so every file the store writes goes through here."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_CHUNK]):]


def occupied(st: os.stat_result, unit: int) -> int:
    """Bytes a regular file occupies: its allocated blocks, at most its size rounded up to
    whole blocks (a sparse file counts what it holds), shared among its hard links (the store
    makes none: links cannot multiply what is counted); 0 for anything else."""
    if not stat.S_ISREG(st.st_mode):
        return 0
    return min(st.st_blocks * 512, allocated(st.st_size, unit)) // max(st.st_nlink, 1)


def allocated(size: int, unit: int) -> int:
    """Bytes a file of ``size`` occupies, counted in whole filesystem blocks."""
    return -(-size // unit) * unit if size else 0
