"""The object backend on an S3-compatible store (``backend.ObjectBackend``), through obstore.

Each object is one key, ``PREFIX/objects/ab/<digest>`` (``s3_location.S3Location``), written by
one PUT (never a multipart upload: its parts and its weaker conditional semantics) with
``If-None-Match: *`` (``s3_puts.S3PutBatch``): a 412 means another writer placed it first, and
it stays (the first writer wins, nothing is rewritten), unless what is there is of another size:
that is not the object, and it is replaced.

- ``get``: one GET, the bytes streamed into one buffer (``get_bytes``: the client's own when they
  came in one piece) and hashed as they come, then verified
  exactly as the local backend verifies them (``backend.hasher_for`` / ``check_hash``): a missing
  or shorter object is ``absent``, wrong bytes or a longer one ``corrupt``, a failed request
  ``io_error``; each ``ObjectError`` names the key.
- ``exists``: no HEAD per object. The asked digests are grouped by shard, and each shard is
  listed once from just before its first asked digest until past its last (S3 lists keys in
  order: ``start-after``, then pages of up to 1,000 keys), the shards' listings in parallel.
  A lone digest costs one LIST (as a HEAD would, but it also says the size); many in one shard
  cost one LIST per 1,000 keys between them.
- ``list(prefix)``: LIST of the shard (or, for a prefix under two characters, of every shard)
  from just before the prefix, stopped at the first key past it.
- ``delete``: S3's DELETE says nothing (not whether the object was there, nor its size), so a
  HEAD comes first: the size it reports is what the deletion frees, 0 when it is absent. Two
  deleters racing may both report the size; deleting twice is no error.
- ``stored_bytes`` is the object's size: S3 counts bytes, not blocks.

A request that fails (no answer within ``timeout_s``, refused, 5xx after the retries, access
denied) is an ``OSError`` from ``exists``, ``list`` and a put batch (with the errno that says
which: ETIMEDOUT, ECONNREFUSED, EACCES, else EIO) and an ``ObjectError`` (``io_error``) from
``get`` and ``delete``, which are about one object. Messages name the key and the endpoint,
never a credential (an S3 error document is cut to its code and message).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

from .backend import ObjectError, ObjectStat, TempFiles, check_hash, hasher_for
from .layout import check_object_digest, check_object_prefix
from .manifests import PageRef
from .reasons import Reason
from .s3_errors import describe
from .s3_location import S3Location, open_client
from .s3_puts import S3PutBatch

_STREAM_CHUNK = 8 << 20  # a GET's bytes are copied and hashed this much at a time


class S3Backend:
    """``backend.ObjectBackend`` on an S3 bucket (see the module docstring)."""

    def __init__(self, location: S3Location, client=None) -> None:
        """``client``: an obstore ``S3Store`` of ``location``'s bucket to share (the tier's
        shards, one backend per identity, share one); default: one of its own (``open_client``)."""
        import obstore
        from obstore import exceptions

        self.location = location
        self._obstore, self._errors = obstore, exceptions
        # what a request may raise: obstore's errors, and builtin ones (a missing object is a
        # FileNotFoundError, caught before these wherever it means "absent")
        self._failures = (exceptions.BaseError, OSError, ValueError)
        self._client = client if client is not None else open_client(location)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Backend({self.location!r})"

    def close(self) -> None:
        """Stop the threads that carry parallel requests (made again when next needed)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the interface

    def exists(self, digests: Iterable[str]) -> dict[str, ObjectStat]:
        by_shard: dict[str, set[str]] = {}
        for digest in digests:
            by_shard.setdefault(check_object_digest(digest)[:2], set()).add(digest)
        groups = [sorted(names) for _, names in sorted(by_shard.items())]
        found: dict[str, ObjectStat] = {}
        for names, listed in zip(groups, self.each(lambda names: list(self._listed(names[0], names[-1])), groups)):
            found.update((s.digest, s) for s in listed if s.digest in names)
        return found

    def put_batch(self, temps: TempFiles, *, cached: bool = True) -> S3PutBatch:
        """Puts straight from the caller's bytes (no temporary files: ``temps`` is unused; no
        page cache: ``cached`` changes nothing)."""
        return S3PutBatch(self)

    def get(self, ref: PageRef) -> bytearray:
        data = self.get_bytes(ref)
        return data if isinstance(data, bytearray) else bytearray(data)

    def get_bytes(self, ref: PageRef, *, hashed: bool = True) -> bytes | bytearray:
        """``get``'s verified bytes without a copy when the response came in one piece (then
        they are the client's read-only ``bytes``). ``hashed=False``: only their size is
        checked here, for a caller that hashes them whole anyway and checks them itself (the
        tier's fetch: ``NewObject.of`` for the local store, then ``check_named``)."""
        key = self.location.key(ref.digest)
        where = self.location.where(key)
        try:
            result = self._obstore.get(self._client, key)
        except FileNotFoundError:
            raise ObjectError(Reason.ABSENT, ref.digest, "missing", where) from None
        except self._failures as exc:
            raise ObjectError(Reason.IO_ERROR, ref.digest, f"cannot be read: {self.say(exc)}", where) from None
        size = result.meta["size"]
        if size < ref.size:
            raise ObjectError(Reason.ABSENT, ref.digest, f"truncated: {size} of {ref.size} bytes present", where)
        if size > ref.size:
            raise ObjectError(Reason.CORRUPT, ref.digest, f"{size} bytes, manifest records {ref.size}", where)
        data: bytes | bytearray = b""  # the one chunk that is the whole object, or the chunks copied
        hasher, got = (hasher_for(ref) if hashed else None), 0
        try:
            for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                n = len(chunk)
                if got + n > ref.size:
                    raise ObjectError(Reason.CORRUPT, ref.digest, f"more than the {ref.size} bytes its "
                                      "manifest records came", where)
                if hasher is not None:
                    hasher.update(chunk)
                if got == 0 and n == ref.size:
                    data = chunk
                else:
                    if got == 0:
                        data = bytearray(ref.size)
                    memoryview(data)[got:got + n] = chunk
                got += n
        except self._failures as exc:
            raise ObjectError(Reason.IO_ERROR, ref.digest, f"read failed at {got}/{ref.size}: {self.say(exc)}",
                              where) from None
        if got < ref.size:
            raise ObjectError(Reason.ABSENT, ref.digest, f"truncated while reading at {got}/{ref.size}", where)
        if hasher is not None:
            check_hash(ref, hasher.hexdigest(), where)
        return data

    def list(self, prefix: str = "") -> list[ObjectStat]:
        check_object_prefix(prefix)
        return [s for s in self._listed(prefix, prefix) if s.digest.startswith(prefix)]

    def delete(self, digest: str) -> int:
        key = self.location.key(digest)
        try:
            size = self._obstore.head(self._client, key)["size"]
            self._obstore.delete(self._client, key)
        except FileNotFoundError:
            return 0
        except self._failures as exc:
            raise ObjectError(Reason.IO_ERROR, digest, f"cannot be removed: {self.say(exc)}",
                              self.location.where(key)) from None
        return size

    # ------------------------------------------------------------------ requests

    def _listed(self, first: str, last: str) -> Iterator[ObjectStat]:
        """The objects whose digests lie from ``first`` to ``last`` (hex prefixes of digests,
        ``first <= last``; a prefix stands for every digest it starts): one listing of the
        shard they share (of every shard when ``first`` has fewer than two characters), from
        just before ``first``, stopped past ``last``."""
        shared = first[:2] if len(first) >= 2 and first[:2] == last[:2] else ""
        base = f"{self.location.objects_key}/{shared}" if shared else self.location.objects_key
        start, end = (f"{base}/{first}" if first else ""), f"{base}/{last}"
        offset = _just_before(start) if start else None
        try:
            for chunk in self._obstore.list(self._client, base, offset=offset, chunk_size=1000):
                for meta in chunk:
                    path = meta["path"]
                    if path > end and not path.startswith(end):
                        return
                    digest = self.location.digest_of_key(path)
                    if digest is not None:
                        yield ObjectStat(digest, meta["size"], meta["size"])
        except self._failures as exc:
            raise self.os_error(exc, f"LIST of {self.location.where(base + '/')}") from None

    def put_new(self, ref: PageRef, data) -> bool:
        """PUT ``data`` as the object ``ref`` names unless it is there: True when this put placed
        it, False when another writer had (a 412 and the object of its size is there). What is
        there with another size is not the object: it is replaced."""
        key = self.location.key(ref.digest)
        try:
            try:
                self._obstore.put(self._client, key, data, mode="create", use_multipart=False)
                return True
            except self._errors.AlreadyExistsError:
                pass
            try:
                if self._obstore.head(self._client, key)["size"] == ref.size:
                    return False
            except FileNotFoundError:
                pass  # removed since: put it now
            self._obstore.put(self._client, key, data, mode="overwrite", use_multipart=False)
            return True
        except self._failures as exc:
            raise self.os_error(exc, f"PUT of {self.location.where(key)}") from None

    def each(self, fn: Callable, items: list) -> list:
        """``[fn(item) for item in items]``, up to ``requests_in_flight`` at once (``each_in_flight``)."""
        return each_in_flight(None if len(items) <= 1 or self.location.requests_in_flight == 1 else self._threads(),
                              fn, items)

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on one of the ``requests_in_flight`` threads that carry parallel requests."""
        return self._threads().submit(fn, *args)

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.location.requests_in_flight, thread_name_prefix="sparkcache-s3")
            return self._pool

    # ------------------------------------------------------------------ errors

    def say(self, exc: BaseException) -> str:
        """A client error in words, with what to do (``s3_errors.describe``)."""
        return describe(exc, self.location).detail

    def os_error(self, exc: BaseException, what: str) -> OSError:
        return describe(exc, self.location).os_error(what)


def each_in_flight(threads: ThreadPoolExecutor | None, fn: Callable, items: list) -> list:
    """``[fn(item) for item in items]`` on ``threads`` (None: in turn, here); obstore releases the
    GIL while it waits. Once a call has failed, the calls not begun are not made (against a
    server that does not answer, a batch then waits for one round of timeouts, not one per
    item); every call begun ends before the first failure in ``items`` order is raised."""
    failed = threading.Event()

    def call(item):
        if failed.is_set():
            return _NOT_MADE
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001 - raised below, once every call has ended
            failed.set()
            return _Failed(exc)

    results = [call(item) for item in items] if threads is None else list(threads.map(call, items))
    for result in results:
        if isinstance(result, _Failed):
            raise result.exc
    return results


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_NOT_MADE = object()  # a call of ``each_in_flight`` not made: an earlier one failed


def _just_before(key: str) -> str:
    """A string after which, in byte order, the first key starting with ``key`` comes: its
    last character one lower, then '~' (above every character a key of ours holds)."""
    return key[:-1] + chr(ord(key[-1]) - 1) + "~"


__all__ = ["S3Backend", "each_in_flight"]
