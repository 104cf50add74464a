"""On-disk layout of one store and the durable file operations it is built from.

    ROOT/NAMESPACE/
      objects/ab/cdef...   page objects, named by the BLAKE3 of their bytes
      manifests/<identity digest>/<entry id>.mf   one per published entry
      staging/<token>.intent + staging/<token>/    one per in-flight publication
      pins/<entry id>.<token>.pin                  leases protecting entries
      locks/gc.lock                                 publishers (shared) vs collector (exclusive)

Every path the store opens is built here from validated names; a name that is not a
lower-case hex digest of the right length is refused (so a manifest cannot smuggle in
``..`` or an absolute path), and symlinks are never followed (``O_NOFOLLOW`` plus a check
that the resolved parent stays inside the root).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX40 = re.compile(r"[0-9a-f]{40}")
MANIFEST_SUFFIX = ".mf"


class UnsafePathError(ValueError):
    """A name from disk would leave the store root or go through a symlink."""


def is_object_digest(name: object) -> bool:
    return isinstance(name, str) and _HEX64.fullmatch(name) is not None


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
        if not os.path.isabs(root):
            raise ValueError(f"store root {root!r}: must be an absolute path")
        if "/" in namespace or namespace in ("", ".", ".."):
            raise ValueError(f"namespace {namespace!r}: must be a plain directory name")
        base = os.path.join(os.path.realpath(root), namespace)
        layout = cls(base)
        for sub in (layout.objects_dir, layout.manifests_dir, layout.staging_dir,
                    layout.pins_dir, layout.locks_dir) if make else ():
            os.makedirs(sub, exist_ok=True)
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
    def gc_lock_path(self) -> str:
        return os.path.join(self.locks_dir, "gc.lock")

    def object_path(self, digest: str) -> str:
        if not is_object_digest(digest):
            raise UnsafePathError(f"object name {digest!r} is not a 64-hex-char BLAKE3 digest")
        return os.path.join(self.objects_dir, digest[:2], digest[2:])

    def identity_dir(self, identity_digest: str) -> str:
        if not is_identity_digest(identity_digest):
            raise UnsafePathError(f"identity directory {identity_digest!r} is not a digest")
        return os.path.join(self.manifests_dir, identity_digest)

    def manifest_path(self, identity_digest: str, entry_id: str) -> str:
        if not is_entry_id(entry_id):
            raise UnsafePathError(f"entry id {entry_id!r} is not a 40-hex-char id")
        return os.path.join(self.identity_dir(identity_digest), entry_id + MANIFEST_SUFFIX)

    def check_inside(self, path: str) -> None:
        """Refuse a path whose parent directories resolve outside the store (symlinked dirs)."""
        parent = os.path.realpath(os.path.dirname(path))
        if parent != self.base and not parent.startswith(self.base + os.sep):
            raise UnsafePathError(f"{path}: resolves outside the store root {self.base}")


def open_nofollow(path: str) -> int:
    """Open a regular file for reading without following a symlink as the last component."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path}: is a symlink; the store never follows symlinks") from None
        raise
    return fd


_POOLS: dict = {}
# io: a cold object read waits on the disk 128 KiB of readahead at a time, so reads need
# depth (bench.store_throughput, cold: 16 threads beat 8 and 32; docs/RESULTS.md).
# maintenance: one unlink batch at once.
_POOL_SIZES = {"io": 16, "maintenance": 16}


def _forget_pools_in_child() -> None:
    # A forked child has none of the parent's threads: the pools must be rebuilt there.
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _run_on_every_allowed_cpu() -> None:
    """Pool thread initializer: run on any CPU the process's cpuset allows, not only the
    cores the creating thread was pinned to. vLLM's CPU backend pins the whole worker to its
    OpenMP cores, which put every read and hash of a restore on the core the model was
    about to use while the others idled. The kernel intersects the mask with the cpuset."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):
        pass  # no such call (non-Linux) or an empty intersection: the inherited mask stays


def _executor(pool: str):
    executor = _POOLS.get(pool)
    if executor is None:
        from concurrent.futures import ThreadPoolExecutor
        executor = _POOLS[pool] = ThreadPoolExecutor(max_workers=_POOL_SIZES[pool],
                                                     thread_name_prefix=f"sparkcache-{pool}",
                                                     initializer=_run_on_every_allowed_cpu)
    return executor


def parallel_imap(fn, items: list, pool: str = "io"):
    """Submit ``fn(x)`` for every item now; yield the results in order as they finish, so
    the caller can work on the first results while the pool computes the rest."""
    return _executor(pool).map(fn, items)


def parallel_map(fn, items: list, pool: str = "io") -> list:
    """``[fn(x) for x in items]``, on a small thread pool when there are several items.
    For work that releases the GIL: fsync, reads, unlinks, hashing large buffers.
    ``pool`` names the pool ("io" for publication and reads, "maintenance" for passes), so
    a maintenance pass never queues behind a publication's hashing."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(_executor(pool).map(fn, items))


def sync_all(sync, fds: list, pool: str = "io") -> None:
    """Run ``sync`` (os.fsync / os.fdatasync / fsync_dir) on every item in parallel threads,
    so the filesystem can group them into one journal commit."""
    parallel_map(sync, fds, pool)


_SYNC_FILE_RANGE = None


def _sync_file_range():
    global _SYNC_FILE_RANGE
    if _SYNC_FILE_RANGE is None:
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            _SYNC_FILE_RANGE = fn
        except (OSError, AttributeError):
            _SYNC_FILE_RANGE = False
    return _SYNC_FILE_RANGE


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


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WRITE_CHUNK = 1 << 20  # bytes per write(2) call


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``, at most ``WRITE_CHUNK`` bytes per call.

    One write(2) of 2 or 4 MiB into a fresh file measured 0.6-1.3 GB/s on the VM this was
    built on, against 3.6-4.6 GB/s for the same bytes written 1 MiB at a time (the kernel
    backs a large single write with large page-cache folios, taken from free memory the
    hypervisor has reclaimed and must fault back in). Pages of several MiB are the normal
    case for real models, so every file the store writes goes through here."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:WRITE_CHUNK]):]


def write_file_durably(tmp_path: str, final_path: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``tmp_path``, fsync it and rename it onto ``final_path``.

    The caller fsyncs ``final_path``'s directory (once for a batch of renames).
    On any error the temp file is removed and the error propagates.
    """
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp_path, final_path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise


def allocated(size: int, unit: int) -> int:
    """Bytes a file of ``size`` occupies, counted in whole filesystem blocks."""
    return -(-size // unit) * unit if size else 0
