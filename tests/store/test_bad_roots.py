"""Bad store roots and namespaces: refused where they enter, with a message naming the
setting (SPARKCACHE_ROOT, SPARKCACHE_NAMESPACE), the value and the fix, whether they come
through the settings or a direct call (``PageStore(...)``, ``StoreLayout.create``). Real
filesystem, no mocks."""

from __future__ import annotations

import os

import pytest

from sparkcache.settings import SettingsError, load_settings
from sparkcache.store import PageStore
from sparkcache.store.layout import StoreLayout


def _roots(tmp_path) -> dict[str, str]:
    (tmp_path / "a-file").write_bytes(b"not a directory")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "default").write_bytes(b"a file where the namespace belongs")
    return {"nul": str(tmp_path / "cache\0x"),
            "a_file": str(tmp_path / "a-file"),
            "below_a_file": str(tmp_path / "a-file" / "cache"),
            "namespace_a_file": str(tmp_path / "ok")}


@pytest.mark.parametrize("kind", ["nul", "a_file", "below_a_file"])
def test_a_bad_root_is_refused_by_the_settings(tmp_path, kind):
    root = _roots(tmp_path)[kind]
    with pytest.raises(SettingsError) as info:
        load_settings(env={"SPARKCACHE_ROOT": root})
    message = str(info.value)
    assert "SPARKCACHE_ROOT" in message and repr(root) in message, message
    assert "directory" in message, message  # the fix: a directory path


def test_a_root_per_rank_below_a_file_is_refused_by_the_settings(tmp_path):
    _roots(tmp_path)
    root = str(tmp_path / "a-file" / "rank{rank}")
    with pytest.raises(SettingsError, match="SPARKCACHE_ROOT"):
        load_settings(env={"SPARKCACHE_ROOT": root})


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("kind", ["nul", "a_file", "below_a_file", "namespace_a_file"])
def test_a_bad_root_is_refused_by_the_store_with_the_setting_named(tmp_path, kind, read_only):
    root = _roots(tmp_path)[kind]
    for opener in (lambda: PageStore(root, read_only=read_only),
                   lambda: StoreLayout.create(root, make=not read_only)):
        with pytest.raises(ValueError) as info:  # a SettingsError is a ValueError
            opener()
        message = str(info.value)
        assert "SPARKCACHE_ROOT" in message and repr(root) in message, message
        assert "directory" in message, message
    assert not os.path.exists(tmp_path / "a-file" / "default")


@pytest.mark.parametrize("namespace", ["a\0b", "", "..", "a/b", "-x", "x" * 65])
def test_a_bad_namespace_is_refused_by_the_store_with_the_setting_named(tmp_path, namespace):
    with pytest.raises(ValueError) as info:
        PageStore(str(tmp_path / "s"), namespace=namespace)
    assert "SPARKCACHE_NAMESPACE" in str(info.value) and repr(namespace) in str(info.value)
