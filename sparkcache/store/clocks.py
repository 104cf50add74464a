"""Time in a store that processes share while their wall clocks disagree or step.

No decision of the store trusts a process's wall clock (``time.time``: another host's may be
minutes or years off, and any may be stepped by NTP or an operator). It reads two others:

* the **boot clock**: ``CLOCK_BOOTTIME`` (seconds since the kernel booted, suspend included;
  never stepped) with the kernel's boot id (``/proc/sys/kernel/random/boot_id``). Two
  readings with the same boot id come from one kernel and compare exactly, whatever any wall
  clock did meanwhile. Containers on one host share both (a time namespace's boottime offset,
  ``/proc/self/timens_offsets``, is taken back out). After a reboot, or on another host, the
  boot id differs and the readings do not compare.
* the **filesystem's clock**: the one that stamps mtimes (the local kernel's wall clock; on
  NFS, the server's). Files are stamped by it alone: a write, and an access recorded with
  ``utimensat(UTIME_NOW)`` (``StoreLayout.touch`` without a time), never a time a process
  read from its own clock. A process learns the filesystem's "now" by stamping the pins
  directory that way and reading its mtime back (``Clock.fs_now``), so neither its own wall
  clock nor the writer's matters; between such probes it advances the last reading by its
  boot clock.

What each decision reads (``pins``, ``catalog``, ``maintenance``):

* a pin written on this boot: its age on the boot clock (``boot now - boot at write``), so
  no wall-clock step, on the reader or the maintainer, shortens or lengthens a lease;
* a pin from another boot (another host, a reboot) or in the old one-number format: its age
  on the filesystem's clock (``filesystem now - mtime``) when this process first sees it,
  then advanced by this process's boot clock, so a later step of the filesystem's clock does
  not change it. A pin whose write looks in the future (a clock stepped back, a forged mtime
  or boot reading) counts as written when first seen: it protects for one lease of this
  process's own observation, never forever and never not at all. The one window left: a
  pin first seen after the filesystem's clock stepped forward past its lease is expired;
* recency (LRU, TTL): a manifest's mtime, stamped by the filesystem's clock, against the
  filesystem's now; an mtime in the future counts as now and a pass re-stamps it with the
  kernel's time (``Catalog.refresh_recency``), so it ages from there and no clock far ahead
  makes an entry immune to the TTL.

``Clock`` is the one seam: a test gives a reader and a maintainer different ones (a wall
clock off by an hour, another boot id, a boot clock moved on) against real files.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from .layout import StoreLayout, UnsafePathError

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
FUTURE_SLACK_S = 5.0  # an mtime further ahead of the filesystem's now was not stamped by it
PROBE_EVERY_S = 60.0  # a filesystem reading is re-taken after this long on the boot clock


def read_boot_id(path: str = BOOT_ID_PATH) -> str | None:
    """The kernel's boot id (a UUID, new at every boot); None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 36 and all(c in "0123456789abcdef-" for c in text) else None


def _boottime_offset(path: str = "/proc/self/timens_offsets") -> float:
    """This time namespace's CLOCK_BOOTTIME offset (0 outside a time namespace)."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] in ("boottime", "7"):
                    return int(parts[1]) + int(parts[2]) / 1e9
    except (OSError, ValueError):
        pass
    return 0.0


class Clock:
    """One process's clocks: ``wall()`` (reports only), ``boot()`` with ``boot_id``, and
    ``fs_now(layout)``; plus what this process has observed of pins (``sighting``).
    Thread-safe. ``wall``, ``boot`` and ``boot_id`` are injectable (tests); by default the
    real ones (``boot_id="read"``: read from the kernel; None: no known boot)."""

    def __init__(self, wall: Callable[[], float] | None = None,
                 boot: Callable[[], float] | None = None, boot_id: str | None = "read") -> None:
        self._wall = wall if wall is not None else (lambda: time.time())
        if boot is None and hasattr(time, "CLOCK_BOOTTIME"):
            offset = _boottime_offset()
            boot = lambda: time.clock_gettime(time.CLOCK_BOOTTIME) - offset  # noqa: E731
        elif boot is None:  # not Linux: a monotonic clock, no boot id (every pin is foreign)
            boot, boot_id = time.monotonic, None
        self._boot = boot
        self.boot_id = read_boot_id() if boot_id == "read" else boot_id
        self._lock = threading.Lock()
        self._probes: dict[str, tuple[float, float]] = {}  # store -> (fs reading, boot then)
        self._sightings: dict[str, dict[str, tuple[float, float]]] = {}

    def wall(self) -> float:
        return self._wall()

    def boot(self) -> float:
        return self._boot()

    def fs_now(self, layout: StoreLayout, *, fresh: bool = False, probe: bool = True,
               required: bool = False) -> float:
        """The filesystem's now under ``layout``: the pins directory stamped with the
        kernel's time and read back (``fresh``: always; otherwise when the last reading is
        over ``PROBE_EVERY_S`` old), else the last reading advanced by the boot clock. With
        ``probe`` false (a reader that writes nothing), or when the stamp fails (a read-only
        or failing disk), the last reading; without one, this process's wall clock.
        ``required`` (with ``fresh``: for a decision that deletes, a maintenance pass): the
        stamp's I/O error is raised instead, so that no deletion rests on a wall clock, nor
        on an older reading that has not seen a step of the filesystem's clock since."""
        boot = self.boot()
        with self._lock:
            last = self._probes.get(layout.base)
        estimate = None if last is None else last[0] + (boot - last[1])
        if probe and (fresh or estimate is None or boot - last[1] > PROBE_EVERY_S):
            try:
                reading = layout.touch(layout.pins_dir)
            except (OSError, UnsafePathError):  # a failing disk; a link or a file in its place
                if required:
                    raise
            else:
                with self._lock:
                    self._probes[layout.base] = (reading, self.boot())
                return reading
        return self.wall() if estimate is None else estimate

    def sighting(self, where: str, name: str, age: Callable[[], float]) -> tuple[float, float]:
        """(boot reading, age then) of this process's first sighting of pin ``name`` in
        ``where``; ``age`` is called once, at the first sighting."""
        with self._lock:
            found = self._sightings.get(where, {}).get(name)
        if found is None:
            first = (self.boot(), age())
            with self._lock:
                found = self._sightings.setdefault(where, {}).setdefault(name, first)
        return found

    def keep_sightings(self, where: str, names: set[str]) -> None:
        """Forget the sightings of pins in ``where`` that are gone (not in ``names``)."""
        with self._lock:
            seen = self._sightings.get(where)
            if seen:
                for name in [n for n in seen if n not in names]:
                    del seen[name]


SYSTEM_CLOCK = Clock()  # this process's real clocks


__all__ = ["Clock", "FUTURE_SLACK_S", "SYSTEM_CLOCK", "read_boot_id"]
