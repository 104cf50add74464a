"""A shared tier's namespace filled as the tier fills it, on the tests' SeaweedFS: entries
published by a real local ``PageStore``, their objects PUT through ``S3Backend``'s put batch (its
prefix ``P/NS/IDD``), the manifest's bytes PUT verbatim after them, the pointers after that
(``If-None-Match: *``: the first entry uploaded names a block key's pointer), access marks when
a test says an entry was fetched. And the check that the namespace is consistent: every manifest
there names objects that are there and read back verified."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import obstore

from s3_helpers import aws_env
from sparkcache.store import PageStore
from sparkcache.store.backend import NewObject
from sparkcache.store.manifests import Manifest, decode
from sparkcache.store.remote_keys import RemoteKeys, parse_key, pointer_name, pointer_positions, KeyKind
from sparkcache.store.s3_backend import S3Backend
from sparkcache.store.s3_location import S3Location
from store_helpers import IDENT, conv_keys, conv_pages

NAMESPACE = "ns"


@dataclass(frozen=True)
class Uploaded:
    manifest: Manifest
    keys: RemoteKeys

    @property
    def entry_id(self) -> str:
        return self.manifest.entry_id

    @property
    def manifest_key(self) -> str:
        return self.keys.manifest_key(self.entry_id)


class RemoteNamespace:
    """One namespace under a fresh prefix of ``server``'s bucket, and a local store to publish
    its entries from."""

    def __init__(self, server, monkeypatch, store_root, prefix: str | None = None, **bounds) -> None:
        aws_env(monkeypatch, server.endpoint.aws_env())
        self.server = server
        self.location = S3Location(server.endpoint.bucket, prefix or f"tests/{uuid.uuid4().hex}",
                                   server.endpoint.url, **bounds)
        self.keys = RemoteKeys(self.location.prefix, NAMESPACE, IDENT.digest())
        self.objects = S3Backend(S3Location(self.location.bucket, self.keys.objects_base, self.location.endpoint,
                                            **bounds))
        self.store = PageStore(str(store_root), page_blocks=4, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
        self.raw = server.raw_store()

    def upload(self, conv: int, n_blocks: int, size_per_block: int = 256) -> Uploaded:
        """Publish conversation ``conv``'s first ``n_blocks`` locally, then upload it."""
        keys = conv_keys(conv, n_blocks)
        result = self.store.publish(IDENT, keys, conv_pages(conv, n_blocks, 4, size_per_block))
        assert result.ok, result
        path = self.store.layout.manifest_path(IDENT.digest(), result.entry_id)
        with open(path, "rb") as f:
            data = f.read()
        manifest = decode(data)
        batch = self.objects.put_batch(None)
        for ref in manifest.objects:
            with open(self.store.layout.object_path(ref.digest), "rb") as f:
                batch.add(NewObject.of(f.read()))
        batch.flush()
        self.put(self.keys.manifest_key(manifest.entry_id), data)
        for position in pointer_positions(manifest.block_count):
            self.put(self.keys.pointer_key(manifest.block_keys[position]), manifest.entry_id.encode())
        return Uploaded(manifest, self.keys)

    def put(self, key: str, data: bytes, create: bool = True) -> None:
        try:
            obstore.put(self.raw, key, data, mode="create" if create else "overwrite", use_multipart=False)
        except obstore.exceptions.AlreadyExistsError:
            pass

    def access(self, entry: Uploaded) -> None:
        """A fetch of ``entry``: its access mark PUT (again)."""
        self.put(entry.keys.access_key(entry.entry_id), b"", create=False)

    def orphan(self, data: bytes) -> str:
        """An object no manifest names (an upload cut short); its key."""
        obj = NewObject.of(data)
        batch = self.objects.put_batch(None)
        batch.add(obj)
        batch.flush()
        return self.keys.object_key(obj.ref.digest)

    def listing(self) -> dict[str, dict]:
        """Every key of the namespace, with obstore's metadata."""
        prefix = f"{self.location.prefix}/{NAMESPACE}/"
        return {m["path"]: m for chunk in obstore.list(self.raw, prefix) for m in chunk}

    def kinds(self) -> dict[KeyKind, set[str]]:
        """The names of the namespace's keys by kind."""
        out: dict[KeyKind, set[str]] = {kind: set() for kind in KeyKind}
        for key in self.listing():
            parsed = parse_key(self.location.prefix, key)
            assert parsed is not None, key
            out[parsed.kind].add(parsed.name)
        return out

    def used_bytes(self) -> int:
        return sum(m["size"] for key, m in self.listing().items() if "/objects/" in key)

    def assert_consistent(self) -> list[str]:
        """Every remote manifest decodes and every object it names reads back verified; every
        pointer names an entry that is there and holds its key, and every pointer an entry there
        should have is there. Returns the entry ids."""
        ids = []
        for key in self.listing():
            parsed = parse_key(self.location.prefix, key)
            if parsed.kind is not KeyKind.MANIFEST:
                continue
            manifest = decode(bytes(obstore.get(self.raw, key).bytes()), expected_entry_id=parsed.name)
            for ref in manifest.objects:
                self.objects.get(ref)  # ObjectError when missing or wrong
            ids.append(parsed.name)
        held = {}
        for entry_id in ids:
            manifest = decode(bytes(obstore.get(self.raw, self.keys.manifest_key(entry_id)).bytes()))
            held[entry_id] = {pointer_name(manifest.block_keys[p]) for p in pointer_positions(manifest.block_count)}
        pointers = self.kinds()[KeyKind.POINTER]
        for name in pointers:
            body = bytes(obstore.get(self.raw, f"{self.keys.base}/keys/{name}").bytes()).decode()
            assert body in held and name in held[body], (name, body, sorted(held))
        for entry_id, names in held.items():
            assert names <= pointers, (entry_id, sorted(names - pointers))
        return sorted(ids)


def tick() -> None:
    """Let the object store's clock pass a LastModified step (whole seconds on SeaweedFS)."""
    time.sleep(1.1)


__all__ = ["NAMESPACE", "RemoteNamespace", "Uploaded", "tick"]
