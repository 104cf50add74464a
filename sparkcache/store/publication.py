"""Writing one publication's objects and manifest: hashing overlapped with writing, and as
few journal commits as the crash-safety order allows.

Order (each step durable before the next makes anything visible):
  1. pages are hashed on the I/O pool while this thread hands the pages already hashed to
     the object backend's put batch: per page, under the shared gc lock, its digest is
     declared in the intent and the backend is asked whether it holds the object; a missing
     one is added to the batch (``local_puts.py``: a temp file of this publication's staging,
     its write-back started, a sync round every so many);
  2. the manifest (it only needs the digests) is written to a temp file too, and its
     fdatasync runs beside the batch's last round (one journal commit);
  3. the batch's flush returns once every object is durable and in place (their shard
     directories fsynced);
  4. only then is the manifest renamed into place and its directory fsynced.
A crash before 4 leaves no manifest (the temp files and renamed objects are garbage that
recovery and maintenance collect); after 4 the entry is complete.

The writer takes the parts it uses: the store's layout (the manifest's files, the gc lock),
the object backend and the publication's staging; never the whole store.
"""

from __future__ import annotations

import os
from concurrent.futures import wait
from typing import Callable, Iterator

from .backend import NewObject, ObjectBackend, PutReceipt
from .layout import StoreLayout, close_quietly, parallel_imap, submit, write_all
from .locks import PUBLISH_WAIT_S, shared_lock
from .manifests import PageRef
from .staging import Staging
from .streams import PageSourceError, PageStream

_PARALLEL_HASH_BYTES = 1 << 20  # hash pages on the pool above this much data


class BaseObjectGone(Exception):
    """An object of the stored prefix (a page given as None) is no longer on disk."""


class PublicationWriter:
    """Writes the objects of one publication to ``objects`` and its manifest under
    ``layout``, through ``staging`` (``cached``: ``ObjectBackend.put_batch``'s)."""

    def __init__(self, layout: StoreLayout, objects: ObjectBackend, staging: Staging,
                 pace: Callable[[], None] | None = None, *, cached: bool = True) -> None:
        self.layout = layout
        self.objects = objects
        self.staging = staging
        self.pace = pace or (lambda: None)  # called before each chunk is hashed and each page put; may wait
        self.batch = objects.put_batch(staging, cached=cached)
        self.receipt = PutReceipt()  # what the batch put, once committed
        self.placing = False  # whether the manifest's rename was attempted

    def write_pages(self, stream: PageStream, reused: dict[int, PageRef]) -> list[PageRef]:
        """Hash and put the pages of ``stream`` a chunk at a time (a page given as None:
        the ``reused`` ref at that index; one given hashed, a ``NewObject``, as it is). Returns
        the manifest's page refs in order. The
        batch's last round is left for ``commit``. A chunk's buffers are done with before the
        next chunk is asked for: the batch's ``add`` copies them (into the page cache, or into
        a buffer of its own: ``cached=False``)."""
        self._declare_reused(list(reused.values()))
        refs: list[PageRef | None] = [reused.get(i) for i in range(len(stream.sizes))]
        seen: set[str] = set()
        for chunk in stream.checked_chunks():
            self.pace()
            views = [page for _, page in chunk if not isinstance(page, NewObject)]
            big = sum(map(len, views)) > _PARALLEL_HASH_BYTES
            hashed: Iterator[NewObject] = (parallel_imap(NewObject.of, views, "publish") if big
                                           else map(NewObject.of, views))
            made = (page if isinstance(page, NewObject) else next(hashed) for _, page in chunk)
            for (i, _), obj in zip(chunk, made):
                refs[i] = obj.ref
                if obj.ref.digest in seen:
                    continue
                seen.add(obj.ref.digest)
                self.pace()
                if self._claim(obj.ref):
                    self.batch.add(obj)
            chunk = views = hashed = made = obj = None  # nothing of a chunk is held while the next is asked for
        done = [r for r in refs if r is not None]
        if len(done) != len(refs):  # checked_chunks and the reused refs cover every index
            raise PageSourceError(f"pages {[i for i, r in enumerate(refs) if r is None]} were never given")
        return done

    def commit(self, manifest_temp: str, manifest_bytes: bytes, manifest_final: str,
               make_identity_dir: Callable[[], list[str]]) -> None:
        """Steps 2-4: the manifest's temp file is made durable beside the batch's last round
        (and a new identity directory's parent beside it); it is renamed into place only
        after the objects are durable and in place."""
        layout = self.layout
        fd = layout.open_file(manifest_temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, manifest_bytes)
            beside = [submit(os.fdatasync, fd, pool="publish")]
            try:
                beside += [submit(layout.fsync_dir, d, pool="publish") for d in make_identity_dir()]
                self.receipt = self.batch.flush()
            finally:
                wait(beside)  # none still runs on the descriptor once it is closed
            for done in beside:
                done.result()
        except BaseException:
            close_quietly(fd)
            raise
        os.close(fd)  # an error closing it fails the publication
        self.placing = True  # from here a failure may leave the manifest in place
        layout.rename(manifest_temp, manifest_final)
        layout.fsync_dir(os.path.dirname(manifest_final))

    def close(self) -> None:
        """Abandon what a failed publication left unflushed (its temp files are the
        staging's to remove)."""
        self.batch.close()

    # ------------------------------------------------------------------ steps

    def _declare_reused(self, refs: list[PageRef]) -> None:
        if not refs:
            return
        unique = {r.digest: r for r in refs}
        with shared_lock(self.layout, PUBLISH_WAIT_S):
            self.staging.declare(unique)
            held = self.objects.exists(unique)
            for ref in unique.values():
                found = held.get(ref.digest)
                if found is None or found.size != ref.size:
                    raise BaseObjectGone(f"object {ref.digest} of the stored prefix is gone "
                                         "(evicted or deleted); publish again with its bytes")

    def _claim(self, ref: PageRef) -> bool:
        """Declare ``ref``'s object (so no collector deletes it from now on); True if it must
        be put, False if the backend holds it whole already."""
        with shared_lock(self.layout, PUBLISH_WAIT_S):
            self.staging.declare((ref.digest,))
            found = self.objects.exists((ref.digest,)).get(ref.digest)
        return found is None or found.size != ref.size


__all__ = ["BaseObjectGone", "PublicationWriter"]
