"""The settings table: parsing, precedence, and errors that name setting, value and range."""

import pytest

from sparkcache.settings import (SETTINGS_TABLE, Settings, SettingsError, load_settings,
                                 parse_bytes, render_settings_help)

ROOT = {"SPARKCACHE_ROOT": "/var/cache/sc"}


def test_defaults_match_field_reports():
    s = load_settings(env=ROOT)
    assert isinstance(s, Settings)
    assert s.max_bytes == 40 << 30 and s.low_watermark_bytes == 32 << 30
    assert s.lease_seconds == 300 and s.capture_slots == 2 and s.capture_slot_bytes == 3 << 30
    assert s.access_mode == "read-write" and s.enabled


@pytest.mark.parametrize("text,value", [
    ("40GiB", 40 << 30), ("40Gi", 40 << 30), ("1.5GiB", 3 << 29), ("512MiB", 512 << 20),
    ("10GB", 10 * 10**9), ("4096", 4096), (" 2 TiB ", 2 << 40), ("7B", 7)])
def test_byte_suffixes(text, value):
    assert parse_bytes(text) == value


def test_env_and_extra_config_precedence():
    env = dict(ROOT, SPARKCACHE_MAX_BYTES="10GiB", SPARKCACHE_LOW_WATERMARK_BYTES="8GiB")
    s = load_settings(env=env, extra_config={"max_bytes": "20GiB", "ttl_seconds": 60})
    assert s.max_bytes == 20 << 30  # the dict wins
    assert s.low_watermark_bytes == 8 << 30  # env
    assert s.ttl_seconds == 60.0
    # keys that belong to other components are left alone
    load_settings(env=ROOT, extra_config={"gpu_lease_seconds": 300, "prefer_local_prefix": True})


@pytest.mark.parametrize("var,value,expect", [
    ("SPARKCACHE_MAX_BYTES", "3G", "GiB"),
    ("SPARKCACHE_MAX_BYTES", "12", "1MiB"),
    ("SPARKCACHE_ACCESS_MODE", "write-only", "read-write, restore-only, store-only, disabled"),
    ("SPARKCACHE_CAPTURE_SLOTS", "0", "1 .. 64"),
    ("SPARKCACHE_CAPTURE_SLOTS", "two", "1 .. 64"),
    ("SPARKCACHE_ENABLED", "maybe", "true/false"),
    ("SPARKCACHE_TTL_SECONDS", "-1", ">= 0"),
    ("SPARKCACHE_NAMESPACE", "../x", "matching"),
    ("SPARKCACHE_MAINTENANCE_MAX_MS", "0", "1 .. 60000"),
])
def test_bad_value_names_setting_value_and_range(var, value, expect):
    with pytest.raises(SettingsError) as err:
        load_settings(env=dict(ROOT, **{var: value}))
    msg = str(err.value)
    assert var in msg and repr(value) in msg and expect in msg, msg


def test_bad_value_from_extra_config_names_source():
    with pytest.raises(SettingsError) as err:
        load_settings(env=ROOT, extra_config={"capture_slots": 100})
    assert "SPARKCACHE_CAPTURE_SLOTS=100" in str(err.value)
    assert "kv_connector_extra_config" in str(err.value) and "1 .. 64" in str(err.value)


def test_low_watermark_above_max_is_an_error():
    with pytest.raises(SettingsError) as err:
        load_settings(env=dict(ROOT, SPARKCACHE_MAX_BYTES="10GiB",
                               SPARKCACHE_LOW_WATERMARK_BYTES="12GiB"))
    msg = str(err.value)
    assert "SPARKCACHE_LOW_WATERMARK_BYTES=12GiB" in msg and "SPARKCACHE_MAX_BYTES=10GiB" in msg
    assert "LOW_WATERMARK_BYTES <= MAX_BYTES" in msg


def test_misspelled_extra_config_key_is_an_error():
    with pytest.raises(SettingsError) as err:
        load_settings(env=ROOT, extra_config={"max_byte": "1GiB"})
    assert "max_bytes" in str(err.value) and "SPARKCACHE_MAX_BYTES" in str(err.value)


def test_root_required_and_absolute():
    with pytest.raises(SettingsError, match="SPARKCACHE_ROOT"):
        load_settings(env={})
    with pytest.raises(SettingsError, match="absolute"):
        load_settings(env={"SPARKCACHE_ROOT": "relative/dir"})
    assert load_settings(env={"SPARKCACHE_ENABLED": "0"}).enabled is False


def test_settings_frozen_and_replace_validates():
    s = load_settings(env=ROOT)
    with pytest.raises(Exception):
        s.max_bytes = 1  # type: ignore[misc]
    assert s.replace(max_bytes=100 << 30).max_bytes == 100 << 30
    with pytest.raises(SettingsError):
        s.replace(low_watermark_bytes=s.max_bytes + 1)


def test_help_lists_every_row():
    text = render_settings_help()
    for row in SETTINGS_TABLE:
        assert row.env_var in text and row.help[:20] in text
