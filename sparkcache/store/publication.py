"""Writing one publication's objects and manifest: hashing overlapped with writing, and as
few journal commits as the crash-safety order allows.

Order (each step durable before the next makes anything visible):
  1. pages are hashed on the I/O pool while this thread writes the pages already hashed:
     per page, under the shared gc lock, its digest is declared in the intent and the object
     is looked up; a missing one is written to a temp file and its write-back is started
     (at most ``_WRITEBACK_WINDOW`` bytes in flight, so the device queue this builds, which
     every other reader, writer and discarding unlink waits behind, stays short);
  2. the manifest (it only needs the digests) is written to a temp file too, and one
     parallel round of fdatasync makes every temp file durable (one journal commit);
  3. the objects are renamed into place and their shard directories fsynced;
  4. only then is the manifest renamed into place and its directory fsynced.
A crash before 4 leaves no manifest (the temp files and renamed objects are garbage that
recovery and maintenance collect); after 4 the entry is complete.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .layout import (close_quietly, parallel_imap, start_writeback, sync_all, wait_writeback,
                     write_all)
from .locks import PUBLISH_WAIT_S, shared_lock
from .manifests import PageRef
from .objects import name_and_checksum
from .staging import Staging
from .streams import PageSourceError, PageStream

if TYPE_CHECKING:
    from .pagestore import PageStore

_SYNC_BATCH = 64  # temp files written before a round of fdatasync + renames
_WRITEBACK_WINDOW = 8 << 20  # bytes of started write-back a publication keeps in flight
_PARALLEL_HASH_BYTES = 1 << 20  # hash pages on the pool above this much data


class BaseObjectGone(Exception):
    """An object of the stored prefix (a page given as None) is no longer on disk."""


class PublicationWriter:
    """Writes the objects of one publication into ``store`` through ``staging``."""

    def __init__(self, store: PageStore, staging: Staging) -> None:
        self.store = store
        self.staging = staging
        self.written_digests: set[str] = set()
        self.bytes_written = 0
        self._open: list[tuple[int, str, str]] = []  # (fd, digest, temp path)
        self._in_flight: list[tuple[int, int]] = []  # (fd, bytes) with write-back started

    def write_pages(self, stream: PageStream, reused: dict[int, PageRef]) -> list[PageRef]:
        """Hash and write the pages of ``stream`` a chunk at a time (a page given as None:
        the ``reused`` ref at that index). Returns the manifest's page refs in order. The last
        sync round is left for ``commit``. A chunk's buffers are done with before the next
        chunk is asked for: ``write_all`` copies them into the page cache."""
        self._declare_reused(list(reused.values()))
        refs: list[PageRef | None] = [reused.get(i) for i in range(len(stream.sizes))]
        seen: set[str] = set()
        for chunk in stream.checked_chunks():
            views = [page for _, page in chunk]
            big = sum(map(len, views)) > _PARALLEL_HASH_BYTES
            digests: Iterator[tuple[str, str]] = (parallel_imap(name_and_checksum, views, "publish") if big
                                                  else map(name_and_checksum, views))
            for (i, page), (digest, checksum) in zip(chunk, digests):
                refs[i] = PageRef(digest, len(page), checksum)
                if digest in seen:
                    continue
                seen.add(digest)
                if self._claim(digest, len(page)):
                    self._write_temp(digest, page)
                    if len(self._open) >= _SYNC_BATCH:
                        self._sync_round()
        done = [r for r in refs if r is not None]
        if len(done) != len(refs):  # checked_chunks and the reused refs cover every index
            raise PageSourceError(f"pages {[i for i, r in enumerate(refs) if r is None]} were never given")
        return done

    def commit(self, manifest_temp: str, manifest_bytes: bytes, manifest_final: str,
               make_identity_dir: Callable[[], list[str]]) -> None:
        """Steps 2-4: the manifest's temp file joins the objects' last fdatasync round; it is
        renamed into place only after the objects' renames are durable."""
        layout = self.store.layout
        fd = layout.open_file(manifest_temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self._open.append((fd, "", manifest_temp))
        write_all(fd, manifest_bytes)
        self._sync_round(extra_dirs=make_identity_dir())
        layout.rename(manifest_temp, manifest_final)
        layout.fsync_dir(os.path.dirname(manifest_final))

    def close(self) -> None:
        """Close what a failed publication left open (abandoned temp files: an error closing
        one changes nothing, and must not replace the publication's own)."""
        items, self._open = self._open, []
        for fd, _, _ in items:
            close_quietly(fd)

    # ------------------------------------------------------------------ steps

    def _declare_reused(self, refs: list[PageRef]) -> None:
        if not refs:
            return
        unique = {r.digest: r for r in refs}
        with shared_lock(self.store.layout, PUBLISH_WAIT_S):
            self.staging.declare(unique)
            for ref in unique.values():
                if not self.store.objects.exists_with_size(ref.digest, ref.size):
                    raise BaseObjectGone(f"object {ref.digest} of the stored prefix is gone "
                                         "(evicted or deleted); publish again with its bytes")

    def _claim(self, digest: str, size: int) -> bool:
        """Declare ``digest`` (so no collector deletes it from now on); True if it must be
        written, False if the object is already there."""
        with shared_lock(self.store.layout, PUBLISH_WAIT_S):
            self.staging.declare((digest,))
            return not self.store.objects.exists_with_size(digest, size)

    def _write_temp(self, digest: str, page: bytes | memoryview) -> None:
        tmp = self.staging.temp_path(digest)
        fd = self.store.layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self._open.append((fd, digest, tmp))
        write_all(fd, page)
        start_writeback(fd)  # the disk works while the next page is hashed and copied
        self.bytes_written += len(page)
        self._in_flight.append((fd, len(page)))
        while sum(n for _, n in self._in_flight) > _WRITEBACK_WINDOW:
            wait_writeback(self._in_flight.pop(0)[0])  # bound the device queue we build

    def _sync_round(self, extra_dirs: Sequence[str] = ()) -> None:
        """One parallel fdatasync of the open temp files, then the objects' renames and one
        parallel fsync of their shard directories (plus ``extra_dirs``)."""
        items, self._open = self._open, []
        self._in_flight.clear()
        try:
            sync_all(lambda item: os.fdatasync(item[0]), items, "publish")
        finally:
            _close_all([fd for fd, _, _ in items])  # an error closing one fails the round
        # the manifest (no digest) is renamed by commit, after this round
        objects = [(digest, tmp) for _, digest, tmp in items if digest]
        dirs = set(extra_dirs) | self.store.objects.place(objects)
        self.written_digests.update(digest for digest, _ in objects)
        sync_all(self.store.layout.fsync_dir, sorted(dirs), "publish")


def _close_all(fds: list[int]) -> None:
    """Close every descriptor, then raise the first error a close returned (none is left
    open by another's error)."""
    first = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            first = first or exc
    if first is not None:
        raise first


__all__ = ["BaseObjectGone", "PublicationWriter"]
