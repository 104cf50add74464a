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
from typing import Iterable

from .layout import write_all

INTENT_SUFFIX = ".intent"
TEMP_SUFFIX = ".tmp"


class Staging:
    """One publication's workspace. Use ``open`` then ``close`` (or as a context manager)."""

    def __init__(self, staging_dir: str) -> None:
        self.token = secrets.token_hex(12)
        self.intent_path = os.path.join(staging_dir, self.token + INTENT_SUFFIX)
        self._temps: list[str] = []
        self._fd: int | None = None
        self._staging_dir = staging_dir

    def open(self) -> "Staging":
        # Lock the file under a temp name first, so the collector never sees an unlocked
        # intent of a live publisher. The collector removes an unlocked ".new" file while
        # holding its lock, so finding it unlinked after our flock means: try a new name.
        for _ in range(8):
            tmp = os.path.join(self._staging_dir, self.token + ".new")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_nlink == 0:
                    os.close(fd)
                    self.token = secrets.token_hex(12)
                    self.intent_path = os.path.join(self._staging_dir, self.token + INTENT_SUFFIX)
                    continue
                os.rename(tmp, self.intent_path)
            except BaseException:
                os.close(fd)
                _remove_quietly(tmp)
                raise
            self._fd = fd
            return self
        raise OSError(f"{self._staging_dir}: could not create a publication intent (8 tries)")

    def declare(self, digests: Iterable[str]) -> None:
        """Record digests this publication relies on (call under the shared gc lock)."""
        assert self._fd is not None, "Staging.open() first"
        write_all(self._fd, "".join(d + "\n" for d in digests).encode())

    def temp_path(self, name: str) -> str:
        path = os.path.join(self._staging_dir, f"{self.token}-{name}{TEMP_SUFFIX}")
        self._temps.append(path)
        return path

    def close(self) -> None:
        """Remove leftover temp files; the intent goes last, then the lock is released."""
        for path in self._temps:
            _remove_quietly(path)  # normally already renamed into place
        _remove_quietly(self.intent_path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Staging":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_live_intents(staging_dir: str) -> tuple[set[str], int]:
    """Digests named by live publications, and how many dead ones were cleaned up.

    Cleans up stale workspaces as a side effect: dead intents and their temp files,
    stray ``.new`` files of publishers that died before locking, and orphan temp files.
    """
    protected: set[str] = set()
    cleaned = 0
    try:
        names = os.listdir(staging_dir)
    except FileNotFoundError:
        return protected, 0
    intents = {n[: -len(INTENT_SUFFIX)] for n in names if n.endswith(INTENT_SUFFIX)}
    live: set[str] = set()
    for token in intents:
        path = os.path.join(staging_dir, token + INTENT_SUFFIX)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.add(token)
                with os.fdopen(os.dup(fd), "r") as f:
                    protected.update(line.strip() for line in f if line.strip())
                continue
            for name in names:  # a dead publisher: its temps first, then its intent
                if name.startswith(token + "-") and name.endswith(TEMP_SUFFIX):
                    _remove_quietly(os.path.join(staging_dir, name))
            _remove_quietly(path)
            cleaned += 1
        finally:
            os.close(fd)
    for name in names:
        full = os.path.join(staging_dir, name)
        if name.endswith(".new"):
            cleaned += _remove_if_unlocked(full)
        elif name.endswith(TEMP_SUFFIX):
            token = name.split("-", 1)[0]
            # Temps are created after their intent and removed before it, so a temp whose
            # intent is gone (or dead, handled above) is left over from a dead publisher.
            if token not in live and not os.path.exists(
                    os.path.join(staging_dir, token + INTENT_SUFFIX)):
                _remove_quietly(full)
        elif os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)  # nothing the store makes: stray
    return protected, cleaned


def _remove_if_unlocked(path: str) -> int:
    """Unlink a ".new" file nobody holds, *while holding its lock* (see Staging.open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0
    try:
        _remove_quietly(path)
        return 1
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
