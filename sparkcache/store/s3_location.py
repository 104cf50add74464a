"""Where an S3 backend keeps its objects, and the client that reaches them.

``S3Location`` names the bucket, the key prefix and the endpoint, and bounds every request
(connect timeout, request timeout, retries, requests in flight); it is made from the settings
table's ``REMOTE_*`` rows (``from_settings``) and holds no credential. An object's key is
``PREFIX/objects/ab/<its 64-hex digest>``: the whole digest, never truncated, under a shard of its
first two characters.

``open_client`` makes the obstore ``S3Store`` (obstore: Rust's ``object_store`` under Python;
the choice and its figures: docs/REMOTE.md). Credentials are never a setting and never held
here: obstore reads the standard AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, a web identity's ``AWS_WEB_IDENTITY_TOKEN_FILE`` and
``AWS_ROLE_ARN``, the container's and the instance's role) itself; when none of those names a
key, the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, else ``~/.aws/credentials``)
is read for the profile ``AWS_PROFILE`` (else ``default``) by ``SharedCredentialsFile``, again
at each renewal, so a rotated file is picked up.
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ..settings import (REMOTE_BUCKET_PATTERN, REMOTE_ENDPOINT_PATTERN, REMOTE_PREFIX_PATTERN, Settings,
                        SettingsError, check_number)
from .layout import check_object_digest, is_object_digest

MAX_PUT_BYTES = 5 << 30  # S3's limit on one PUT: larger objects would need a multipart upload
_RENEW = timedelta(minutes=15)  # how long a credential read from the shared file is used before it is read again
# Variables that name a credential obstore finds by itself (the file is read only without them).
_OWN_CHAIN = ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI")


@dataclass(frozen=True)
class S3Location:
    """A bucket, a key prefix, an endpoint (empty: AWS for the region) and the bounds on each
    request. Checked when made: a bad value is ``SettingsError`` naming the setting."""

    bucket: str
    prefix: str = "sparkcache"
    endpoint: str = ""
    connect_timeout_s: float = 2.0
    timeout_s: float = 30.0
    retries: int = 2
    requests_in_flight: int = 4

    def __post_init__(self) -> None:
        for name, value, pattern, what in (
                ("REMOTE_BUCKET", self.bucket, REMOTE_BUCKET_PATTERN, "an S3 bucket name"),
                ("REMOTE_ENDPOINT", self.endpoint, REMOTE_ENDPOINT_PATTERN, "http(s)://host[:port]"),
                ("REMOTE_PREFIX", self.prefix, REMOTE_PREFIX_PATTERN, "'/'-separated plain names")):
            if not isinstance(value, str) or not re.fullmatch(pattern, value):
                raise SettingsError(f"SPARKCACHE_{name}={value!r}: not {what}; allowed: matching {pattern}")
        if not self.bucket:
            raise SettingsError("SPARKCACHE_REMOTE_BUCKET='': an S3 backend needs a bucket; set it")
        check_number("S3Location", "connect_timeout_s", self.connect_timeout_s, above=0,
                     setting="SPARKCACHE_REMOTE_CONNECT_TIMEOUT_SECONDS")
        check_number("S3Location", "timeout_s", self.timeout_s, above=0, setting="SPARKCACHE_REMOTE_TIMEOUT_SECONDS")
        check_number("S3Location", "retries", self.retries, minimum=0, integer=True,
                     setting="SPARKCACHE_REMOTE_RETRIES")
        check_number("S3Location", "requests_in_flight", self.requests_in_flight, minimum=1, integer=True,
                     setting="SPARKCACHE_REMOTE_REQUESTS_IN_FLIGHT")

    @classmethod
    def from_settings(cls, s: Settings) -> "S3Location":
        return cls(s.remote_bucket, s.remote_prefix, s.remote_endpoint, s.remote_connect_timeout_seconds,
                   s.remote_timeout_seconds, s.remote_retries, s.remote_requests_in_flight)

    @property
    def objects_key(self) -> str:
        """The key prefix every object's key starts with (no trailing '/')."""
        return f"{self.prefix}/objects"

    def key(self, digest: str) -> str:
        """The object's key; ``UnsafePathError`` for a name that is not a digest."""
        check_object_digest(digest)
        return f"{self.objects_key}/{digest[:2]}/{digest}"

    def digest_of_key(self, key: str) -> str | None:
        """The digest an object's key names, or None for a key that is not one of ours."""
        digest = key.rsplit("/", 1)[-1]
        return digest if is_object_digest(digest) and key == self.key(digest) else None

    def where(self, key: str) -> str:
        """A key as an error names it: ``s3://bucket/key`` and the endpoint."""
        return f"s3://{self.bucket}/{key}" + (f" at {self.endpoint}" if self.endpoint else "")


@dataclass(frozen=True)
class SharedCredentialsFile:
    """obstore's credential provider over the shared credentials file: reads ``profile`` from
    ``path`` at each call (``aws_access_key_id``, ``aws_secret_access_key``, optionally
    ``aws_session_token``). Holds no credential; an error names the file and the profile only."""

    path: str
    profile: str

    @classmethod
    def find(cls, env=os.environ) -> "SharedCredentialsFile | None":
        """The file and profile the standard variables name, when they hold the profile and
        no variable names a credential obstore finds by itself; else None."""
        if any(env.get(name) for name in _OWN_CHAIN):
            return None
        path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
        found = cls(path, env.get("AWS_PROFILE") or "default")
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            return None
        return found if parser.has_section(found.profile) else None

    def __call__(self) -> dict:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with open(self.path) as fh:
                parser.read_file(fh)
            section = parser[self.profile]
            key_id, secret = section["aws_access_key_id"], section["aws_secret_access_key"]
        except (OSError, KeyError, configparser.Error) as exc:
            raise OSError(f"the AWS shared credentials file {self.path} has no usable profile "
                          f"[{self.profile}] ({type(exc).__name__}); give it aws_access_key_id and "
                          "aws_secret_access_key, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
        return {"access_key_id": key_id.strip(), "secret_access_key": secret.strip(),
                "token": section.get("aws_session_token", "").strip() or None,
                "expires_at": datetime.now(timezone.utc) + _RENEW}


def open_client(location: S3Location):
    """The obstore ``S3Store`` of ``location``'s bucket: its endpoint (plain HTTP allowed only
    when the endpoint says ``http://``), its timeouts and retries (exponential backoff, all
    of them within ``timeout_s``), credentials as the module docstring says."""
    from obstore.store import S3Store

    timeout = timedelta(seconds=location.timeout_s)
    config = {"endpoint": location.endpoint.rstrip("/")} if location.endpoint else {}
    return S3Store(location.bucket, config=config, credential_provider=SharedCredentialsFile.find(),
                   client_options={"connect_timeout": timedelta(seconds=location.connect_timeout_s),
                                   "timeout": timeout, "allow_http": location.endpoint.startswith("http://")},
                   retry_config={"max_retries": location.retries, "retry_timeout": timeout,
                                 "backoff": {"init_backoff": timedelta(milliseconds=100),
                                             "max_backoff": timedelta(seconds=2), "base": 2}})


__all__ = ["MAX_PUT_BYTES", "S3Location", "SharedCredentialsFile", "open_client"]
