"""Pins (leases): files that protect an entry from eviction while it is read or extended.

``pins/<entry id>.<token>.pin`` holds its expiry as Unix time. A pin from a process that
died simply expires; maintenance removes expired pin files. Pins are created under the
shared gc lock, and eviction reads them under the exclusive lock, so an entry that was
pinned (and still existed when pinned) is never evicted before the pin expires or is released.

A pin never protects for longer than the reader's lease setting after it was written (its
file's mtime): a damaged or hostile pin (an expiry of 1e18, ``inf``, ``nan``, text, a FIFO
or a directory) cannot keep an entry forever.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import time

from .layout import StoreLayout, UnsafePathError, is_entry_id

PIN_SUFFIX = ".pin"
_PIN_NAME = re.compile(r"([0-9a-f]{40})\.([0-9a-f]{16})\.pin")
_PIN_TEMP = re.compile(r"[0-9a-f]{40}\.[0-9a-f]{16}\.pin\.tmp")
_MAX_PIN_BYTES = 64
_CLOCK_SLACK_S = 60.0  # a pin written "in the future" by more than this is not trusted


def create_pin(layout: StoreLayout, entry_id: str, lease_seconds: float) -> str:
    """Write a pin; returns its lease id (``<entry id>.<token>``). On any error (a full or
    read-only disk) nothing is left behind and the error propagates."""
    if not is_entry_id(entry_id):
        raise ValueError(f"entry id {entry_id!r} is not a 40-hex-char id")
    lease_id = f"{entry_id}.{secrets.token_hex(8)}"
    path = os.path.join(layout.pins_dir, lease_id + PIN_SUFFIX)
    tmp = path + ".tmp"
    fd = layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=True)
    try:
        try:
            os.write(fd, f"{time.time() + lease_seconds:.3f}\n".encode())
        finally:
            os.close(fd)
        layout.rename(tmp, path)
    except BaseException:
        _unlink_quietly(layout, tmp)
        raise
    return lease_id


def release_pin(layout: StoreLayout, lease_id: str) -> bool:
    """Remove a pin; False when it was gone already or ``lease_id`` is not one ``create_pin``
    made (nothing is removed then)."""
    if not isinstance(lease_id, str) or _PIN_NAME.fullmatch(lease_id + PIN_SUFFIX) is None:
        return False
    try:
        return layout.unlink(os.path.join(layout.pins_dir, lease_id + PIN_SUFFIX))
    except (OSError, UnsafePathError):
        return False  # expires on its own


def pin_expiry(layout: StoreLayout, name: str, lease_seconds: float, now: float) -> float | None:
    """When the pin file ``name`` stops protecting its entry (at most ``lease_seconds``
    after it was written); None for a file that is not a pin (it protects nothing). A pin
    that cannot be read (EIO, EACCES) raises ``OSError``: what it protects is not known."""
    path = os.path.join(layout.pins_dir, name)
    try:
        fd = layout.open_file(path, os.O_RDONLY)
    except (FileNotFoundError, UnsafePathError):
        return None
    try:
        written = os.fstat(fd).st_mtime
        text = os.read(fd, _MAX_PIN_BYTES + 1)
    finally:
        os.close(fd)
    try:
        recorded = float(text.decode("ascii").strip()) if len(text) <= _MAX_PIN_BYTES else math.nan
    except (UnicodeDecodeError, ValueError):
        return None
    if not math.isfinite(recorded) or written > now + _CLOCK_SLACK_S:
        return None
    return min(recorded, written + lease_seconds)


def live_pins(layout: StoreLayout, lease_seconds: float, now: float | None = None, *,
              remove_expired: bool = False) -> set[str]:
    """Entry ids with at least one unexpired pin. With ``remove_expired`` expired pins and
    pin-named files that are not pins (a FIFO, garbage) are removed (never a directory).
    A pin that cannot be read protects its entry (and stays); a listing of the pins that
    fails raises ``OSError``: no eviction may rest on it."""
    now = time.time() if now is None else now
    pinned: set[str] = set()
    try:
        names = layout.listdir(layout.pins_dir)
    except UnsafePathError:
        return pinned  # a link or a file in its place: no pin can be there (verify says so)
    for name in names:
        match = _PIN_NAME.fullmatch(name)
        if match is None:
            if remove_expired and _PIN_TEMP.fullmatch(name) and _older_than(layout, name, now):
                _unlink_quietly(layout, os.path.join(layout.pins_dir, name))  # a crashed writer's
            continue
        try:
            expires = pin_expiry(layout, name, lease_seconds, now)
        except OSError:
            pinned.add(match.group(1))  # unreadable: it may be live
            continue
        if expires is not None and expires > now:
            pinned.add(match.group(1))
        elif remove_expired:
            _unlink_quietly(layout, os.path.join(layout.pins_dir, name))
    return pinned


def _older_than(layout: StoreLayout, name: str, now: float) -> bool:
    """Whether the pins directory's ``name`` was last written over a clock slack ago (a pin
    being written takes microseconds)."""
    try:
        return layout.lstat(os.path.join(layout.pins_dir, name)).st_mtime < now - _CLOCK_SLACK_S
    except (OSError, UnsafePathError):
        return False


def _unlink_quietly(layout: StoreLayout, path: str) -> None:
    try:
        layout.unlink(path)
    except (OSError, UnsafePathError):
        pass
