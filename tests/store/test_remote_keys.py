"""The shared tier's key names (``remote_keys``): each kind of key is made and read back, an
object's key is the S3 backend's own, pointers sit at the block index's positions, and a key
that is none of ours (another prefix, a malformed name) is read as None."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.settings import SettingsError
from sparkcache.store.identity import Identity
from sparkcache.store.remote_keys import (KeyKind, RemoteKeys, namespace_prefix, parse_key, pointer_name,
                                          pointer_positions)
from sparkcache.store.s3_location import S3Location
from sparkcache.store.strides import STRIDE

IDD = "0123456789abcdef0123456789abcdef"
EID = "a" * 40
DIGEST = "b" * 64
KEYS = RemoteKeys("sc/tier", "prod", IDD)


def test_each_kind_is_named_under_the_identity() -> None:
    assert KEYS.base == f"sc/tier/prod/{IDD}"
    assert KEYS.object_key(DIGEST) == f"sc/tier/prod/{IDD}/objects/bb/{DIGEST}"
    assert KEYS.manifest_key(EID) == f"sc/tier/prod/{IDD}/manifests/{EID}.mf"
    assert KEYS.pointer_key("c0ffee") == f"sc/tier/prod/{IDD}/keys/c0ffee"
    assert KEYS.access_key(EID) == f"sc/tier/prod/{IDD}/access/{EID}"
    assert KEYS.kind_prefix(KeyKind.MANIFEST) == f"sc/tier/prod/{IDD}/manifests/"
    assert namespace_prefix("sc/tier", "prod") == "sc/tier/prod/"


def test_a_ranks_objects_are_its_units_and_the_rest_its_own() -> None:
    rank0 = Identity("m", "bf16:L2", 16, 0, "lock")
    rank1 = dataclasses.replace(rank0, tp_rank=1)
    assert rank1.unit_digest() == rank0.unit_digest() == rank0.digest() != rank1.digest()
    keys = RemoteKeys.of("sc/tier", "prod", rank1)
    assert keys == RemoteKeys("sc/tier", "prod", rank1.digest(), rank0.digest())
    assert keys.object_key(DIGEST) == RemoteKeys.of("sc/tier", "prod", rank0).object_key(DIGEST)
    assert keys.kind_prefix(KeyKind.OBJECT) == f"sc/tier/prod/{rank0.digest()}/objects/"
    assert keys.manifest_key(EID) == f"sc/tier/prod/{rank1.digest()}/manifests/{EID}.mf"
    assert keys.pointer_key("c0ffee").startswith(keys.base + "/keys/") and keys.base != keys.objects_base
    assert S3Location("bucket", prefix=keys.objects_base).key(DIGEST) == keys.object_key(DIGEST)
    assert parse_key("sc/tier", keys.object_key(DIGEST)).keys == RemoteKeys("sc/tier", "prod", rank0.digest())
    with pytest.raises(ValueError, match="unit digest"):
        RemoteKeys("sc", "prod", IDD, "x" * 32)


def test_an_object_key_is_the_s3_backends_own() -> None:
    location = S3Location("bucket", prefix=KEYS.base)
    assert location.key(DIGEST) == KEYS.object_key(DIGEST)


@pytest.mark.parametrize("kind,key,name", [
    (KeyKind.OBJECT, KEYS.object_key(DIGEST), DIGEST),
    (KeyKind.MANIFEST, KEYS.manifest_key(EID), EID),
    (KeyKind.POINTER, KEYS.pointer_key("-1f"), "-1f"),
    (KeyKind.POINTER, KEYS.pointer_key("a/b c"), pointer_name("a/b c")),
    (KeyKind.ACCESS, KEYS.access_key(EID), EID),
])
def test_a_listed_key_is_read_back(kind, key, name) -> None:
    assert parse_key("sc/tier", key) == type(parse_key("sc/tier", key))(KEYS, kind, name)


@pytest.mark.parametrize("key", [
    f"other/prod/{IDD}/manifests/{EID}.mf",  # another prefix
    f"sc/tier/prod/{IDD}/manifests/{EID}",  # no suffix
    f"sc/tier/prod/{IDD}/manifests/{EID[:-1]}.mf",  # short id
    f"sc/tier/prod/{IDD[:-1]}/access/{EID}",  # short identity digest
    f"sc/tier/prod/{IDD}/objects/aa/{DIGEST}",  # wrong shard
    f"sc/tier/prod/{IDD}/objects/{DIGEST}",  # no shard
    f"sc/tier/prod/{IDD}/keys/x/y",  # nested
    f"sc/tier/prod/{IDD}/keys/XYZ",  # not a pointer name
    f"sc/tier/prod/{IDD}/other/{EID}",  # unknown kind
    f"sc/tier/.bad/{IDD}/access/{EID}",  # bad namespace
])
def test_a_key_that_is_not_ours_is_none(key) -> None:
    assert parse_key("sc/tier", key) is None


def test_bad_values_are_refused_naming_them() -> None:
    with pytest.raises(SettingsError, match="REMOTE_PREFIX"):
        RemoteKeys("../x", "prod", IDD)
    with pytest.raises(SettingsError, match="NAMESPACE"):
        RemoteKeys("sc", "a/b", IDD)
    with pytest.raises(ValueError, match="identity digest"):
        RemoteKeys("sc", "prod", IDD[:16])
    with pytest.raises(ValueError, match="entry id"):
        KEYS.manifest_key("abc")
    with pytest.raises(ValueError, match="block key"):
        pointer_name("")


def test_pointers_sit_at_the_indexed_positions() -> None:
    assert pointer_positions(1) == [0]
    assert pointer_positions(STRIDE) == [0, STRIDE - 1]
    assert pointer_positions(3 * STRIDE + 2) == [0, STRIDE - 1, 2 * STRIDE - 1, 3 * STRIDE - 1]


@given(st.text(min_size=1, max_size=80).filter(lambda s: "\n" not in s),
       st.text(min_size=1, max_size=80).filter(lambda s: "\n" not in s))
def test_pointer_names_are_safe_and_distinct(a: str, b: str) -> None:
    for key in (a, b):
        parsed = parse_key("sc/tier", KEYS.pointer_key(key))
        assert parsed is not None and parsed.kind is KeyKind.POINTER
    assert (pointer_name(a) == pointer_name(b)) == (a == b)
