"""One cap per store: every writer of ROOT/NAMESPACE uses the same ``max_bytes`` and low
watermark.

Each writer's maintenance evicts toward its own cap, so two writers of one store with
different caps would quietly keep it at the smaller one. A writer therefore records the cap
when it opens, and a writer whose cap differs from the one the live writers recorded is
refused. Files, under ``locks/``:

  writers.lock   every writer holds it shared (flock) for its lifetime; the kernel drops the
                 hold when the process ends, however it ends
  cap.lock       held exclusive while a writer opens, so the check below and the record are
                 one step for every opener
  cap.json       ``{"max_bytes": N, "low_watermark_bytes": N}``: the live writers' cap

A writer opening takes ``cap.lock``, then tries ``writers.lock`` exclusive without waiting:
  - it gets it: no other writer is alive. It records its own cap (temp file, fsync, rename,
    fsync the directory), replacing whatever was there, a damaged file included. This is how
    an operator changes the cap: stop every writer of the root, start them with the new one.
  - it does not: it reads the record and is refused (``SettingsError``) when its cap differs,
    or when the record is missing or damaged (the live writers' cap is then unknown).
Either way it then holds ``writers.lock`` shared until ``close`` (or until it is collected, or
the process ends) and lets ``cap.lock`` go. Readers (``read_only``) take none of these and are
never refused. A process forked from a writer shares its hold (one open file) until it exits:
it may use the writer's store, so it counts as one of the live writers.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import weakref

from .layout import StoreLayout, UnsafePathError, close_quietly, write_all
from .locks import PUBLISH_WAIT_S, LockTimeout, flock_within
from ..settings import SettingsError, format_bytes

log = logging.getLogger("sparkcache.store")

_RECORD_LIMIT = 4096  # bytes of cap.json read; a record is far smaller


def _cap_words(max_bytes: int, low: int) -> str:
    return (f"SPARKCACHE_MAX_BYTES={format_bytes(max_bytes)}, "
            f"SPARKCACHE_LOW_WATERMARK_BYTES={format_bytes(low)}")


class WriterClaim:
    """A writer's shared hold on ``locks/writers.lock``: released by ``close``, when the claim
    is collected, or when the process ends."""

    def __init__(self, fd: int | None) -> None:
        self._finalizer = weakref.finalize(self, close_quietly, fd) if fd is not None else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def claim_writer(layout: StoreLayout, max_bytes: int, low_watermark_bytes: int) -> WriterClaim:
    """Join the writers of ``layout`` with this cap (see the module docstring). Raises
    ``SettingsError`` when the live writers recorded another cap or their record is damaged,
    ``LockTimeout`` when another opener holds ``cap.lock`` past ``PUBLISH_WAIT_S``, and the
    filesystem's error (``OSError``, ``UnsafePathError``) when the files cannot be used."""
    try:
        return _claim(layout, max_bytes, low_watermark_bytes)
    except LockTimeout:
        raise
    except (OSError, UnsafePathError) as exc:
        # a broken locks/ or a read-only mount: this writer cannot take the store's lock
        # either (its publications and passes fail and say so); opening goes on, unchecked
        log.warning("sparkcache: cannot check this writer's cap against the other writers of "
                    "%s: %s; writers of this store are not checked for one cap until it is fixed "
                    "(`sparkcache verify` lists unsafe files)", layout.base, exc)
        return WriterClaim(None)


def _claim(layout: StoreLayout, max_bytes: int, low_watermark_bytes: int) -> WriterClaim:
    locks = layout.locks_dir
    opening = layout.open_file(os.path.join(locks, "cap.lock"), os.O_RDWR | os.O_CREAT,
                               create_dirs=True)
    try:
        flock_within(opening, fcntl.LOCK_EX, PUBLISH_WAIT_S, os.path.join(locks, "cap.lock"))
        writers_path = os.path.join(locks, "writers.lock")
        # read-only: flock needs no write access, and a mount with no file open for writing
        # can still be remounted read-only under a running writer
        fd = layout.open_file(writers_path, os.O_RDONLY | os.O_CREAT)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            if alone:
                _record(layout, max_bytes, low_watermark_bytes)
            else:
                _check(layout, max_bytes, low_watermark_bytes, writers_path)
            # exclusive -> shared is not atomic in flock, but every opener waits on cap.lock
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return WriterClaim(fd)
    finally:
        os.close(opening)  # lets the next opener in


def _cap_path(layout: StoreLayout) -> str:
    return os.path.join(layout.locks_dir, "cap.json")


def _read(layout: StoreLayout) -> tuple[int, int] | str:
    """The recorded (max_bytes, low_watermark_bytes), or what is wrong with the record."""
    try:
        fd = layout.open_file(_cap_path(layout), os.O_RDONLY)
    except FileNotFoundError:
        return "missing"
    except (OSError, UnsafePathError) as exc:
        return f"unreadable ({exc})"
    try:
        body = os.read(fd, _RECORD_LIMIT)
    except OSError as exc:
        return f"unreadable ({exc})"
    finally:
        os.close(fd)
    try:
        record = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "damaged (not JSON)"
    values = [record.get(k) if isinstance(record, dict) else None
              for k in ("max_bytes", "low_watermark_bytes")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return "damaged (no whole max_bytes and low_watermark_bytes)"
    return values[0], values[1]


def _check(layout: StoreLayout, max_bytes: int, low: int, writers_path: str) -> None:
    recorded = _read(layout)
    path = _cap_path(layout)
    stop_all = (f"stop every writer of this root (`fuser {writers_path}` lists them) and start "
                "them again: the first to start records its cap")
    if isinstance(recorded, str):
        raise SettingsError(
            f"{path}, the cap the live writers of {layout.base} use, is {recorded}, so this "
            f"writer ({_cap_words(max_bytes, low)}) cannot tell whether it agrees with them. "
            f"Fix: {stop_all}")
    if recorded != (max_bytes, low):
        raise SettingsError(
            f"this writer's cap ({_cap_words(max_bytes, low)}) differs from the cap the live "
            f"writers of {layout.base} use, recorded in {path}: {_cap_words(*recorded)}; with "
            "two caps on one store the smaller silently wins. Fix: use the same "
            "SPARKCACHE_MAX_BYTES and SPARKCACHE_LOW_WATERMARK_BYTES on every writer of this "
            "root, or give this one its own SPARKCACHE_NAMESPACE; to change the cap, "
            f"{stop_all}")


def _record(layout: StoreLayout, max_bytes: int, low: int) -> None:
    """Write the record durably: temp file, fsync, rename, fsync ``locks/``. Only one opener
    at a time gets here (``cap.lock``), so the temp name can be fixed; a crash leaves the old
    record or the new one, and at worst a stale temp file the next writer overwrites."""
    before = _read(layout)
    path = _cap_path(layout)
    tmp = path + ".tmp"
    fd = layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fd, json.dumps({"max_bytes": max_bytes, "low_watermark_bytes": low}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    layout.rename(tmp, path)
    layout.fsync_dir(layout.locks_dir)
    if isinstance(before, tuple) and before != (max_bytes, low):
        log.info("sparkcache: %s: no other writer is alive, so this writer's cap (%s) replaces "
                 "the recorded one (%s)", layout.base, _cap_words(max_bytes, low), _cap_words(*before))
    elif isinstance(before, str) and before != "missing":
        log.warning("sparkcache: %s was %s; no other writer is alive, so this writer recorded "
                    "its cap (%s) in its place", path, before, _cap_words(max_bytes, low))
