"""The shared tier's tests: two local stores and one bucket (the tests' SeaweedFS), a tier on
each, every run under a fresh remote prefix."""

from __future__ import annotations

import os
import uuid

import obstore

from s3_helpers import aws_env
from sparkcache.store import PageStore
from sparkcache.store.remote_tier import RemoteTier
from sparkcache.store.s3_location import S3Location
from store_helpers import open_store


def tier_of(server, monkeypatch, store: PageStore, prefix: str, **kw) -> RemoteTier:
    """A tier of ``store`` on ``server``'s bucket under ``prefix``, the run's keys in the
    standard AWS variables (where the client reads them); short retries and timeouts."""
    aws_env(monkeypatch, server.endpoint.aws_env())
    bounds = {k: kw.pop(k) for k in ("timeout_s", "connect_timeout_s", "retries") if k in kw}
    location = S3Location(server.endpoint.bucket, prefix, server.endpoint.url, **bounds)
    kw.setdefault("retry_first_s", 0.1)
    kw.setdefault("retry_max_s", 0.5)
    kw.setdefault("deadline_s", 10.0)
    return RemoteTier(location, store, **kw)


def fresh_prefix() -> str:
    return f"tier/{uuid.uuid4().hex[:12]}"


def two_stores(tmp_path) -> tuple[PageStore, PageStore]:
    return open_store(tmp_path / "a"), open_store(tmp_path / "b")


def remote_keys_of(server, prefix: str) -> dict[str, int]:
    raw = server.raw_store()
    return {m["path"]: m["size"] for chunk in obstore.list(raw, prefix) for m in chunk}


def manifest_file_bytes(store: PageStore, entry_id: str) -> bytes:
    return store.manifest_bytes(entry_id)[1]


def random_pages(n: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


class KillingLocal:
    """A local store that calls ``hook`` once, the ``at``-th time the tier asks ``method`` of it
    (to cut an upload or a fetch at a known step); everything else is the store's."""

    def __init__(self, store: PageStore, method: str, at: int, hook) -> None:
        self._store, self._method, self._at, self._hook, self.calls = store, method, at, hook, 0
        self.namespace = store.namespace

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name != self._method:
            return attr

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == self._at:
                self._hook()
            return attr(*args, **kwargs)
        return wrapped
