"""A snapshot of the view (``journal/snapshot``): what each manifest held when it was written,
so that opening a store of many entries reads each manifest's 71-byte header (its checksum)
instead of reading and decoding it whole (docs/SIZING.md, "A store of 100,000 entries").

A manifest whose header checksum equals the one the snapshot recorded for its entry holds
exactly the body the snapshot was made from (the checksum is the body's sha256), so the
snapshot's copy of it is used; any other manifest (new, replaced, not in the snapshot, or a
snapshot that does not check out) is read and decoded as always. The listing stays the
truth: a snapshot never adds an entry whose manifest is not there, nor keeps one that is gone.

File: ``SPKS1 <sha256 of the body>\\n<body: JSON>``; the body holds the identities, one row per
entry (identity, entry id, the manifest's checksum and bytes, blocks per page, creation time,
block keys, pages, state) and the bytes each object occupied. A snapshot that does not decode
is ignored (and replaced by the next one).

It is written by its own process (``snapshot.main``: ROOT [NAMESPACE] as its arguments,
started by a writer's maintenance thread at most every ``SNAPSHOT_EVERY_S`` when the journal
moved since, at the lowest priority), so the JSON of a large store never holds a serving
process's interpreter lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from .identity import Identity
from .layout import StoreLayout, UnsafePathError, close_quietly, is_object_digest, write_all
from .manifests import HEADER_BYTES, MAGIC as MANIFEST_MAGIC, Manifest, PageRef, header_checksum

MAGIC = b"SPKS1 "
FORMAT = 2  # 2: page refs as manifests hold them (with their XXH3-128)
SNAPSHOT_EVERY_S = 600.0  # a writer asks for a new snapshot at most this often
SNAPSHOT_MIN_ENTRIES = 1000  # a smaller store opens fast enough without one


@dataclass(frozen=True)
class Row:
    manifest: Manifest
    checksum: str  # the manifest's header checksum (64 hex digits)
    declared_bytes: int  # what its pages and state declare, in all (``ManifestLimits``)


class Snapshot:
    """The rows of a snapshot by entry id, and the bytes each object occupied."""

    def __init__(self, rows: dict[str, list], identities: list[Identity], sizes: dict[str, int]) -> None:
        self._rows = rows
        self._identities = identities
        self._digests = [identity.digest() for identity in identities]
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, entry_id: str, header: bytes, identity_digest: str, size: int) -> Row | None:
        """The snapshot's copy of entry ``entry_id`` of ``identity_digest`` if ``header`` (the
        first bytes of its manifest now, of ``size`` bytes in all) carries the checksum it was
        made from; None otherwise (read the manifest). A row that does not check out is never
        used."""
        raw = self._rows.get(entry_id)
        if raw is None or header[: len(MANIFEST_MAGIC)] != MANIFEST_MAGIC or len(header) < HEADER_BYTES:
            return None
        try:  # the rows are what this store's own manifests held (the file's checksum says
            # they are whole): only their shape is checked here, as a manifest's decode checks it
            ident, _, digest, nbytes, bpp, created, keys, pages, state = raw
            if nbytes != size or header_checksum(header) != digest.encode():
                return None
            if (self._digests[ident] != identity_digest or type(keys) is not list or not keys
                    or type(bpp) is not int or bpp < 1 or -(-len(keys) // bpp) != len(pages)):
                return None
            refs = tuple([PageRef(*p) for p in pages])
            declared = sum([r.size for r in refs])
            if state is not None:
                state = PageRef(*state)
                declared += state.size
            manifest = Manifest(entry_id, self._identities[ident], tuple(keys), bpp, refs,
                                float(created), state)
            return Row(manifest, digest, declared)
        except (ValueError, TypeError, IndexError, KeyError):
            return None


def read(layout: StoreLayout) -> Snapshot | None:
    """The store's snapshot, or None (none, unreadable, or not one this sparkcache wrote)."""
    try:
        fd = layout.open_file(layout.snapshot_path, os.O_RDONLY)
    except (OSError, UnsafePathError):
        return None
    try:
        size = os.fstat(fd).st_size
        data = bytearray()
        while len(data) < size:
            chunk = os.read(fd, size - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    finally:
        close_quietly(fd)
    head = len(MAGIC) + 65
    if data[: len(MAGIC)] != MAGIC or data[head - 1: head] != b"\n":
        return None
    body = bytes(data[head:])
    if hashlib.sha256(body).hexdigest().encode() != data[len(MAGIC): head - 1]:
        return None
    try:
        raw = json.loads(body)
        if raw.get("format") != FORMAT:
            return None
        identities = [Identity.from_dict(d) for d in raw["identities"]]
        rows = {row[1]: row for row in raw["rows"]}
        sizes = {d: s for d, s in raw["sizes"].items() if is_object_digest(d) and type(s) is int}
        return Snapshot(rows, identities, sizes)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None


def write(layout: StoreLayout) -> int:
    """List every manifest (as opening the store does) and write the snapshot of what they
    hold; returns how many entries it holds. Raises ``OSError``."""
    from .index import EntryIndex
    from .objects import LocalBackend

    unit = os.statvfs(layout.base).f_frsize or 4096
    index = EntryIndex(layout, unit, objects=LocalBackend(layout, unit))
    index.refresh(full=True)
    identities: dict[Identity, int] = {}
    rows = []
    for entry in index.entries.values():
        m = entry.manifest
        ident = identities.setdefault(m.identity, len(identities))
        rows.append([ident, m.entry_id, entry.checksum, entry.manifest_bytes, m.blocks_per_page,
                     m.created_at, list(m.block_keys), [p.to_json() for p in m.pages],
                     m.state.to_json() if m.state is not None else None])
    body = json.dumps({"format": FORMAT, "identities": [i.to_dict() for i in identities],
                       "rows": rows, "sizes": index.object_size},
                      separators=(",", ":")).encode()
    data = MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    tmp = f"{layout.snapshot_path}.{os.getpid()}.tmp"
    fd = layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_dirs=True)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        layout.rename(tmp, layout.snapshot_path)
    except BaseException:
        try:
            layout.unlink(tmp)
        except (OSError, UnsafePathError):
            pass
        raise
    return len(rows)


class SnapshotWriter:
    """A writer's maintenance thread asks for snapshots through this: at most one process at
    a time, at most every ``SNAPSHOT_EVERY_S``, only for a store of ``SNAPSHOT_MIN_ENTRIES``
    or more whose journal moved since the last one."""

    def __init__(self, layout: StoreLayout, *, min_entries: int = SNAPSHOT_MIN_ENTRIES,
                 every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.layout = layout
        self.min_entries = min_entries
        self.every_s = every_s
        root, namespace = os.path.split(layout.base)
        self._argv = [sys.executable, "-c", "import sys; from sparkcache.store.snapshot import main; "
                      "sys.exit(main())", root, namespace]
        self._proc: subprocess.Popen | None = None
        self._last = -every_s
        self._journal_seen: tuple[int, int] | None = None

    def maybe_start(self, entries: int) -> bool:
        """Start a snapshot's process when one is due; True when it did."""
        if self._proc is not None:
            if self._proc.poll() is None:
                return False
            self._proc = None
        now = time.monotonic()
        if entries < self.min_entries or now - self._last < self.every_s:
            return False
        try:
            st = self.layout.lstat(self.layout.journal_path)
            journal = (st.st_ino, st.st_size)
        except (OSError, UnsafePathError):
            journal = None
        if journal is not None and journal == self._journal_seen:
            return False  # nothing changed since the last one
        self._last, self._journal_seen = now, journal
        try:
            self._proc = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, preexec_fn=_lowest_priority,
                                          close_fds=True)
        except OSError:
            return False
        return True

    def wait(self, timeout: float) -> int | None:
        """Wait for the snapshot's process; its exit code (None: none was started)."""
        return self._proc.wait(timeout) if self._proc is not None else None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


def _lowest_priority() -> None:
    try:
        os.nice(19)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m sparkcache.store.snapshot ROOT [NAMESPACE]", file=sys.stderr)
        return 2
    layout = StoreLayout.create(args[0], args[1] if len(args) > 1 else "default", make=False)
    try:
        write(layout)
    except (OSError, UnsafePathError) as exc:
        print(f"sparkcache snapshot: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
