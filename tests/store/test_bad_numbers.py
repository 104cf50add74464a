"""Bad numbers handed to the store's constructors directly (``PageStore``, ``PassBudget``,
``MaintenanceThread``, the lock waits): a NaN, an infinity or a negative size is refused with a
message naming the parameter, the value, what is allowed and the setting that feeds it, as the
settings table refuses it from the environment. Real filesystem, no mocks."""

from __future__ import annotations

import fcntl
import math
import os

import pytest

from sparkcache.store import MaintenanceThread, PassBudget
from sparkcache.store.locks import exclusive_lock, flock_within, shared_lock
from store_helpers import open_store

NAN, INF = math.nan, math.inf

# (constructor, keyword, bad value): every one refused, naming the keyword
_STORE_CASES = [
    ("lease_seconds", NAN), ("lease_seconds", INF), ("lease_seconds", 0), ("lease_seconds", -1.0),
    ("ttl_seconds", NAN), ("ttl_seconds", INF), ("ttl_seconds", -5.0),
    ("max_bytes", -1), ("max_bytes", 0), ("max_bytes", NAN), ("max_bytes", 1.5),
    ("max_bytes", True), ("low_watermark_bytes", -1), ("min_free_bytes", -1),
    ("min_free_bytes", INF), ("page_blocks", 0), ("page_blocks", 2.0),
]


@pytest.mark.parametrize("key,value", _STORE_CASES)
def test_the_store_refuses_a_nonsensical_number(tmp_path, key, value):
    with pytest.raises(ValueError) as info:
        open_store(tmp_path / "s", **({"low_watermark_bytes": 0} if key == "max_bytes" else {}),
                   **{key: value})
    message = str(info.value)
    assert f"PageStore({key}={value!r})" in message and "allowed:" in message, message
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_a_nan_lease_no_longer_lets_maintenance_evict_a_leased_entry(tmp_path):
    """What the NaN did: a pin that expires at NaN protects nothing."""
    with pytest.raises(ValueError, match="lease_seconds=nan"):
        open_store(tmp_path / "s", lease_seconds=NAN, ttl_seconds=1.0)


@pytest.mark.parametrize("key,value", [
    ("max_ms", NAN), ("max_ms", INF), ("max_ms", 0), ("max_ms", -1.0), ("max_entries", 0),
    ("max_entries", 1.5), ("max_bytes", -1), ("max_bytes", NAN)])
def test_a_pass_budget_refuses_a_nonsensical_number(key, value):
    with pytest.raises(ValueError) as info:
        PassBudget(**{key: value})
    message = str(info.value)
    assert f"PassBudget({key}={value!r})" in message and "allowed:" in message, message


@pytest.mark.parametrize("key,value", [
    ("interval_s", NAN), ("interval_s", INF), ("interval_s", 0), ("interval_s", -1.0),
    ("sweep_every_s", NAN), ("sweep_every_s", -1.0), ("nice", 1.5), ("nice", 40),
    ("keep_reports", -1)])
def test_a_maintenance_thread_refuses_a_nonsensical_number(tmp_path, key, value):
    store = open_store(tmp_path / "s")
    kwargs = {"interval_s": 1.0, key: value}
    with pytest.raises(ValueError) as info:
        MaintenanceThread(store, PassBudget(), **kwargs)
    message = str(info.value)
    assert f"MaintenanceThread({key}={value!r})" in message and "allowed:" in message, message


@pytest.mark.parametrize("value", [NAN, INF, -1.0])
def test_a_lock_wait_refuses_a_nonsensical_number(tmp_path, value):
    store = open_store(tmp_path / "s")
    for take in (shared_lock, exclusive_lock):
        with pytest.raises(ValueError, match=r"timeout_s=.*allowed:"):
            with take(store.layout, value):
                pass
    fd = os.open(store.layout.gc_lock_path, os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match=r"timeout_s=.*allowed:"):
            flock_within(fd, fcntl.LOCK_SH, value, store.layout.gc_lock_path)
    finally:
        os.close(fd)


def test_good_values_still_open(tmp_path):
    store = open_store(tmp_path / "s", lease_seconds=0.5, ttl_seconds=0, min_free_bytes=0)
    assert store.lease_seconds == 0.5
    PassBudget(max_entries=1, max_bytes=1, max_ms=0.5)
    MaintenanceThread(store, PassBudget(), 0.01, sweep_every_s=0, nice=None)
