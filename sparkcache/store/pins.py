"""Pins (leases): files that protect an entry from eviction while it is read or extended.

``pins/<entry id>.<token>.pin`` records when it was written on the reader's boot clock and
for how long: ``v2 boot=<boot id> at=<CLOCK_BOOTTIME seconds> lease=<seconds>``. A pin from a
process that died simply expires; maintenance removes expired pin files. Pins are created
under the shared gc lock, and eviction reads them under the exclusive lock, so an entry that
was pinned (and still existed when pinned) is never evicted before the pin expires or is
released.

How old a pin is (``clocks`` has the clocks and why): one written on this boot, by its boot
clock reading (exact across processes and containers of one host, immune to wall-clock
steps); one from another boot or host, or in the old format (one number: an expiry in the
writer's Unix time, read during a rolling upgrade), by its mtime's age on the filesystem's
clock when this process first sees it, then by this process's boot clock. A pin that looks
written in the future counts as written when first seen. No wall clock is read.

A pin protects for the lease it records, and never longer than the reader's lease setting
(``lease_seconds``, the maintainer's): a damaged or hostile pin (a lease or boot reading of
1e18, ``inf``, ``nan``, text, a FIFO or a directory) cannot keep an entry forever. A pin
older versions of the store cannot read (this format) is removed by their maintenance as
unreadable; during a rolling upgrade an old maintainer may evict an entry a new reader
holds, whose verified read then misses (absent) and the prefix is recomputed.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Callable

from .clocks import FUTURE_SLACK_S, SYSTEM_CLOCK, Clock
from .layout import StoreLayout, UnsafePathError, is_entry_id

PIN_SUFFIX = ".pin"
_PIN_NAME = re.compile(r"([0-9a-f]{40})\.([0-9a-f]{16})\.pin")
_PIN_TEMP = re.compile(r"[0-9a-f]{40}\.[0-9a-f]{16}\.pin\.tmp")
_PIN_V2 = re.compile(r"v2 boot=([0-9a-f-]{36}|-) at=(\S{1,24}) lease=(\S{1,24})\n?")
_MAX_PIN_BYTES = 128
_TEMP_STALE_S = 60.0  # a pin being written takes microseconds; a temp older is a crash's


@dataclass(frozen=True)
class Pin:
    """A readable pin file: ``boot_id`` None for one from no known boot (the old format),
    ``at`` its writer's boot clock at the write, ``lease`` the seconds it asks for (None:
    the reader's setting), ``mtime`` its file's mtime (the filesystem's clock)."""

    boot_id: str | None
    at: float | None
    lease: float | None
    mtime: float


def create_pin(layout: StoreLayout, entry_id: str, lease_seconds: float,
               clocks: Clock = SYSTEM_CLOCK) -> str:
    """Write a pin; returns its lease id (``<entry id>.<token>``). On any error (a full or
    read-only disk) nothing is left behind and the error propagates."""
    if not is_entry_id(entry_id):
        raise ValueError(f"entry id {entry_id!r} is not a 40-hex-char id")
    lease_id = f"{entry_id}.{secrets.token_hex(8)}"
    path = os.path.join(layout.pins_dir, lease_id + PIN_SUFFIX)
    tmp = path + ".tmp"
    text = f"v2 boot={clocks.boot_id or '-'} at={clocks.boot():.3f} lease={lease_seconds:.3f}\n"
    fd = layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=True)
    try:
        try:
            os.write(fd, text.encode())
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


def read_pin(layout: StoreLayout, name: str) -> Pin | None:
    """The pin file ``name``; None for a file that is not a pin (it protects nothing). A pin
    that cannot be read (EIO, EACCES) raises ``OSError``: what it protects is not known."""
    path = os.path.join(layout.pins_dir, name)
    try:
        fd = layout.open_file(path, os.O_RDONLY)
    except (FileNotFoundError, UnsafePathError):
        return None
    try:
        mtime = os.fstat(fd).st_mtime
        data = os.read(fd, _MAX_PIN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_PIN_BYTES:
        return None
    try:
        text = data.decode("ascii")
        match = _PIN_V2.fullmatch(text)
        if match is None:  # the old format: one number, the writer's Unix time of expiry
            return Pin(None, None, None, mtime) if math.isfinite(float(text.strip())) else None
        at, lease = float(match.group(2)), float(match.group(3))
    except (UnicodeDecodeError, ValueError):
        return None
    if not (math.isfinite(at) and math.isfinite(lease) and at >= 0 and lease >= 0):
        return None
    boot_id = None if match.group(1) == "-" else match.group(1)
    return Pin(boot_id, at, lease, mtime)


def pin_live(pin: Pin, name: str, where: str, lease_seconds: float, clocks: Clock,
             fs_now: Callable[[], float]) -> bool:
    """Whether ``pin`` (the file ``name`` in ``where``) still protects its entry, at most
    ``lease_seconds`` after it was written (see the module docstring). ``fs_now`` returns the
    filesystem's now; called only for a pin not from this boot, at its first sighting."""
    lease = lease_seconds if pin.lease is None else min(pin.lease, lease_seconds)
    if pin.boot_id is not None and pin.boot_id == clocks.boot_id:
        age = clocks.boot() - pin.at
        if age >= -FUTURE_SLACK_S:  # the boot clock never runs back: a later one is forged
            return age < lease
        first_age = lambda: 0.0  # noqa: E731
    else:
        first_age = lambda: min(max(fs_now() - pin.mtime, 0.0), lease)  # noqa: E731
    seen_at, age_then = clocks.sighting(where, name, first_age)
    return age_then + (clocks.boot() - seen_at) < lease


def live_pins(layout: StoreLayout, lease_seconds: float, clocks: Clock = SYSTEM_CLOCK, *,
              now: float | None = None, remove_expired: bool = False,
              probe: bool = True) -> set[str]:
    """Entry ids with at least one unexpired pin. With ``remove_expired`` expired pins and
    pin-named files that are not pins (a FIFO, garbage) are removed (never a directory).
    ``now``: the filesystem's now, when the caller has it (else read when needed, with
    ``probe`` as ``Clock.fs_now`` takes it). A pin that cannot be read protects its entry
    (and stays); a listing of the pins that fails raises ``OSError``: no eviction may rest
    on it."""
    pinned: set[str] = set()
    try:
        names = layout.listdir(layout.pins_dir)
    except UnsafePathError:
        return pinned  # a link or a file in its place: no pin can be there (verify says so)
    fs = [now]

    def fs_now() -> float:
        if fs[0] is None:
            fs[0] = clocks.fs_now(layout, probe=probe)
        return fs[0]

    for name in names:
        match = _PIN_NAME.fullmatch(name)
        if match is None:
            if remove_expired and _PIN_TEMP.fullmatch(name) and _stale_temp(layout, name, fs_now):
                _unlink_quietly(layout, os.path.join(layout.pins_dir, name))  # a crashed writer's
            continue
        try:
            pin = read_pin(layout, name)
        except OSError:
            pinned.add(match.group(1))  # unreadable: it may be live
            continue
        if pin is not None and pin_live(pin, name, layout.pins_dir, lease_seconds, clocks, fs_now):
            pinned.add(match.group(1))
        elif remove_expired:
            _unlink_quietly(layout, os.path.join(layout.pins_dir, name))
    clocks.keep_sightings(layout.pins_dir, set(names))
    return pinned


def _stale_temp(layout: StoreLayout, name: str, fs_now: Callable[[], float]) -> bool:
    """Whether the pins directory's ``name`` was last written over ``_TEMP_STALE_S`` from
    the filesystem's now, either way (a pin being written takes microseconds; one stamped
    far ahead was written before that clock stepped back)."""
    try:
        mtime = layout.lstat(os.path.join(layout.pins_dir, name)).st_mtime
    except (OSError, UnsafePathError):
        return False
    return abs(fs_now() - mtime) > _TEMP_STALE_S


def _unlink_quietly(layout: StoreLayout, path: str) -> None:
    try:
        layout.unlink(path)
    except (OSError, UnsafePathError):
        pass
