"""The journal: one append-only file (``journal/current``) of the manifest changes every
process of a store makes, so each process keeps its view current by reading what was
appended since it last looked (one ``fstat`` when nothing changed) instead of re-listing
the manifest directories (docs/SIZING.md, "A store of 100,000 entries").

Records are one line each, ``OP IDENTITY ENTRY\\n`` (76 bytes), written with one ``write``
to a descriptor opened ``O_APPEND`` (atomic against other appenders on a local filesystem):

- ``+``: a manifest was renamed into place (its publisher appends it after the rename and its
  directory's fsync, before it drops its intent, under the shared gc lock);
- ``-``: a manifest was unlinked (the collector, after the unlink, under the exclusive lock);
- ``a``: an entry was accessed (a lookup's hit; its manifest's mtime holds the time);
- ``r``: re-list everything (the identity and entry fields are zeros): a publisher died
  or failed between its manifest's rename and its ``+`` (found as a dead intent, which is
  removed only once this record is appended), so a manifest may exist that no record names.

The journal is a hint of *which* names changed; what a name holds is always read from the
manifest itself. It is never fsynced: after a power loss every process starts again, and
opening a store lists every manifest. A record that does not parse (a torn write) is
ignored; ``+`` and ``-`` are appended under the gc lock, so no rotation loses one.

Rotation: the holder of the exclusive gc lock replaces a journal over ``ROTATE_BYTES`` with an
empty file (temp, rename). A reader notices from its descriptor (no links left, or another
file at the path), reads what is left of the old one, then follows the new one from its start.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from enum import Enum

from .layout import StoreLayout, UnsafePathError

ROTATE_BYTES = 8 << 20  # about 110,000 records
_RECORD = re.compile(rb"([+\-ar]) ([0-9a-f]{32}) ([0-9a-f]{40})")
_ZERO_IDD, _ZERO_ENTRY = "0" * 32, "0" * 40
_RECHECK_PATH_S = 1.0  # how often a reader also compares its descriptor with the path's file
_MAX_READ = 64 << 20  # one poll reads at most this much (a reader far behind catches up in steps)


class Op(str, Enum):
    PUBLISHED = "+"
    REMOVED = "-"
    ACCESSED = "a"
    RESCAN = "r"


@dataclass(frozen=True)
class Record:
    op: Op
    identity_digest: str
    entry_id: str


def rescan() -> Record:
    return Record(Op.RESCAN, _ZERO_IDD, _ZERO_ENTRY)


class JournalError(OSError):
    """The journal cannot be read or written (EIO, EACCES, a link in its place)."""


class Journal:
    """One process's handle on a store's journal: appends, and reads what others appended."""

    def __init__(self, layout: StoreLayout) -> None:
        self.layout = layout
        self.path = layout.journal_path
        self._rfd: int | None = None  # what this process reads, at ``_offset``
        self._ino = -1
        self._offset = 0
        self._checked_path = 0.0

    def close(self) -> None:
        self._close_reader()

    def __del__(self) -> None:  # a store dropped without closing keeps no descriptor
        try:
            self.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ reading

    def end(self) -> None:
        """Skip to the end of what is there now (before a full listing: what is appended from
        here on is read by the next ``poll``). Raises ``JournalError``; a store without a
        journal yet is fine (the first one a writer makes is read from its start)."""
        self._close_reader()
        if self._open_reader():
            self._offset = _fstat(self._rfd, self.path).st_size

    def poll(self) -> list[Record]:
        """The records appended since the last call (oldest first). Raises ``JournalError``
        when the journal cannot be read; a store without one yet has none."""
        if self._rfd is None and not self._open_reader():
            return []
        out: list[Record] = []
        for _ in range(8):  # rotations in a row are rare; each round reads one file to its end
            st = _fstat(self._rfd, self.path)
            out += self._read_new(st.st_size)
            if not self._replaced(st):
                return out
            self._close_reader()
            if not self._open_reader():
                return out
        return out

    def _read_new(self, size: int) -> list[Record]:
        if size <= self._offset:
            return []
        try:
            data = os.pread(self._rfd, min(size - self._offset, _MAX_READ), self._offset)
        except OSError as exc:
            raise JournalError(exc.errno, f"{self.path}: cannot read the journal: {exc.strerror}") from None
        complete = data[: data.rfind(b"\n") + 1]  # a record still being written is read later
        self._offset += len(complete)
        out = []
        for line in complete.split(b"\n"):
            m = _RECORD.fullmatch(line)
            if m is not None:
                out.append(Record(Op(m.group(1).decode()), m.group(2).decode(), m.group(3).decode()))
        return out

    def _replaced(self, st: os.stat_result) -> bool:
        """Whether a rotation replaced the file this process reads (it has no links left, or,
        checked once a second, another file is at the path)."""
        if st.st_nlink == 0:
            return True
        now = time.monotonic()
        if now - self._checked_path < _RECHECK_PATH_S:
            return False
        self._checked_path = now
        try:
            return self.layout.lstat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return False
        except (OSError, UnsafePathError) as exc:
            raise JournalError(getattr(exc, "errno", None) or 5, f"{self.path}: {exc}") from None

    def _open_reader(self) -> bool:
        fd = self._open(os.O_RDONLY, create=False)
        if fd is None:
            return False
        self._rfd, self._offset = fd, 0
        self._ino = _fstat(fd, self.path).st_ino
        self._checked_path = time.monotonic()
        return True

    def _close_reader(self) -> None:
        if self._rfd is not None:
            os.close(self._rfd)
            self._rfd = None

    # ------------------------------------------------------------------ writing

    def create(self) -> None:
        """Make the journal if there is none yet (a writer, when it opens the store), so that
        every reader follows it from before the first record. Raises ``JournalError``."""
        self.append([])

    def append(self, records: list[Record]) -> None:
        """Append records in one write (none: just make sure the journal exists). Raises
        ``JournalError`` (the caller's change must then not become visible: a publication
        fails). The file is opened for each append and closed again: a descriptor open for
        writing would keep the filesystem from being remounted read-only."""
        data = b"".join(f"{r.op.value} {r.identity_digest} {r.entry_id}\n".encode() for r in records)
        fd = self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT, create=True)
        try:
            if data:
                os.write(fd, data)
        except OSError as exc:
            raise JournalError(exc.errno, f"{self.path}: cannot append to the journal: "
                               f"{exc.strerror}") from None
        finally:
            os.close(fd)

    def rotate_if_large(self, limit: int = ROTATE_BYTES) -> bool:
        """[exclusive gc lock] Replace the journal with an empty one when it holds more than
        ``limit`` bytes; True when it did. Best effort (the next pass tries again)."""
        try:
            if self.layout.lstat(self.path).st_size <= limit:
                return False
            tmp = self.path + ".new"
            os.close(self.layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
            self.layout.rename(tmp, self.path)
            return True
        except (OSError, UnsafePathError):
            return False

    def _open(self, flags: int, *, create: bool) -> int | None:
        """A descriptor of the journal; None when there is none and ``create`` is false."""
        try:
            return self.layout.open_file(self.path, flags, create_dirs=create)
        except FileNotFoundError:
            if create:
                raise JournalError(2, f"{self.path}: cannot create the journal") from None
            return None
        except (OSError, UnsafePathError) as exc:
            raise JournalError(getattr(exc, "errno", None) or 5, f"{self.path}: cannot open the "
                               f"journal: {exc}") from None


def _fstat(fd: int, path: str) -> os.stat_result:
    try:
        return os.fstat(fd)
    except OSError as exc:
        raise JournalError(exc.errno, f"{path}: {exc.strerror}") from None


__all__ = ["Journal", "JournalError", "Op", "Record", "ROTATE_BYTES", "rescan"]
