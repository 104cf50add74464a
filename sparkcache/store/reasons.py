"""Why a store lookup, read or publication ended as it did: one enum for every part of the store.

A reason's value is its metric label (``vllm:sparkcache_lookup_misses{reason=...}`` and
``..._publish_failures{reason=...}``, shipped by the connector as ``lookup_miss_<reason>`` and
``publish_failed_<reason>``; ``sparkcache/metrics.py``) and what JSON output prints; being a
``str``, it compares equal to that value.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # Lookups and reads.
    HIT = "hit"
    NOT_FOUND = "not_found"  # no entry under these keys
    CORRUPT = "corrupt"  # bytes or a manifest that fail verification
    ABSENT = "absent"  # a file the entry names is missing or truncated
    # Publications.
    PUBLISHED = "published"
    OVER_CAPACITY = "over_capacity"
    LOW_FREE_SPACE = "low_free_space"  # the filesystem's free space under SPARKCACHE_MIN_FREE_BYTES
    BASE_ABSENT = "base_absent"
    SOURCE_FAILED = "source_failed"  # a streamed capture's copy failed or outlived its blocks' lease
    # Both: the filesystem or a stuck process stopped the operation (a lookup then misses).
    NO_SPACE = "no_space"  # ENOSPC, EDQUOT
    READ_ONLY_FS = "read_only_fs"  # EROFS
    IO_ERROR = "io_error"  # EIO, EACCES and any other OS error: the file may be fine, it cannot be read now
    LOCK_TIMEOUT = "lock_timeout"  # the gc lock stayed held past the wait bound
    UNSAFE_PATH = "unsafe_path"  # a link or a wrong file kind where a store directory belongs


PUBLISH_FAILURES = (Reason.OVER_CAPACITY, Reason.LOW_FREE_SPACE, Reason.BASE_ABSENT, Reason.SOURCE_FAILED,
                    Reason.NO_SPACE, Reason.READ_ONLY_FS, Reason.IO_ERROR, Reason.LOCK_TIMEOUT, Reason.UNSAFE_PATH)
LOOKUP_MISSES = (Reason.NOT_FOUND, Reason.CORRUPT, Reason.ABSENT, Reason.NO_SPACE, Reason.READ_ONLY_FS,
                 Reason.IO_ERROR, Reason.LOCK_TIMEOUT, Reason.UNSAFE_PATH)
