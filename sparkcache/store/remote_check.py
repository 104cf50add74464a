"""The bucket check: every remote entry of a namespace read back whole, or named as wrong.

``remote_check`` lists the namespace's keys (``remote_keys.namespace_prefix``), and for every
manifest GETs it, decodes it (its entry id and identity digest must be its key's) and reads every
object it names back through the shard's verified ``S3Backend.get``. An entry whose manifest
does not decode, or one of whose objects is missing, short or wrong, is a ``RemoteFault``. The
upload's order (objects, then the manifest) means a whole bucket has none; the fault tests prove
it with this. Pointers whose entry has no manifest are counted apart, not faults: a lookup that
follows one misses (``manifest_absent``), and the capacity sweeper re-points or removes them (a
sweeper stopped between an entry's pointers and its manifest, or a pointer PUT by an upload racing
an eviction, leaves one).
"""

from __future__ import annotations

from dataclasses import dataclass

from .backend import ObjectError
from .manifests import MAX_MANIFEST_BYTES, ManifestError, decode
from .remote_bucket import RemoteBucket
from .remote_keys import KeyKind, namespace_prefix, parse_key


@dataclass(frozen=True)
class RemoteFault:
    """An entry the bucket holds wrongly: its manifest's key, and what is wrong (the reason an
    object failed with, or the manifest's)."""

    key: str
    reason: str
    detail: str


@dataclass(frozen=True)
class CheckReport:
    """What ``remote_check`` found: entries read back whole, objects read, faults, and pointers
    naming an entry without a manifest."""

    entries: int
    objects: int
    object_bytes: int
    faults: tuple[RemoteFault, ...]
    dangling_pointers: int

    @property
    def clean(self) -> bool:
        return not self.faults


def remote_check(bucket: RemoteBucket, namespace: str) -> CheckReport:
    """Read every remote entry of ``namespace`` back (the module docstring). The remote store's
    ``OSError`` when it cannot be listed."""
    prefix = bucket.location.prefix
    manifests, pointers = [], []
    for stat in bucket.plain.list(namespace_prefix(prefix, namespace)):
        parsed = parse_key(prefix, stat.key)
        if parsed is not None and parsed.kind is KeyKind.MANIFEST:
            manifests.append(parsed)
        elif parsed is not None and parsed.kind is KeyKind.POINTER:
            pointers.append(stat.key)
    faults: list[RemoteFault] = []
    whole = n_objects = n_bytes = 0
    named = set()
    for parsed in manifests:
        key = parsed.keys.manifest_key(parsed.name)
        named.add(parsed.name)
        data = bucket.plain.get(key, MAX_MANIFEST_BYTES)
        if data is None:
            continue  # removed since the listing
        try:
            manifest = decode(data, expected_entry_id=parsed.name,
                              expected_identity_digest=parsed.keys.identity_digest)
        except ManifestError as exc:
            faults.append(RemoteFault(key, str(exc.reason), str(exc)))
            continue
        shard = bucket.shard(namespace, manifest.identity)
        bad = None
        for ref in manifest.objects:
            try:
                n_bytes += len(shard.objects.get(ref))
                n_objects += 1
            except ObjectError as exc:
                bad = RemoteFault(key, str(exc.reason), str(exc))
                break
        if bad is None:
            whole += 1
        else:
            faults.append(bad)
    dangling = sum(1 for key in pointers if (bucket.plain.get(key, 64) or b"").decode("ascii", "replace") not in named)
    return CheckReport(whole, n_objects, n_bytes, tuple(faults), dangling)


__all__ = ["CheckReport", "RemoteFault", "remote_check"]
