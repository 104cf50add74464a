"""Frozen results that cross the store's API boundary."""

from __future__ import annotations

from dataclasses import dataclass

from .manifests import PageRef

# Lookup / read reasons.
HIT = "hit"
NOT_FOUND = "not_found"
CORRUPT = "corrupt"
ABSENT = "absent"

# Publication reasons.
PUBLISHED = "published"
NO_SPACE = "no_space"
OVER_CAPACITY = "over_capacity"
IO_ERROR = "io_error"
BASE_ABSENT = "base_absent"


@dataclass(frozen=True)
class EntryHandle:
    """What a reader needs to fetch an entry's pages. Page i covers blocks
    ``[i*blocks_per_page, min((i+1)*blocks_per_page, block_count))``."""

    entry_id: str
    identity_digest: str
    block_count: int
    blocks_per_page: int
    pages: tuple[PageRef, ...]


@dataclass(frozen=True)
class LookupResult:
    """``hit_blocks`` > 0 only with ``reason == "hit"``. A miss names its reason:
    ``not_found``, ``corrupt`` or ``absent``; ``detail`` says which file and why."""

    hit_blocks: int
    entry_id: str | None
    reason: str
    detail: str = ""
    handle: EntryHandle | None = None
    lease_id: str | None = None

    @property
    def hit(self) -> bool:
        return self.reason == HIT and self.hit_blocks > 0


@dataclass(frozen=True)
class ReadResult:
    """Verified page bytes for the first ``blocks`` blocks, or a miss with a reason.
    ``pages`` is empty unless ``reason == "hit"``; bytes are never returned unverified.
    ``pages`` holds ``bytes``, or read-only ``mmap`` objects from ``read(..., mapped=True)``."""

    reason: str
    blocks: int = 0
    blocks_per_page: int = 0
    pages: tuple[bytes, ...] = ()
    bad_digest: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason == HIT


@dataclass(frozen=True)
class PublishResult:
    """``ok`` False is an expected outcome (``no_space``, ``over_capacity``, ``io_error``,
    ``base_absent``), with the fix in ``detail``; nothing partially published is visible."""

    ok: bool
    reason: str
    entry_id: str | None = None
    detail: str = ""
    pages_written: int = 0
    pages_reused: int = 0
    bytes_written: int = 0
    superseded: tuple[str, ...] = ()
    duration_s: float = 0.0


@dataclass(frozen=True)
class CapacitySnapshot:
    entries: int
    used_bytes: int
    max_bytes: int
    low_watermark_bytes: int
    bad_manifests: int

    @property
    def over_max(self) -> bool:
        return self.used_bytes > self.max_bytes


@dataclass(frozen=True)
class RecoveryReport:
    """What startup recovery found: dead publications whose workspaces it removed."""

    stale_publications_removed: int
    entries: int
    bad_manifests: int
