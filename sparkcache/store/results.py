"""Frozen results that cross the store's API boundary."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from .layout import UnsafePathError
from .locks import LockTimeout
from .manifests import PageRef
from .reasons import Reason

_FIXES = {
    Reason.NO_SPACE: "free space on the filesystem holding the store, or set SPARKCACHE_MAX_BYTES "
              "below its free space",
    Reason.READ_ONLY_FS: "remount the store read-write, or set SPARKCACHE_ACCESS_MODE=restore-only",
    Reason.IO_ERROR: "check the store directory and the disk (dmesg)",
    Reason.LOCK_TIMEOUT: "another process holds the store's lock without progress (stopped? hung "
                  "on a disk?); find it with `fuser <root>/<namespace>/locks/gc.lock`",
    Reason.UNSAFE_PATH: "run `sparkcache verify` and remove the links or files it lists",
}


def os_failure(exc: BaseException) -> tuple[Reason, str]:
    """(reason, detail with the fix) for an error the filesystem or the lock raised."""
    if isinstance(exc, LockTimeout):
        reason = Reason.LOCK_TIMEOUT
    elif isinstance(exc, UnsafePathError):
        reason = Reason.UNSAFE_PATH
    elif getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        reason = Reason.NO_SPACE
    elif getattr(exc, "errno", None) == errno.EROFS:
        reason = Reason.READ_ONLY_FS
    else:
        reason = Reason.IO_ERROR
    return reason, f"{exc}; {_FIXES[reason]}"


@dataclass(frozen=True)
class EntryHandle:
    """What a reader needs to fetch an entry's pages. Page i covers blocks
    ``[i*blocks_per_page, min((i+1)*blocks_per_page, block_count))``."""

    entry_id: str
    identity_digest: str
    block_count: int
    blocks_per_page: int
    pages: tuple[PageRef, ...]
    state: PageRef | None = None  # recurrent state after block_count blocks (hybrid models)


@dataclass(frozen=True)
class LookupResult:
    """``hit_blocks`` > 0 only with ``reason == "hit"``. A miss names its reason:
    ``not_found``, ``corrupt`` or ``absent``; ``detail`` says which file and why."""

    hit_blocks: int
    entry_id: str | None
    reason: Reason
    detail: str = ""
    handle: EntryHandle | None = None
    lease_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", Reason(self.reason))

    @property
    def hit(self) -> bool:
        return self.reason == Reason.HIT and self.hit_blocks > 0


@dataclass(frozen=True)
class ReadResult:
    """Verified page bytes for the first ``blocks`` blocks, or a miss with a reason.
    ``pages`` is empty unless ``reason == "hit"``; bytes are never returned unverified.
    ``pages`` holds one ``bytearray`` per page."""

    reason: Reason
    blocks: int = 0
    blocks_per_page: int = 0
    pages: tuple[bytes, ...] = ()
    bad_digest: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", Reason(self.reason))

    @property
    def ok(self) -> bool:
        return self.reason == Reason.HIT


@dataclass(frozen=True)
class PublishResult:
    """``ok`` False is an expected outcome (``no_space``, ``over_capacity``, ``io_error``,
    ``base_absent``), with the fix in ``detail``; nothing partially published is visible."""

    ok: bool
    reason: Reason
    entry_id: str | None = None
    detail: str = ""
    pages_written: int = 0
    pages_reused: int = 0
    bytes_written: int = 0
    superseded: tuple[str, ...] = ()
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", Reason(self.reason))


@dataclass(frozen=True)
class CapacitySnapshot:
    entries: int
    used_bytes: int
    max_bytes: int
    low_watermark_bytes: int
    bad_manifests: int
    unreadable: int = 0  # paths a listing or read could not learn (see ``EntryIndex.unknown``)

    @property
    def over_max(self) -> bool:
        return self.used_bytes > self.max_bytes


@dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery found: dead publications whose workspaces it removed."""

    stale_publications_removed: int
    entries: int
    bad_manifests: int
