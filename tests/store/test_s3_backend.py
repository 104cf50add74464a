"""The S3 backend on a real S3 server (the tests' SeaweedFS, testing/seaweedfs.py), in what the
conformance suite does not ask of every backend: the keys it writes, the conditional PUT and
its 412, one PUT per object, the damage and the absence a GET meets, named by key, what a stopped
or a hung server gives (an error of the kind the interface promises, within the timeout, never a
hang), and credentials, which come from the standard AWS variables or the shared credentials file
and are never in a log, a message or a ``repr``."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import signal
import time

import obstore
import pytest

from s3_helpers import aws_env, s3_backend
from sparkcache.settings import SettingsError, load_settings
from sparkcache.store import PageRef, Reason
from sparkcache.store.backend import NewObject, ObjectError
from sparkcache.store.s3_backend import S3Backend
from sparkcache.store.s3_errors import describe
from sparkcache.store.s3_location import S3Location, SharedCredentialsFile
from testing.seaweedfs import SeaweedFS


def _put(backend: S3Backend, *datas: bytes):
    batch = backend.put_batch(None)
    for data in datas:
        batch.add(NewObject.of(data))
    return batch.flush()


def _keys(server, prefix: str) -> dict[str, int]:
    raw = server.raw_store()
    return {m["path"]: m["size"] for chunk in obstore.list(raw, prefix) for m in chunk}


def test_each_object_is_one_key_holding_its_whole_digest_under_the_prefix(seaweedfs, monkeypatch):
    backend = s3_backend(seaweedfs, monkeypatch, prefix="ns-a/identity-0123/deep")
    datas = [b"a" * 10, b"b" * 70_000]
    _put(backend, *datas)
    digests = [NewObject.of(d).ref.digest for d in datas]
    assert _keys(seaweedfs, "ns-a/identity-0123/deep") == {
        f"ns-a/identity-0123/deep/objects/{d[:2]}/{d}": len(data) for d, data in zip(digests, datas)}
    assert all(len(k.rsplit("/", 1)[1]) == 64 for k in _keys(seaweedfs, "ns-a"))  # never truncated


def test_a_412_on_a_second_put_leaves_the_first_objects_bytes(seaweedfs, monkeypatch):
    """The server refuses a second ``If-None-Match: *`` PUT of a key (412), and the backend
    takes that as "present": what the first writer put stays, byte for byte, even when the
    second writer's bytes differ (a bug or a hostile writer: never the object's own bytes)."""
    backend = s3_backend(seaweedfs, monkeypatch)
    first = NewObject.of(b"first writer" * 100)
    second = NewObject(first.ref, b"other bytes!" * 100)  # the same name and size, other bytes
    key = backend.location.key(first.ref.digest)
    raw = seaweedfs.raw_store()
    assert _put(backend, first.data).written == {first.ref.digest}
    with pytest.raises(obstore.exceptions.AlreadyExistsError, match="412"):  # the server's own answer
        obstore.put(raw, key, second.data, mode="create", use_multipart=False)
    batch = backend.put_batch(None)
    batch.add(second)
    receipt = batch.flush()
    assert receipt.written == frozenset() and receipt.present == {first.ref.digest}
    assert bytes(obstore.get(raw, key).bytes()) == first.data
    assert backend.get(first.ref) == first.data


def test_an_object_larger_than_a_multipart_part_goes_in_one_put(seaweedfs, monkeypatch):
    """No multipart upload, whatever the size: a multipart object's ETag is ``"<md5>-<parts>"``,
    one PUT's is the MD5 of its bytes."""
    backend = s3_backend(seaweedfs, monkeypatch)
    data = os.urandom(12 << 20)  # more than the client's multipart chunk
    obj = NewObject.of(data)
    _put(backend, data)
    etag = obstore.head(seaweedfs.raw_store(), backend.location.key(obj.ref.digest))["e_tag"]
    assert etag.strip('"') == hashlib.md5(data).hexdigest(), etag


def test_a_flipped_byte_in_the_stored_object_is_refused_naming_its_key(seaweedfs, monkeypatch):
    backend = s3_backend(seaweedfs, monkeypatch)
    data = os.urandom(300_000)
    obj = NewObject.of(data)
    _put(backend, data)
    key = backend.location.key(obj.ref.digest)
    flipped = bytearray(data)
    flipped[123_456] ^= 0x40
    obstore.put(seaweedfs.raw_store(), key, bytes(flipped), use_multipart=False)  # past the backend
    for ref in (obj.ref, PageRef(obj.ref.digest, obj.ref.size)):  # by its XXH3-128, by its BLAKE3 name
        with pytest.raises(ObjectError) as caught:
            backend.get(ref)
        assert caught.value.reason is Reason.CORRUPT and key in str(caught.value)
        assert f"s3://{seaweedfs.endpoint.bucket}/{key}" in caught.value.where


def test_a_missing_object_is_absent_naming_its_key(seaweedfs, monkeypatch):
    backend = s3_backend(seaweedfs, monkeypatch)
    ref = NewObject.of(b"never put").ref
    with pytest.raises(ObjectError) as caught:
        backend.get(ref)
    assert caught.value.reason is Reason.ABSENT and backend.location.key(ref.digest) in str(caught.value)
    assert backend.exists([ref.digest]) == {} and backend.list(ref.digest[:2]) == []


def test_a_stopped_server_is_an_error_of_the_promised_kind_within_the_timeout(tmp_path, monkeypatch):
    """SIGKILLed: nothing listens, each request is refused, and every operation ends at once
    with the interface's error (``OSError`` from exists, list and a batch; ``ObjectError``
    ``io_error`` from get and delete). SIGSTOPped: it accepts and never answers; the request
    timeout ends each operation; a batch of many objects too, however few requests it keeps in
    flight (once one has failed, the rest are not sent). Started again on its directory, the same
    objects are there."""
    timeout_s = 1.0
    with SeaweedFS(tmp_path / "s") as server:
        backend = s3_backend(server, monkeypatch, timeout_s=timeout_s, connect_timeout_s=0.5, retries=1,
                             requests_in_flight=2)
        kept = NewObject.of(os.urandom(50_000))
        _put(backend, kept.data)
        for stop, code in ((server.kill, errno.ECONNREFUSED), (lambda: os.kill(server.proc.pid, signal.SIGSTOP),
                                                                errno.ETIMEDOUT)):
            stop()
            try:
                for operation in (lambda: backend.exists([kept.ref.digest]), lambda: backend.list(),
                                  lambda: _put(backend, os.urandom(1000)),
                                  lambda: _put(backend, *(os.urandom(1000) for _ in range(12))),
                                  lambda: backend.get(kept.ref), lambda: backend.delete(kept.ref.digest)):
                    started = time.monotonic()
                    with pytest.raises((OSError, ObjectError)) as caught:
                        operation()
                    took = time.monotonic() - started
                    assert took < 2 * timeout_s + 1.0, (took, caught.value)  # a timeout and its retries
                    if isinstance(caught.value, ObjectError):
                        assert caught.value.reason is Reason.IO_ERROR and kept.ref.digest in str(caught.value)
                    else:
                        assert caught.value.errno == code, caught.value
                        assert server.endpoint.url in str(caught.value)
            finally:
                if server.running():
                    os.kill(server.proc.pid, signal.SIGCONT)
                    server.kill()
            server.start()
            assert backend.get(kept.ref) == kept.data


def test_credentials_never_appear_in_a_log_a_message_or_a_repr(seaweedfs, monkeypatch, caplog, capfd, tmp_path):
    secret, key_id = seaweedfs.endpoint.secret_key, seaweedfs.endpoint.access_key
    caplog.set_level(logging.DEBUG)
    backend = s3_backend(seaweedfs, monkeypatch, timeout_s=2.0)
    obj = NewObject.of(b"logged?" * 1000)
    said = [repr(backend), repr(backend.location), repr(backend._client), repr(seaweedfs.endpoint),
            repr(load_settings(env={"SPARKCACHE_ROOT": str(tmp_path)}))]
    _put(backend, obj.data)
    backend.get(obj.ref), backend.exists([obj.ref.digest]), backend.list(), backend.delete(obj.ref.digest)
    failures = [lambda: backend.get(obj.ref)]  # absent now
    wrong = s3_backend(seaweedfs, monkeypatch, timeout_s=2.0)
    aws_env(monkeypatch, {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": "x" + secret[1:]})
    wrong = S3Backend(wrong.location)  # the right key id, a wrong secret: the server refuses the signature
    failures += [lambda: wrong.get(obj.ref), lambda: wrong.exists([obj.ref.digest]),
                 lambda: _put(wrong, b"refused"), lambda: wrong.delete(obj.ref.digest)]
    for failure in failures:
        with pytest.raises((OSError, ObjectError)) as caught:
            failure()
        said += [str(caught.value), repr(caught.value)]
    with pytest.raises(OSError) as denied:
        wrong.exists([obj.ref.digest])
    assert denied.value.errno == errno.EACCES and "credentials" in str(denied.value)
    out, err = capfd.readouterr()
    said += [out, err, caplog.text]
    for text in said:
        assert secret not in text and key_id not in text and secret[1:] not in text, text


def test_what_a_client_error_echoes_of_a_credential_is_left_out(monkeypatch):
    """AWS's own error documents echo the access key id (SeaweedFS's do not, so these are AWS's
    shape, as obstore raises them): what the backend says keeps the document's code and message
    only, so a key id from the shared credentials file, which no variable holds, is gone; and a
    value of the credential variables anywhere in the client's text is blanked."""
    secret, key_id = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "AKIAIOSFODNN7EXAMPLE"
    location = S3Location("bucket", "p", "http://127.0.0.1:9")
    document = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InvalidAccessKeyId</Code><Message>The AWS '
                'Access Key Id you provided does not exist in our records.</Message><AWSAccessKeyId>'
                f'{key_id}</AWSAccessKeyId><RequestId>4442587FB7D0A2F9</RequestId></Error>')
    aws_env(monkeypatch, {})  # the key pair came from the shared file
    failure = describe(obstore.exceptions.GenericError(
        "Generic S3 error: Error performing GET http://127.0.0.1:9/bucket/k - Server returned non-2xx status "
        f"code: 403 Forbidden: {document}"), location)
    assert failure.code == errno.EACCES
    assert "InvalidAccessKeyId" in failure.detail and "does not exist in our records" in failure.detail
    assert key_id not in failure.detail, failure.detail
    aws_env(monkeypatch, {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret})
    failure = describe(obstore.exceptions.GenericError(
        f"Generic S3 error: Error performing GET http://127.0.0.1:9/bucket/k?X-Amz-Credential={key_id}"
        f"&secret={secret} - HTTP error: error sending request"), location)
    assert key_id not in failure.detail and secret not in failure.detail, failure.detail
    assert "<AWS_ACCESS_KEY_ID>" in failure.detail


def test_the_shared_credentials_file_and_its_profile_are_read(seaweedfs, monkeypatch, tmp_path):
    """Without AWS_ACCESS_KEY_ID, the profile AWS_PROFILE names in AWS_SHARED_CREDENTIALS_FILE
    gives the key pair; the provider holds the file's path and the profile's name only."""
    e = seaweedfs.endpoint
    path = tmp_path / "credentials"
    path.write_text(f"[default]\naws_access_key_id = WRONG\naws_secret_access_key = wrong\n\n"
                    f"[tests]\naws_access_key_id = {e.access_key}\naws_secret_access_key = {e.secret_key}\n")
    aws_env(monkeypatch, {"AWS_SHARED_CREDENTIALS_FILE": str(path), "AWS_PROFILE": "tests", "AWS_REGION": e.region})
    found = SharedCredentialsFile.find()
    assert found == SharedCredentialsFile(str(path), "tests") and e.secret_key not in repr(found)
    backend = S3Backend(S3Location(e.bucket, "tests/shared-file", e.url))
    data = os.urandom(5000)
    assert _put(backend, data).written == {NewObject.of(data).ref.digest}
    assert backend.get(NewObject.of(data).ref) == data
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", e.access_key)  # a key in the variables wins: the file is not read
    assert SharedCredentialsFile.find() is None


def test_the_location_comes_from_the_settings_and_refuses_a_credential_in_them(tmp_path):
    root = {"SPARKCACHE_ROOT": str(tmp_path)}
    s = load_settings(env={**root, "SPARKCACHE_REMOTE_BUCKET": "kv-pages", "SPARKCACHE_REMOTE_ENDPOINT":
                           "http://127.0.0.1:8333", "SPARKCACHE_REMOTE_PREFIX": "prod/ns",
                           "SPARKCACHE_REMOTE_TIMEOUT_SECONDS": "5"})
    location = S3Location.from_settings(s)
    assert location == S3Location("kv-pages", "prod/ns", "http://127.0.0.1:8333", 2.0, 5.0, 2, 4)
    assert location.key("ab" * 32) == "prod/ns/objects/ab/" + "ab" * 32
    for name, value in (("SPARKCACHE_REMOTE_ENDPOINT", "http://AKIA:secret@host:9000"),
                        ("SPARKCACHE_REMOTE_ENDPOINT", "http://host/path"),
                        ("SPARKCACHE_REMOTE_BUCKET", "Upper_Case"), ("SPARKCACHE_REMOTE_PREFIX", "a/../b"),
                        ("SPARKCACHE_REMOTE_PREFIX", "/abs"), ("SPARKCACHE_REMOTE_TIMEOUT_SECONDS", "0")):
        with pytest.raises(SettingsError) as caught:
            load_settings(env={**root, name: value})
        assert name in str(caught.value) and repr(value) in str(caught.value)
    with pytest.raises(SettingsError, match="needs a bucket"):
        S3Location.from_settings(load_settings(env=root))
