"""Plain keys of an S3 bucket: the shared tier's manifests, pointers and access marks.

Objects go through ``s3_backend.S3Backend`` (verified, content-addressed); the small keys beside
them (``remote_keys``) are read and written here, on the same obstore client: ``put_new`` (one
PUT with ``If-None-Match: *``; False when the key was there: the first writer won), ``put`` (an
unconditional PUT), ``get`` (the body, or None when the key is absent; a body longer than asked
is refused), ``list`` (every key under a prefix, with its size and LastModified) and ``delete``.
A request that fails is an ``OSError`` whose errno says which failure (``s3_errors.describe``)
and whose message names the key, never a credential.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from datetime import datetime

from .s3_errors import describe
from .s3_location import S3Location


@dataclass(frozen=True)
class KeyStat:
    """A listed key: its full name, its size and when it was last written."""

    key: str
    size: int
    last_modified: datetime


class S3Keys:
    """The plain-key operations on ``location``'s bucket through ``client`` (see the module
    docstring). Keys are whole (``location.prefix`` is not added)."""

    def __init__(self, location: S3Location, client) -> None:
        import obstore
        from obstore import exceptions

        self.location = location
        self._client = client
        self._obstore, self._exists = obstore, exceptions.AlreadyExistsError
        self._failures = (exceptions.BaseError, OSError, ValueError)

    def put_new(self, key: str, data: bytes) -> bool:
        """PUT ``data`` unless ``key`` exists: True when this put placed it."""
        try:
            self._obstore.put(self._client, key, data, mode="create", use_multipart=False)
            return True
        except self._exists:
            return False
        except self._failures as exc:
            raise self._error(exc, "PUT", key) from None

    def put(self, key: str, data: bytes) -> None:
        try:
            self._obstore.put(self._client, key, data, mode="overwrite", use_multipart=False)
        except self._failures as exc:
            raise self._error(exc, "PUT", key) from None

    def get(self, key: str, max_bytes: int) -> bytes | None:
        """The key's body, or None when there is no such key; ``OSError`` (EFBIG) for a body
        longer than ``max_bytes`` (nothing of it beyond the size is read)."""
        try:
            result = self._obstore.get(self._client, key)
        except FileNotFoundError:
            return None
        except self._failures as exc:
            raise self._error(exc, "GET", key) from None
        size = result.meta["size"]
        if size > max_bytes:
            raise OSError(errno.EFBIG, f"GET of {self.location.where(key)}: {size} bytes, more than the "
                          f"{max_bytes} such a key holds; it is not one this store wrote")
        try:
            return bytes(result.bytes())
        except FileNotFoundError:
            return None
        except self._failures as exc:
            raise self._error(exc, "GET", key) from None

    def list(self, prefix: str) -> list[KeyStat]:
        """Every key starting with ``prefix``, in key order."""
        try:
            return [KeyStat(m["path"], m["size"], m["last_modified"])
                    for chunk in self._obstore.list(self._client, prefix, chunk_size=1000) for m in chunk
                    if m["path"].startswith(prefix)]
        except self._failures as exc:
            raise self._error(exc, "LIST", prefix) from None

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is absent)."""
        try:
            self._obstore.delete(self._client, key)
        except FileNotFoundError:
            return
        except self._failures as exc:
            raise self._error(exc, "DELETE", key) from None

    def _error(self, exc: BaseException, verb: str, key: str) -> OSError:
        return describe(exc, self.location).os_error(f"{verb} of {self.location.where(key)}")


__all__ = ["KeyStat", "S3Keys"]
