"""The settings table: parsing, precedence, and errors that name setting, value and range."""

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.settings import (SETTINGS_TABLE, Settings, SettingsError, load_settings,
                                 parse_bytes, render_settings_help)

ROOT = {"SPARKCACHE_ROOT": "/var/cache/sc"}


def _documented_defaults() -> dict[str, str]:
    """docs/SIZING.md's table of knobs: setting name (lower case) -> its default column.
    ``SPARKCACHE_A_MAX_X / _MAX_Y`` rows share a stem; ``80% of ... (32GiB)`` states the
    number in parentheses; ``0 (off)``, ``1.0 s`` and ``100 ms`` are numbers with a word."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "SIZING.md").read_text()
    # that table only (others, e.g. the shared tier's sizing, have a setting column too)
    doc = doc[doc.index("| setting | meaning | default |"):].split("\n\n", 1)[0]
    out = {}
    for names, default in re.findall(r"^\| `(SPARKCACHE_[A-Z_ /]+)` \|.*\| ([^|]+) \|$", doc, re.M):
        first, *more = [n.strip() for n in names.split("/")]
        for name, value in zip([first] + [first.rsplit("_", n.count("_"))[0] + n for n in more],
                               default.split(" / "), strict=True):
            inner = re.search(r"\(([^)]*\d[^)]*)\)", value)
            value = inner.group(1) if inner else re.sub(r"\(.*\)", "", value)
            out[name.removeprefix("SPARKCACHE_").lower()] = re.sub(r" (s|ms)$", "", value.strip())
    return out


def test_the_defaults_docs_sizing_states_are_the_defaults():
    """A default changed in the settings table but not in docs/SIZING.md (or the other way)
    fails here."""
    documented = _documented_defaults()
    assert {"max_bytes", "low_watermark_bytes", "maintenance_max_ms"} <= set(documented), documented
    s = load_settings(env=ROOT)
    assert isinstance(s, Settings)
    types = {row.name.lower(): row.type for row in SETTINGS_TABLE}
    for name, text in documented.items():
        value = parse_bytes(text) if types[name] == "bytes" else float(text)
        assert getattr(s, name) == value, (name, text, getattr(s, name))


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
    # the scheduler transforms' keys are read from the dict only
    s = load_settings(env=ROOT, extra_config={"sparkcache_gpu_lease_seconds": 300})
    assert s.gpu_lease_seconds == 300.0 and s.prefer_local_prefix is False


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
    ("SPARKCACHE_REMOTE_ENDPOINT", "https://key:secret@s3.example.com", "matching"),  # no credential in a setting
    ("SPARKCACHE_REMOTE_BUCKET", "My_Bucket", "matching"),
    ("SPARKCACHE_REMOTE_PREFIX", "a/../b", "matching"),
    ("SPARKCACHE_REMOTE_RETRIES", "11", "0 .. 10"),
    ("SPARKCACHE_REMOTE_TIMEOUT_SECONDS", "0", "0.1 .. 600"),
    ("SPARKCACHE_REMOTE_UPLOAD_QUEUE_BYTES", "1000", "1MiB"),
    ("SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS", "0", "0.05 .. 600"),
    ("SPARKCACHE_REMOTE_NEGATIVE_CACHE_SECONDS", "-1", "0 .. 3600"),
    ("SPARKCACHE_REMOTE_DRAIN_SECONDS", "-1", "0 .. 3600"),
    ("SPARKCACHE_REMOTE_MAX_BYTES", "2T", "TiB"),
    ("SPARKCACHE_REMOTE_GC_GRACE_SECONDS", "5", "60 .. 604800"),  # shorter than an upload could take
])
def test_bad_value_names_setting_value_and_range(var, value, expect):
    with pytest.raises(SettingsError) as err:
        load_settings(env=dict(ROOT, **{var: value}))
    msg = str(err.value)
    assert var in msg and repr(value) in msg and expect in msg, msg


def test_the_remote_bound_is_off_unless_set_and_the_grace_defaults_to_an_hour():
    s = load_settings(env=ROOT)
    assert (s.remote_max_bytes, s.remote_gc_grace_seconds) == (0, 3600.0)
    s = load_settings(env=dict(ROOT, SPARKCACHE_REMOTE_MAX_BYTES="2TiB"), extra_config={"remote_gc_grace_seconds": 600})
    assert (s.remote_max_bytes, s.remote_gc_grace_seconds) == (2 << 40, 600.0)


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


def test_a_cap_alone_sets_the_low_watermark_to_80_percent_of_it():
    """MAX_BYTES without LOW_WATERMARK_BYTES is a valid setting (the default watermark,
    32 GiB, would exceed a smaller cap); a watermark that is set is kept as set."""
    for extra, env in (({"max_bytes": "160MiB"}, ROOT), ({}, dict(ROOT, SPARKCACHE_MAX_BYTES="10GiB"))):
        s = load_settings(env=env, extra_config=extra)
        assert s.low_watermark_bytes == s.max_bytes * 4 // 5, (extra, env)
    s = load_settings(env=dict(ROOT, SPARKCACHE_LOW_WATERMARK_BYTES="1GiB"), extra_config={"max_bytes": "2GiB"})
    assert (s.max_bytes, s.low_watermark_bytes) == (2 << 30, 1 << 30)


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
        assert row.label in text and row.help[:20] in text


@pytest.mark.parametrize("extra,expect", [
    ({"gpu_lease_seconds": 300}, "'sparkcache_gpu_lease_seconds'"),
    ({"prefer_local_prefix": True}, "'sparkcache_prefer_local_prefix'"),
    ({"acess_mode": "restore-only"}, "'access_mode' (SPARKCACHE_ACCESS_MODE)"),
    ({"shared_storage_path": "/x"}, "not a sparkcache setting"),
])
def test_unknown_extra_config_key_is_refused_with_the_nearest(extra, expect):
    with pytest.raises(SettingsError) as err:
        load_settings(env=ROOT, extra_config=extra)
    assert expect in str(err.value) and repr(next(iter(extra))) in str(err.value), str(err.value)


def test_unknown_environment_name_is_refused_with_the_nearest():
    with pytest.raises(SettingsError) as err:
        load_settings(env=dict(ROOT, SPARKCACHE_ACESS_MODE="restore-only"))
    assert "SPARKCACHE_ACESS_MODE='restore-only'" in str(err.value)
    assert "SPARKCACHE_ACCESS_MODE" in str(err.value)
    # the tools' own variables and other programs' variables are fine
    load_settings(env=dict(ROOT, SPARKCACHE_TINYMODEL_CACHE="/tmp/m", VLLM_CPU_KVCACHE_SPACE="1"))
    # a transform option is not an environment variable
    with pytest.raises(SettingsError, match="read from kv_connector_extra_config.'sparkcache_prefer_local_prefix'. only"):
        load_settings(env=dict(ROOT, SPARKCACHE_PREFER_LOCAL_PREFIX="1"))


@pytest.mark.parametrize("key,value", [
    ("ttl_seconds", "nan"), ("ttl_seconds", float("nan")), ("lease_seconds", "inf"),
    ("maintenance_max_ms", float("inf")), ("sparkcache_gpu_lease_seconds", float("nan")),
])
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(SettingsError, match="finite"):
        load_settings(env=ROOT, extra_config={key: value})


@pytest.mark.parametrize("key,value", [("namespace", None), ("root", None), ("weights_fingerprint", 7),
                                       ("access_mode", None)])
def test_a_string_setting_is_a_string(key, value):
    with pytest.raises(SettingsError, match="expected a string"):
        load_settings(env=ROOT, extra_config={key: value})


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_transform_booleans_are_json_booleans(value):
    with pytest.raises(SettingsError) as err:
        load_settings(env=ROOT, extra_config={"sparkcache_prefer_local_prefix": value})
    assert "kv_connector_extra_config['sparkcache_prefer_local_prefix']" in str(err.value)
    assert "true/false" in str(err.value)
    assert load_settings(env=ROOT, extra_config={"sparkcache_prefer_local_prefix": False}).prefer_local_prefix is False


@pytest.mark.parametrize("value", ["30", True, 0, -1])
def test_transform_lease_is_a_positive_json_number(value):
    with pytest.raises(SettingsError, match="sparkcache_gpu_lease_seconds"):
        load_settings(env=ROOT, extra_config={"sparkcache_gpu_lease_seconds": value})


def test_transform_option_reads_only_its_key():
    from sparkcache.settings import transform_option

    key = "sparkcache_prefer_local_prefix"
    # other keys of the shared dict are not looked at; absent is the row's default
    assert transform_option({"probe_delay_free": "x", key: True}, key) is True
    assert transform_option({"probe_delay_free": "x"}, key) is False
    assert transform_option(None, "sparkcache_gpu_lease_seconds") is None
    assert transform_option({"sparkcache_gpu_lease_seconds": 30}, "sparkcache_gpu_lease_seconds") == 30.0
    for not_an_option in ("max_bytes", "sparkcache_prefer_local_prefixx"):
        with pytest.raises(SettingsError, match="not a scheduler transform option; known: "):
            transform_option({}, not_an_option)


@pytest.mark.parametrize("key,value", [("sparkcache_prefer_local_prefix", "false"),
                                       ("sparkcache_gpu_lease_seconds", "5")])
def test_transform_option_refuses_word_for_word_as_the_connector(key, value):
    from sparkcache.settings import transform_option

    with pytest.raises(ValueError) as from_transform:
        transform_option({key: value}, key)
    with pytest.raises(SettingsError) as from_connector:
        load_settings(env=ROOT, extra_config={key: value})
    assert str(from_transform.value) == str(from_connector.value)
    assert f"kv_connector_extra_config[{key!r}]={value!r}" in str(from_transform.value)


def test_a_root_per_tensor_parallel_rank():
    s = load_settings(env={"SPARKCACHE_ROOT": "/cache/rank{rank}/sc"})
    assert s.per_rank_root and s.for_rank(3).root == "/cache/rank3/sc" and not s.for_rank(3).per_rank_root
    plain = load_settings(env=ROOT)
    assert not plain.per_rank_root and plain.for_rank(5) is plain  # every rank shares it


@pytest.mark.parametrize("root", ["/cache/{rnk}", "/cache/{}", "/cache/{rank", "/cache/rank}",
                                  "/cache/{RANK}", "/c/{rank}{tp}"])
def test_a_root_with_another_placeholder_is_refused(root):
    with pytest.raises(SettingsError, match=r"only placeholder a root may hold is \{rank\}"):
        load_settings(env={"SPARKCACHE_ROOT": root})


_PLAIN = st.text(alphabet="abcXYZ09._-=+,@%", min_size=1, max_size=8)  # a path's own characters


@given(st.lists(st.one_of(_PLAIN, st.just("{rank}"), st.sampled_from(["{", "}", "{rnk}", "{}"])),
                min_size=1, max_size=5), st.integers(0, 1023))
def test_a_root_is_refused_exactly_when_a_brace_is_not_part_of_rank(parts, rank):
    root = "/c/" + "/".join(parts)
    stray = any(p in ("{", "}", "{rnk}", "{}") for p in parts)
    try:
        s = load_settings(env={}, extra_config={"root": root})
    except SettingsError as exc:
        assert stray == ("only placeholder" in str(exc)), (root, exc)
        return
    assert not stray
    assert s.for_rank(rank).root == "/c/" + "/".join(str(rank) if p == "{rank}" else p for p in parts)
    assert s.per_rank_root == ("{rank}" in parts)
