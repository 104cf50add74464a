"""What one namespace of the shared tier holds, as the capacity sweeper sees it: every identity's
manifests (read and decoded), access marks, pointers and objects under ``P/NS/`` (the key names:
``remote_keys``), each with its size and LastModified.

Every identity's manifests, access marks and pointers are listed first, then every identity's
objects (a unit's objects are under its rank 0's digest, named by the manifests of all its ranks:
``remote_keys``). An upload PUTs its objects before its manifest and its pointers after it, so
every manifest this census lists had all its objects in the bucket before the objects' listing
began: an object it names that the listing lacks is missing (the entry is incomplete), not on
its way.

Deletion only on positive knowledge: a listing that failed, or a manifest that could not be read
or decoded, goes into ``unknown`` (with the key, why, and the fix), and the census stops there; a
sweeper given a census with anything unknown deletes nothing. A manifest listed and then gone
(404) was deleted meanwhile (another sweeper): it is left out, as it would be a moment later.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import errno
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from .manifests import MAX_MANIFEST_BYTES, ManifestError, PageRef, decode
from .reasons import Reason
from .remote_bucket import RemoteBucket
from .remote_keys import KeyKind, RemoteKeys, namespace_prefix, parse_key, pointer_name, pointer_positions
from .s3_backend import each_in_flight
from .s3_errors import describe
from .s3_location import S3Location


@dataclass(frozen=True)
class Listed:
    """A key as a listing gave it: its size in bytes and its LastModified (seconds since the
    epoch, the object store's clock)."""

    key: str
    size: int
    modified: float


class SweepRequests:
    """The sweeper's requests of the tier's bucket (``remote_bucket.RemoteBucket``: one client of
    ``location``, whose ``prefix`` is ``P``; its plain keys ``s3_keys.S3Keys``): list (with
    LastModified), the identities under a namespace, get, put, delete by key,
    ``requests_in_flight`` at once. A failed request is an ``OSError`` naming the key and the fix
    (``s3_errors.describe``), never holding a credential."""

    def __init__(self, location: S3Location) -> None:
        self.bucket = RemoteBucket(location)
        self.location = location
        self._keys = self.bucket.plain
        self._pool = ThreadPoolExecutor(location.requests_in_flight, thread_name_prefix="sparkcache-remote-gc")

    def __repr__(self) -> str:
        return f"SweepRequests({self.location!r})"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.bucket.close()

    def list(self, prefix: str) -> list[Listed]:
        """Every key under ``prefix`` (ending in '/'), in key order."""
        return [Listed(k.key, k.size, k.last_modified.timestamp()) for k in self._keys.list(prefix)]

    def folders(self, prefix: str) -> list[str]:
        """The names one level under ``prefix`` (ending in '/') that hold keys."""
        import obstore
        from obstore.exceptions import BaseError

        try:
            found = obstore.list_with_delimiter(self.bucket.client, prefix)
        except (BaseError, OSError, ValueError) as exc:
            raise describe(exc, self.location).os_error(f"LIST of {self.location.where(prefix)}") from None
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]

    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The key's bytes, or None when it is not there; ``OSError`` (EFBIG) past ``max_bytes``."""
        return self._keys.get(key, max_bytes)

    def put(self, key: str, data: bytes, replace: bool) -> None:
        """PUT ``data`` at ``key``: replacing what is there, or (not ``replace``) with
        ``If-None-Match: *``, leaving what another writer put first."""
        if replace:
            self._keys.put(key, data)
        else:
            self._keys.put_new(key, data)

    def delete(self, key: str) -> None:
        """DELETE ``key`` (no error when it is not there)."""
        self._keys.delete(key)

    def each(self, fn: Callable, items: list) -> list:
        """``[fn(item) for item in items]``, ``requests_in_flight`` at once (``each_in_flight``:
        after a failure the calls not begun are not made; the first failure is raised once every
        call begun has ended)."""
        return each_in_flight(self._pool, fn, items)


@dataclass(frozen=True)
class RemoteEntry:
    """An entry whose manifest the census read: its shard's keys, its manifest's and access
    mark's listings, the objects it names and the names of its pointers (its indexed block
    keys)."""

    keys: RemoteKeys
    entry_id: str
    manifest: Listed
    access: Listed | None
    objects: frozenset[str]
    object_refs: tuple[PageRef, ...]
    pointer_names: tuple[str, ...]

    @property
    def object_names(self) -> frozenset[Named]:
        """Its objects as the census names them: under its unit's digest."""
        return frozenset((self.keys.unit_digest, d) for d in self.objects)

    @property
    def last_access(self) -> float:
        """The last remote fetch's time (its access mark), else its upload's (its manifest)."""
        return max(self.manifest.modified, self.access.modified if self.access else 0.0)


# A key of one identity: (identity digest, name: a pointer's name, an entry id), or of one unit:
# (unit digest, an object's digest).
Named = tuple[str, str]


@dataclass(frozen=True)
class Census:
    """One namespace's keys (see the module docstring). ``unknown``: what could not be listed
    or read, each naming the key, why and the fix; when not empty nothing may be deleted."""

    namespace_prefix: str
    entries: tuple[RemoteEntry, ...]
    objects: Mapping[Named, Listed]
    pointers: Mapping[Named, Listed]
    access_marks: Mapping[Named, Listed]
    foreign_keys: int
    unknown: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.unknown

    @property
    def used_bytes(self) -> int:
        """The bytes the namespace's objects take (manifests, pointers and marks are not counted)."""
        return sum(listed.size for listed in self.objects.values())


@dataclass(frozen=True)
class CensusSummary:
    """What ``remote-status`` prints: the objects' bytes against the bound, the entries (those
    whose objects are incomplete among them), the oldest and newest last access, the objects no
    manifest references (and those of them younger than the grace: uploads in progress)."""

    used_bytes: int
    max_bytes: int
    identities: int
    entries: int
    incomplete_entries: int
    objects: int
    pointers: int
    access_marks: int
    unreferenced_objects: int
    unreferenced_bytes: int
    young_unreferenced_objects: int
    oldest_access: float | None
    newest_access: float | None
    unknown: tuple[str, ...]

    @property
    def over_bound(self) -> bool:
        return self.max_bytes > 0 and self.used_bytes > self.max_bytes


def summarize(census: Census, max_bytes: int, grace_s: float, now: float) -> CensusSummary:
    referenced = frozenset().union(*(e.object_names for e in census.entries))
    unreferenced = [listed for named, listed in census.objects.items() if named not in referenced]
    incomplete = sum(not e.object_names <= census.objects.keys() for e in census.entries)
    times = [e.last_access for e in census.entries]
    return CensusSummary(census.used_bytes, max_bytes, len({e.keys.identity_digest for e in census.entries}),
                         len(census.entries), incomplete, len(census.objects), len(census.pointers),
                         len(census.access_marks), len(unreferenced), sum(o.size for o in unreferenced),
                         sum(o.modified > now - grace_s for o in unreferenced), min(times, default=None),
                         max(times, default=None), census.unknown)


def take_census(bucket: SweepRequests, namespace: str) -> Census:
    """List and read ``namespace`` under the bucket's prefix; stops at the first failure, which
    ``unknown`` then names."""
    prefix = bucket.location.prefix
    top = namespace_prefix(prefix, namespace)
    entries: list[RemoteEntry] = []
    found: dict[KeyKind, dict[Named, Listed]] = {kind: {} for kind in KeyKind}
    foreign = 0
    try:
        folders = []
        for idd in bucket.folders(top):
            try:
                folders.append(RemoteKeys(prefix, namespace, idd))
            except ValueError:
                foreign += 1
        for kinds in ((KeyKind.MANIFEST, KeyKind.ACCESS, KeyKind.POINTER), (KeyKind.OBJECT,)):
            for keys in folders:
                manifests: list[tuple[str, Listed]] = []
                for kind in kinds:
                    for listed in bucket.list(keys.kind_prefix(kind)):
                        parsed = parse_key(prefix, listed.key)
                        if parsed is None or parsed.kind is not kind or parsed.keys != keys:
                            foreign += 1
                        elif kind is KeyKind.MANIFEST:
                            manifests.append((parsed.name, listed))
                        else:
                            found[kind][(keys.identity_digest, parsed.name)] = listed
                read = bucket.each(lambda item: (item, _manifest_bytes(bucket, item[1].key)), manifests)
                for (entry_id, listed), data in read:
                    if data is None:
                        continue  # deleted since it was listed
                    entries.append(_entry(keys, entry_id, listed, data, found[KeyKind.ACCESS],
                                          bucket.location.where(listed.key)))
    except (OSError, ManifestError) as exc:
        return _census(top, entries, found, foreign, (str(exc),))
    return _census(top, entries, found, foreign, ())


def _manifest_bytes(bucket: SweepRequests, key: str) -> bytes | None:
    try:
        return bucket.get(key, MAX_MANIFEST_BYTES)
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        raise ManifestError(Reason.CORRUPT, f"remote manifest {bucket.location.where(key)} is larger than a "
                            "manifest, so nothing of the namespace is deleted; remove that key and run "
                            "remote-gc again") from None


def _entry(keys: RemoteKeys, entry_id: str, listed: Listed, data: bytes,
           access: Mapping[Named, Listed], where: str) -> RemoteEntry:
    try:
        manifest = decode(data, expected_entry_id=entry_id, expected_identity_digest=keys.identity_digest)
    except ManifestError as exc:
        raise ManifestError(exc.reason, f"remote manifest {where} cannot be read ({exc.detail}), so "
                            "nothing of the namespace is deleted; remove that key (its entry then misses and is uploaded anew) and run "
                            "remote-gc again") from None
    names = tuple(dict.fromkeys(pointer_name(manifest.block_keys[p])
                                for p in pointer_positions(manifest.block_count)))
    keys = RemoteKeys.of(keys.prefix, keys.namespace, manifest.identity)  # its objects: its unit's
    return RemoteEntry(keys, entry_id, listed, access.get((keys.identity_digest, entry_id)),
                       frozenset(ref.digest for ref in manifest.objects), manifest.objects, names)


def _census(top: str, entries: list[RemoteEntry], found: dict[KeyKind, dict[Named, Listed]], foreign: int,
            unknown: tuple[str, ...]) -> Census:
    return Census(top, tuple(entries), MappingProxyType(found[KeyKind.OBJECT]),
                  MappingProxyType(found[KeyKind.POINTER]), MappingProxyType(found[KeyKind.ACCESS]),
                  foreign, unknown)


__all__ = ["Census", "CensusSummary", "Listed", "RemoteEntry", "SweepRequests", "summarize", "take_census"]
