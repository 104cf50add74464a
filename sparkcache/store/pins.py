"""Pins (leases): files that protect an entry from eviction while it is read or extended.

``pins/<entry id>.<token>.pin`` holds its expiry as Unix time. A pin from a process that
died simply expires; maintenance removes expired pin files. Pins are created under the
shared gc lock, and eviction reads them under the exclusive lock, so an entry that was
pinned (and still existed when pinned) is never evicted before the pin expires or is released.
"""

from __future__ import annotations

import os
import secrets
import time

from .layout import is_entry_id

PIN_SUFFIX = ".pin"


def create_pin(pins_dir: str, entry_id: str, lease_seconds: float) -> str:
    """Write a pin; returns its lease id (``<entry id>.<token>``)."""
    if not is_entry_id(entry_id):
        raise ValueError(f"entry id {entry_id!r} is not a 40-hex-char id")
    lease_id = f"{entry_id}.{secrets.token_hex(8)}"
    path = os.path.join(pins_dir, lease_id + PIN_SUFFIX)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{time.time() + lease_seconds:.3f}\n")
    os.rename(tmp, path)
    return lease_id


def release_pin(pins_dir: str, lease_id: str) -> bool:
    entry_id, _, token = lease_id.partition(".")
    if not is_entry_id(entry_id) or not token.isalnum():
        raise ValueError(f"lease id {lease_id!r} was not made by create_pin")
    try:
        os.unlink(os.path.join(pins_dir, lease_id + PIN_SUFFIX))
        return True
    except FileNotFoundError:
        return False


def live_pins(pins_dir: str, now: float | None = None, *, remove_expired: bool = False) -> set[str]:
    """Entry ids with at least one unexpired pin."""
    now = time.time() if now is None else now
    pinned: set[str] = set()
    try:
        names = os.listdir(pins_dir)
    except FileNotFoundError:
        return pinned
    for name in names:
        if not name.endswith(PIN_SUFFIX):
            continue
        path = os.path.join(pins_dir, name)
        try:
            with open(path) as f:
                expires = float(f.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            continue
        if expires > now:
            pinned.add(name.split(".", 1)[0])
        elif remove_expired:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return pinned
