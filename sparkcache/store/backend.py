"""The object backend: the one door to the page objects, whatever holds them.

An object is immutable and content-addressed (restic's model): its name is the BLAKE3 of its
bytes (64 lower-case hex characters), and what a manifest records of it (``PageRef``: name,
size, XXH3-128) is enough to verify it. Every part of the store reaches objects through this
interface and takes the backend it is given: publication puts (``put_batch``), the index asks
what is there (``exists``), the collector lists and deletes, readers get. The local
filesystem's backend (``objects.LocalBackend``) is the one the store runs on; it adds doors
of its own for the restore's hot path (reads straight into the caller's buffers) and for
``verify``.

The interface is narrow so that a backend of another kind fits it: the S3 backend
(``s3_backend.S3Backend``) puts with ``If-None-Match: *`` (a 412 is "present": the first writer
won), gets with a GET whose bytes are verified as here, answers ``exists`` with one LIST per
shard of the digests asked, lists with LIST by prefix and deletes with a HEAD (S3's DELETE does
not say what it freed) then DELETE (which succeeds whether or not the object was there). An
object is small enough for one PUT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import blake3
import xxhash

from .manifests import PageRef
from .reasons import Reason

Buffer = bytes | bytearray | memoryview


def digest_of(data: Buffer) -> str:
    """The object name for ``data``: its BLAKE3 hash, 64 lower-case hex characters."""
    return blake3.blake3(data).hexdigest()


def checksum_of(data: Buffer) -> str:
    """What a restore checks ``data`` against: its XXH3-128, 32 lower-case hex characters."""
    return xxhash.xxh3_128_hexdigest(data)


def name_and_checksum(data: Buffer) -> tuple[str, str]:
    """``(digest_of(data), checksum_of(data))``: what a publication records for an object."""
    return digest_of(data), checksum_of(data)


_FIXES = {
    Reason.ABSENT: "the entry naming it is refused; the next capture of its prefix stores it anew",
    Reason.CORRUPT: ("it is never returned; `sparkcache verify` lists it, and a restore that meets "
                     "it removes it so the next capture stores it anew"),
    Reason.IO_ERROR: ("the backend could not be read or changed now; check the disk (dmesg) or "
                      "the service, and the store's permissions, then retry"),
}


class ObjectError(Exception):
    """An object could not be given, or failed verification. ``reason`` is ``absent``
    (missing, or shorter than its recorded size), ``corrupt`` (wrong bytes or size, a link or
    another kind of file where it belongs) or ``io_error`` (it could not be read: EIO,
    EACCES). ``where``: its path or key on the backend."""

    def __init__(self, reason: Reason, digest: str, detail: str, where: str = "") -> None:
        reason = Reason(reason)
        at = f" ({where})" if where else ""
        super().__init__(f"object {digest}: {reason}: {detail}{at}; {_FIXES.get(reason, 'retry')}")
        self.reason = reason
        self.digest = digest
        self.detail = detail
        self.where = where


def hasher_for(ref: PageRef):
    """What a get of ``ref`` hashes the bytes with: the XXH3-128 its manifest records, or
    without one its BLAKE3 (checked against its name)."""
    return blake3.blake3() if ref.checksum is None else xxhash.xxh3_128()


def check_hash(ref: PageRef, hexdigest: str, where: str = "") -> None:
    """``corrupt`` unless ``hexdigest`` (of ``hasher_for(ref)``) is what ``ref`` says."""
    if ref.checksum is None and hexdigest != ref.digest:
        raise ObjectError(Reason.CORRUPT, ref.digest, "bytes do not match their BLAKE3 name", where)
    check_checksum(ref, hexdigest, where)


def check_named(ref: PageRef, made: PageRef, where: str = "") -> None:
    """``corrupt`` unless ``made`` (what ``NewObject.of`` found of some bytes: their BLAKE3
    and XXH3-128) is the object ``ref`` names, with the XXH3-128 its manifest records if any:
    the check of bytes hashed whole anyway, in place of ``hasher_for``'s."""
    if made.digest != ref.digest or made.size != ref.size:
        raise ObjectError(Reason.CORRUPT, ref.digest, "bytes do not match their BLAKE3 name", where)
    check_checksum(ref, made.checksum or "", where)


def check_checksum(ref: PageRef, checksum: str, where: str = "") -> None:
    """``corrupt`` when ``ref`` records an XXH3-128 and ``checksum`` is another."""
    if ref.checksum is not None and checksum != ref.checksum:
        raise ObjectError(Reason.CORRUPT, ref.digest,
                          "bytes do not match the XXH3-128 their manifest records", where)


@dataclass(frozen=True, eq=False)
class NewObject:
    """An object to put: its bytes and what they hash to. Made by ``of`` (which hashes them);
    a backend writes ``data`` under ``ref.digest`` as it is."""

    ref: PageRef
    data: Buffer

    @classmethod
    def of(cls, data: Buffer) -> "NewObject":
        digest, checksum = name_and_checksum(data)
        return cls(PageRef(digest, memoryview(data).nbytes, checksum), data)


@dataclass(frozen=True)
class ObjectStat:
    """An object the backend holds: its name, its size in bytes, and the bytes it takes
    there (the local filesystem counts whole blocks, shared among hard links)."""

    digest: str
    size: int
    stored_bytes: int


@dataclass(frozen=True)
class PutReceipt:
    """What a batch put since it was opened: ``written``, the objects it placed (with their
    bytes, ``bytes_written``); ``present``, those another writer placed first (a put of a
    present object is a no-op: nothing is rewritten)."""

    written: frozenset[str] = frozenset()
    present: frozenset[str] = frozenset()
    bytes_written: int = 0


class TempFiles(Protocol):
    """Where a publication's temporary files go (``staging.Staging``): named after its
    intent, so that what a dead publisher left is found and removed."""

    def temp_path(self, name: str) -> str: ...


class PutBatch(Protocol):
    """Puts of one publication. ``add`` starts an object's put (it may be durable only after
    ``flush``); ``flush`` returns once every object added is durable and in place (a present
    one left as it was) and says what was put; ``close`` abandons what was not flushed (a
    failed publication: its temporary files are its staging's to remove). Nothing added is
    visible under its name before a ``flush`` has placed it whole."""

    def add(self, obj: NewObject) -> None: ...

    def flush(self) -> PutReceipt: ...

    def close(self) -> None: ...


class ObjectBackend(Protocol):
    """The operations every backend gives. Names are object digests (``is_object_digest``);
    a name that is not one is ``UnsafePathError`` (a ValueError). An ``OSError`` (or an
    ``UnsafePathError``) from ``exists`` or a batch means the backend could not be asked:
    nothing may be concluded from it."""

    def exists(self, digests: Iterable[str]) -> dict[str, ObjectStat]:
        """The objects of ``digests`` that the backend holds (a whole one of another size
        included: the caller compares sizes); those absent are left out."""
        ...

    def put_batch(self, temps: TempFiles, *, cached: bool = True) -> PutBatch:
        """A batch of put-if-absent puts, its temporary files (if any) named by ``temps``.
        ``cached=False``: the bytes need not stay in this host's memory (the local backend
        writes them past the page cache where the filesystem allows; a remote one has none)."""
        ...

    def get(self, ref: PageRef) -> bytearray:
        """The object's bytes, verified against ``ref`` (its XXH3-128 when recorded, else its
        BLAKE3 name); ``ObjectError`` rather than bytes that are not verified."""
        ...

    def list(self, prefix: str = "") -> list[ObjectStat]:
        """The objects whose names start with ``prefix`` (lower-case hex)."""
        ...

    def delete(self, digest: str) -> int:
        """Remove the object; the bytes this freed (0 when it was not there: deleting twice is
        no error). ``ObjectError`` when it could not be removed."""
        ...


__all__ = ["Buffer", "NewObject", "ObjectBackend", "ObjectError", "ObjectStat", "PutBatch", "PutReceipt",
           "TempFiles", "check_checksum", "check_hash", "checksum_of", "digest_of", "hasher_for",
           "name_and_checksum"]
