"""S3 backends on the tests' SeaweedFS (testing/seaweedfs.py): the run's key pair in the standard
AWS variables (where the backend's client reads them), nothing else of AWS's in the environment,
and every key prefix fresh, so no test sees another's objects."""

from __future__ import annotations

import os
import uuid

from sparkcache.store.s3_backend import S3Backend
from sparkcache.store.s3_location import S3Location

# Where the client would ask an instance's role for credentials, were none given: a closed port on
# loopback, so that nothing ever leaves the machine.
NO_METADATA_SERVICE = "http://127.0.0.1:9"


def aws_env(monkeypatch, variables: dict[str, str]) -> None:
    """Exactly ``variables`` among the AWS_* variables (and the metadata guard)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", NO_METADATA_SERVICE)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def s3_backend(server, monkeypatch, prefix: str | None = None, **bounds) -> S3Backend:
    """An ``S3Backend`` on ``server``'s bucket under a fresh prefix (or ``prefix``), its
    credentials from the environment as in production."""
    aws_env(monkeypatch, server.endpoint.aws_env())
    location = S3Location(server.endpoint.bucket, prefix or f"tests/{uuid.uuid4().hex}", server.endpoint.url, **bounds)
    return S3Backend(location)
