"""The local backend's puts: a publication's objects written to temp files, made durable
together, then each renamed to its name unless the object is there already.

  1. ``add``: the bytes go to a temp file of the publication's staging and their write-back
     is started (at most ``_WRITEBACK_WINDOW`` bytes in flight, so the device queue this
     builds, which every other reader, writer and discarding unlink waits behind, stays
     short); every ``_SYNC_BATCH`` files a round (3, 4) runs. A batch opened ``direct``
     (``put_batch(cached=False)``: a fetch from the shared tier) writes past the page cache
     instead (``direct_writes``: a few files at once from aligned buffers of its own, no
     page-cache pages taken, nothing in write-back) while the filesystem takes O_DIRECT, and
     the usual way from the first file it refuses;
  2. ``flush``: a last round;
  3. a round: one parallel round of fdatasync of its temp files (the filesystem commits them
     in one journal commit; a caller's own fdatasync run beside it joins that commit);
  4. then each is renamed to its object's name with ``rename_if_absent``: an object already
     there whole (another writer was first) is left as it is, and the temp file is the
     staging's to remove; one there of another size, or a link, is replaced; then one
     parallel fsync of the shard directories.
An object is never visible under its name before its bytes are durable, and nothing is ever
rewritten in place.
"""

from __future__ import annotations

import os
import stat

from .backend import NewObject, PutReceipt, TempFiles
from .direct_writes import DirectWrites
from .layout import StoreLayout, close_quietly, start_writeback, sync_all, wait_writeback, write_all
from .manifests import PageRef

_SYNC_BATCH = 64  # temp files written before a round of fdatasync + renames
_WRITEBACK_WINDOW = 8 << 20  # bytes of started write-back a batch keeps in flight


class LocalPutBatch:
    """``backend.PutBatch`` on the local filesystem (see the module docstring). Its syncs run
    on the ``publish`` pool; its writes past the page cache (``direct``) on the ``direct`` pool."""

    def __init__(self, layout: StoreLayout, temps: TempFiles, *, direct: bool = False) -> None:
        self.layout = layout
        self.temps = temps
        self._direct = DirectWrites() if direct else None  # off once the filesystem refuses O_DIRECT
        self._open: list[tuple[int, PageRef, str]] = []  # (fd, object, temp path)
        self._in_flight: list[tuple[int, int]] = []  # (fd, bytes) with write-back started
        self._written: set[str] = set()
        self._present: set[str] = set()
        self._bytes = 0

    def add(self, obj: NewObject) -> None:
        tmp = self.temps.temp_path(obj.ref.digest)
        fd = self.layout.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self._open.append((fd, obj.ref, tmp))
        if self._direct is not None and not self._direct.refused:
            self._direct.start(fd, obj.data)
        else:
            self._write_cached(fd, obj)
        if len(self._open) >= _SYNC_BATCH:
            self._round()

    def _write_cached(self, fd: int, obj: NewObject) -> None:
        write_all(fd, obj.data)
        start_writeback(fd)  # the disk works while the next page is hashed and copied
        self._in_flight.append((fd, obj.ref.size))
        while sum(n for _, n in self._in_flight) > _WRITEBACK_WINDOW:
            wait_writeback(self._in_flight.pop(0)[0])  # bound the device queue we build

    def flush(self) -> PutReceipt:
        try:
            self._round()
        finally:
            self._close_direct()
        return PutReceipt(frozenset(self._written), frozenset(self._present), self._bytes)

    def close(self) -> None:
        """Close what a failed publication left open (abandoned temp files: an error closing
        one changes nothing, and must not replace the publication's own)."""
        self._close_direct()  # no write runs on a descriptor once it is closed
        items, self._open = self._open, []
        self._in_flight.clear()
        for fd, _, _ in items:
            close_quietly(fd)

    def _close_direct(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    def _round(self) -> None:
        """One parallel fdatasync of the open temp files, then their renames and one parallel
        fsync of the shard directories they went to."""
        items, self._open = self._open, []
        self._in_flight.clear()
        if not items:
            return
        try:
            if self._direct is not None:
                self._direct.wait()  # every write done before its file is synced
            sync_all(lambda item: os.fdatasync(item[0]), items, "publish")
        finally:
            _close_all([fd for fd, _, _ in items])  # an error closing one fails the round
        shards = set()
        for _, ref, tmp in items:
            final = self.layout.object_path(ref.digest)
            shards.add(os.path.dirname(final))  # a present one's too: its writer may not have synced it yet
            if self._place(ref, tmp, final):
                self._written.add(ref.digest)
                self._bytes += ref.size
            else:
                self._present.add(ref.digest)
        sync_all(self.layout.fsync_dir, sorted(shards), "publish")

    def _place(self, ref: PageRef, tmp: str, final: str) -> bool:
        """Rename the durable ``tmp`` to ``final``; False when a whole object (a regular file of
        its size) is there already, which stays."""
        if self.layout.rename_if_absent(tmp, final, create_dirs=True):
            return True
        try:
            st = self.layout.lstat(final)
            if stat.S_ISREG(st.st_mode) and st.st_size == ref.size:
                return False
        except FileNotFoundError:
            pass  # removed since (a corrupt one discarded): put it now
        self.layout.rename(tmp, final, create_dirs=True)  # a damaged one is replaced
        return True


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


__all__ = ["LocalPutBatch"]
