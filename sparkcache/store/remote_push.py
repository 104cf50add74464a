"""One upload of one local entry to the shared tier, in the order that keeps the bucket whole.

  1. the entry's manifest file is read as it is on disk (checked: it decodes to the entry);
  2. each object it names is read from the local store verified (``read_pages``: the manifest's
     XXH3-128, else the BLAKE3 name): bytes that were not checked are never uploaded;
  3. the objects go through the shard's put batch (``S3Backend``: one PUT each with
     ``If-None-Match: *``; a 412 leaves the object the first writer placed), flushed;
  4. only then the manifest is PUT (``If-None-Match: *``): a manifest in the bucket means every
     object it names was there before it;
  5. then a pointer per indexed block key (``remote_keys.pointer_positions``), each PUT with
     ``If-None-Match: *``, so a pointer names the entry uploaded first that holds its key.
A failure anywhere raises: what was PUT before it stays (objects without a manifest, or a
manifest without some pointers) and the next attempt PUTs the rest (every PUT is conditional,
so repeating one is harmless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .backend import NewObject, ObjectError
from .manifests import Manifest, ManifestError, PageRef
from .reasons import Reason
from .remote_bucket import RemoteBucket
from .remote_keys import pointer_positions
from .streams import PageStream


class LocalEntries(Protocol):
    """What the tier asks of the local store (a ``PageStore`` gives it; the tier never imports it)."""

    namespace: str

    def manifest_bytes(self, entry_id: str) -> tuple[Manifest, bytes] | None: ...

    def read_pages(self, refs: Sequence[PageRef], *, parallel: bool = True) -> list[bytearray]: ...

    def entry(self, entry_id: str): ...

    def adopt(self, data: bytes, objects: Sequence[bytearray] | PageStream, *, cached: bool = True): ...


class EntryGone(Exception):
    """The local store no longer holds the entry (evicted, superseded, removed)."""


class EntryUnreadable(Exception):
    """The entry's local manifest or an object failed verification: it is not uploaded."""


@dataclass(frozen=True)
class Pushed:
    """What one upload put: objects PUT (``objects_written``, ``bytes_written``) and found there
    already, whether this upload placed the manifest, and the pointers it placed."""

    entry_id: str
    objects_written: int
    objects_present: int
    bytes_written: int
    manifest_written: bool
    pointers_written: int


def push_entry(local: LocalEntries, bucket: RemoteBucket, entry_id: str) -> Pushed:
    """Upload ``entry_id`` (the module docstring's order). ``EntryGone``, ``EntryUnreadable``;
    an ``OSError`` when the remote store failed (the caller retries)."""
    try:
        found = local.manifest_bytes(entry_id)
    except ManifestError as exc:
        raise EntryUnreadable(f"entry {entry_id}: its local manifest does not decode: {exc}") from None
    if found is None:
        raise EntryGone(entry_id)
    manifest, data = found
    shard = bucket.shard(local.namespace, manifest.identity)
    batch = shard.objects.put_batch(None)
    try:
        for ref in {r.digest: r for r in manifest.objects}.values():
            batch.add(NewObject(ref, _read_verified(local, entry_id, ref)))
        receipt = batch.flush()
    finally:
        batch.close()
    manifest_written = shard.plain.put_new(shard.keys.manifest_key(entry_id), data)
    body = entry_id.encode()
    keys = [shard.keys.pointer_key(manifest.block_keys[p]) for p in pointer_positions(manifest.block_count)]
    placed = shard.objects.each(lambda key: shard.plain.put_new(key, body), keys)
    return Pushed(entry_id, len(receipt.written), len(receipt.present), receipt.bytes_written,
                  manifest_written, sum(placed))


def _read_verified(local: LocalEntries, entry_id: str, ref: PageRef) -> bytearray:
    try:
        return local.read_pages([ref], parallel=False)[0]
    except ObjectError as exc:
        if exc.reason == Reason.ABSENT:
            raise EntryGone(entry_id) from None
        if exc.reason == Reason.CORRUPT:
            raise EntryUnreadable(f"entry {entry_id}: {exc}") from None
        raise OSError(f"entry {entry_id}: the local store could not read an object: {exc}") from None


__all__ = ["EntryGone", "EntryUnreadable", "LocalEntries", "Pushed", "push_entry"]
