"""What a failed S3 request means, in words an operator acts on.

``describe`` reads obstore's error (its text and the debug record under it: the HTTP status,
``kind: Timeout``, ``kind: Connect``) and says which failure it was (an errno: ETIMEDOUT,
ECONNREFUSED, EACCES, else EIO), what the server or the client said (an S3 error document cut to
its code and message) and the fix. No credential is ever in it: an error document's other fields
(the access key id, the string to sign) are dropped, and any value of the standard AWS
credential variables is blanked.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

_MESSAGE_CHARS = 400  # how much of a client's message a description keeps
_CREDENTIAL_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")
_DENIED = re.compile(r"status: 40[13]\b|\b(AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId|"
                     r"InvalidToken|ExpiredToken)\b|PermissionDenied|Unauthenticated")


@dataclass(frozen=True)
class Failure:
    """One failed request: ``code`` (an errno), ``detail`` (what was said, and the fix)."""

    code: int
    detail: str

    def os_error(self, what: str) -> OSError:
        """An ``OSError`` of this errno naming ``what`` was asked."""
        return OSError(self.code, f"{what}: {self.detail}")


def describe(exc: BaseException, location) -> Failure:
    """``exc``, raised by obstore for a request to ``location`` (an ``S3Location``)."""
    full = _blank_credentials(str(exc))
    said = full.split("Debug source:")[0]
    doc = min((i for i in (said.find("<?xml"), said.find("<Error>")) if i >= 0), default=-1)
    if doc >= 0:
        fields = dict(re.findall(r"<(Code|Message)>([^<]*)</\1>", said[doc:]))
        said = said[:doc] + " " + " ".join(f"{k}: {v}" for k, v in fields.items())
    said = " ".join(said.split())
    if len(said) > _MESSAGE_CHARS:
        said = said[:_MESSAGE_CHARS] + "..."
    name = type(exc).__name__
    if _DENIED.search(full) or name in ("PermissionDeniedError", "UnauthenticatedError"):
        code, why = errno.EACCES, ("access denied: check the AWS credentials (AWS_ACCESS_KEY_ID / "
                                   "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials) and the bucket's policy")
    elif "kind: Timeout" in full or "TimedOut" in full:
        code, why = errno.ETIMEDOUT, (f"no answer within SPARKCACHE_REMOTE_TIMEOUT_SECONDS={location.timeout_s:g}: "
                                      "check that the endpoint's service runs and the network to it")
    elif "kind: Connect" in full or "ConnectionRefused" in full:
        code, why = errno.ECONNREFUSED, ("the endpoint could not be connected to: check "
                                         "SPARKCACHE_REMOTE_ENDPOINT and that its service runs")
    else:
        code, why = errno.EIO, "check the endpoint, the bucket and the service's health, then retry"
    return Failure(code, f"{why} ({name}: {said})")


def _blank_credentials(text: str) -> str:
    for variable in _CREDENTIAL_VARIABLES:
        value = os.environ.get(variable, "")
        if len(value) >= 8:
            text = text.replace(value, f"<{variable}>")
    return text


__all__ = ["Failure", "describe"]
