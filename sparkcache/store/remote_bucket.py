"""The shared tier's bucket, one identity's shard of it at a time.

``RemoteBucket`` holds one obstore client of the bucket (its bounds: ``S3Location``'s) and
gives, per namespace and identity, a ``RemoteShard``: the shard's key names
(``remote_keys.RemoteKeys``), its objects (an ``S3Backend`` whose prefix is its unit's ``P/NS/UD``:
verified gets, put-if-absent batches) and its plain keys (``s3_keys.S3Keys``: manifests, pointers, access
marks), all on that one client.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from .identity import Identity
from .remote_keys import RemoteKeys
from .s3_backend import S3Backend
from .s3_keys import S3Keys
from .s3_location import S3Location, open_client


@dataclass(frozen=True)
class RemoteShard:
    """One identity's keys in one namespace, and the doors to them."""

    keys: RemoteKeys
    objects: S3Backend
    plain: S3Keys


class RemoteBucket:
    """The bucket ``location`` names (its ``prefix`` is ``SPARKCACHE_REMOTE_PREFIX``)."""

    def __init__(self, location: S3Location) -> None:
        self.location = location
        self.client = open_client(location)
        self.plain = S3Keys(location, self.client)
        self._shards: dict[RemoteKeys, RemoteShard] = {}
        self._lock = threading.Lock()

    def shard(self, namespace: str, identity: Identity) -> RemoteShard:
        keys = RemoteKeys.of(self.location.prefix, namespace, identity)
        with self._lock:
            found = self._shards.get(keys)
            if found is None:
                objects = S3Backend(dataclasses.replace(self.location, prefix=keys.objects_base), self.client)
                found = self._shards[keys] = RemoteShard(keys, objects, self.plain)
            return found

    def close(self) -> None:
        """Stop the threads the shards' parallel requests run on."""
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            shard.objects.close()


__all__ = ["RemoteBucket", "RemoteShard"]
