"""In-flight publications: a locked intent file plus a private temp directory.

A publisher creates ``staging/<token>.intent`` and holds an exclusive ``flock`` on it for
the whole publication; it appends every object digest it is about to rely on before it
checks or writes that object, and names all its temp files ``staging/<token>-<name>.tmp``.

The collector reads intents (under the exclusive gc lock) before it deletes objects: a
digest named by a *live* intent (its flock is held) is never deleted. An intent whose
flock can be taken belongs to a dead publisher: recovery removes its directory and the
intent, and the objects it wrote become ordinary garbage that maintenance collects.
(Temp files sit beside the intent, not in a directory of their own: creating and removing
a directory per publication costs a journal commit on ext4.)
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
from typing import Callable, Iterable

from .layout import StoreLayout, UnsafePathError, close_quietly, is_object_digest, write_all
from .locks import LockTimeout, flock_within

INTENT_SUFFIX = ".intent"
TEMP_SUFFIX = ".tmp"
_MAX_INTENT_BYTES = 64 << 20  # a live intent names at most this many bytes of digests


class Staging:
    """One publication's workspace. Use ``open`` then ``close`` (or as a context manager)."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self.token = secrets.token_hex(12)
        self._temps: list[str] = []
        self._fd: int | None = None

    @property
    def intent_path(self) -> str:
        return os.path.join(self.layout.staging_dir, self.token + INTENT_SUFFIX)

    def open(self) -> "Staging":
        # Lock the file under a temp name first, so the collector never sees an unlocked
        # intent of a live publisher. The collector removes an unlocked ".new" file while
        # holding its lock, so finding it unlinked after our flock means: try a new name.
        for _ in range(8):
            tmp = os.path.join(self.layout.staging_dir, self.token + ".new")
            fd = self.layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND,
                                       create_dirs=True)
            try:
                try:
                    flock_within(fd, fcntl.LOCK_EX, 1.0, tmp)
                    locked = os.fstat(fd).st_nlink > 0
                except LockTimeout:
                    locked = False  # a stopped collector holds it: take another name
                if not locked:
                    os.close(fd)
                    self.token = secrets.token_hex(12)
                    continue
                self.layout.rename(tmp, self.intent_path)
            except BaseException:
                os.close(fd)
                _remove_quietly(self.layout, tmp)
                raise
            self._fd = fd
            return self
        raise OSError(f"{self.layout.staging_dir}: could not create a publication intent (8 tries)")

    def declare(self, digests: Iterable[str]) -> None:
        """Record digests this publication relies on (call under the shared gc lock)."""
        assert self._fd is not None, "Staging.open() first"
        write_all(self._fd, "".join(d + "\n" for d in digests).encode())

    def temp_path(self, name: str) -> str:
        path = os.path.join(self.layout.staging_dir, f"{self.token}-{name}{TEMP_SUFFIX}")
        self._temps.append(path)
        return path

    def abandon(self) -> None:
        """Release the lock but leave the intent in place: the publication's outcome is not
        known to the other processes (its manifest may be in place, unjournaled), so whoever
        finds it dead asks every process to list the manifests again."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            close_quietly(fd)  # the lock is released either way; the intent stays

    def close(self) -> None:
        """Remove leftover temp files; the intent goes last, then the lock is released.
        Never raises: it runs after the publication's outcome is decided (an error closing
        the intent, a FUSE or network filesystem's flush, changes nothing of it; the
        descriptor and its lock are released anyway)."""
        for path in self._temps:
            _remove_quietly(self.layout, path)  # normally already renamed into place
        if self._fd is not None:
            _remove_quietly(self.layout, self.intent_path)
            fd, self._fd = self._fd, None
            close_quietly(fd)

    def __enter__(self) -> "Staging":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_live_intents(layout: StoreLayout, *, remove_stray_dirs: bool = False,
                      before_removal: Callable[[], None] | None = None) -> tuple[set[str], int]:
    """Digests named by live publications, and how many dead ones were cleaned up.

    A dead intent is the only trace of a publisher that may have renamed its manifest into
    place without journaling it, so it is removed only after ``before_removal`` (called once,
    at the first dead intent) has told every process to list the manifests again: when that
    raises ``OSError`` the dead intents stay, for the next reader of staging to find. A failed
    close of an intent's descriptor (a FUSE or network filesystem's flush) changes nothing
    of what was read or removed: it is not an error here.

    Cleans up stale workspaces as a side effect: dead intents and their temp files,
    stray ``.new`` files of publishers that died before locking, and orphan temp files.
    A file that is not a regular file (a link, a FIFO, a directory) is never opened; a
    link or FIFO named like a leftover is removed itself, a directory is left for
    ``verify`` to report. Lines of a live intent that are not object names are ignored.
    Directories (nothing the store makes) are removed only with ``remove_stray_dirs``
    (recovery, which holds no lock): their size is unbounded, a maintenance pass's is not.
    A listing or an intent that cannot be read (EIO, EACCES) raises ``OSError``: what live
    publications rely on is then not known, and nothing may be deleted on it.
    """
    staging_dir = layout.staging_dir
    protected: set[str] = set()
    cleaned = 0
    try:
        names = layout.listdir(staging_dir)
    except UnsafePathError:
        return protected, 0  # a link or a file in its place: no publication can use it
    intents = {n[: -len(INTENT_SUFFIX)] for n in names if n.endswith(INTENT_SUFFIX)}
    temps: dict[str, list[str]] = {}  # token -> its temp files' names
    for name in names:
        if name.endswith(TEMP_SUFFIX) and "-" in name:
            temps.setdefault(name.split("-", 1)[0], []).append(name)
    live: set[str] = set()
    announced = before_removal is None  # whether a dead intent may be removed
    kept_dead = False  # a dead intent stays: its rescan could not be asked for
    for token in intents:
        path = os.path.join(staging_dir, token + INTENT_SUFFIX)
        try:
            fd = layout.open_file(path, os.O_RDONLY)
        except (FileNotFoundError, UnsafePathError):
            continue  # gone, or not an intent this store wrote (verify reports it)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.add(token)
                data = os.read(fd, _MAX_INTENT_BYTES)
                protected.update(line for line in data.decode("ascii", "replace").split("\n")
                                 if is_object_digest(line))
                continue
            if not announced and not kept_dead:
                try:
                    before_removal()
                    announced = True
                except OSError:
                    kept_dead = True
            if not announced:
                continue  # its temps stay too: their intent is still there
            for name in temps.pop(token, ()):  # a dead publisher: its temps, then its intent
                _remove_quietly(layout, os.path.join(staging_dir, name))
            _remove_quietly(layout, path)
            cleaned += 1
        finally:
            close_quietly(fd)
    for name in names:
        full = os.path.join(staging_dir, name)
        if name.endswith(".new"):
            cleaned += _remove_if_unlocked(layout, full)
        elif name.endswith(TEMP_SUFFIX):
            token = name.split("-", 1)[0]
            # Temps are created after their intent and removed before it, so a temp whose
            # intent is gone (or dead, handled above) is left over from a dead publisher.
            if token not in live and token in temps and not _exists(
                    layout, os.path.join(staging_dir, token + INTENT_SUFFIX)):
                _remove_quietly(layout, full)
    if remove_stray_dirs:
        _remove_stray_dirs(layout, names)
    return protected, cleaned


def _remove_stray_dirs(layout: StoreLayout, names: list[str]) -> None:
    """Directories in staging are nothing the store makes: removed without following links
    (``shutil.rmtree`` relative to the staging directory's descriptor)."""
    try:
        with layout.open_dir(layout.staging_dir) as d:
            for name in names:
                try:
                    if stat.S_ISDIR(os.stat(name, dir_fd=d.fd, follow_symlinks=False).st_mode):
                        shutil.rmtree(name, dir_fd=d.fd, ignore_errors=True)
                except (OSError, RecursionError):
                    continue  # too deep for rmtree: left for the operator (verify lists it)
    except (OSError, UnsafePathError):
        pass


def _exists(layout: StoreLayout, path: str) -> bool:
    try:
        layout.lstat(path)
        return True
    except FileNotFoundError:
        return False
    except (OSError, UnsafePathError):
        return True  # something is there; keep what might be its temps


def _remove_if_unlocked(layout: StoreLayout, path: str) -> int:
    """Unlink a ".new" file nobody holds, *while holding its lock* (see Staging.open)."""
    try:
        fd = layout.open_file(path, os.O_RDONLY)
    except (OSError, UnsafePathError):
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        close_quietly(fd)
        return 0
    try:
        _remove_quietly(layout, path)
        return 1
    finally:
        close_quietly(fd)


def _remove_quietly(layout: StoreLayout, path: str) -> None:
    try:
        layout.unlink(path)
    except (OSError, UnsafePathError):
        pass
