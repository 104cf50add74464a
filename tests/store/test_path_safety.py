"""Manifests cannot name paths; symlinks are never followed."""

import os

import pytest

from sparkcache.store.manifests import Manifest, PageRef, encode
from store_helpers import IDENT, conv_keys, conv_pages, open_store, run_cli


def _forge(store, page_names):
    """A manifest with a valid checksum whose page names are the given strings."""
    keys = conv_keys(9, len(page_names) * 4)
    lookup_entry = store.lookup(IDENT, conv_keys(1, 4))
    good = lookup_entry.handle.pages[0]
    pages = tuple(PageRef(name, good.size) for name in page_names)
    from sparkcache.store.identity import entry_id_for
    idd = IDENT.digest()
    m = Manifest(entry_id_for(idd, keys[-1]), IDENT, tuple(keys), 4, pages, 0.0)
    path = store.layout.manifest_path(idd, m.entry_id)
    with open(path, "wb") as f:
        f.write(encode(m))
    return keys, path


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "..",
                                  "ab/../../../manifests"])
def test_manifest_naming_a_path_is_refused(tmp_path, name):
    store = open_store(tmp_path / "s")
    store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4))
    keys, path = _forge(store, [name])
    fresh = open_store(tmp_path / "s")
    result = fresh.lookup(IDENT, keys)
    assert not result.hit and result.reason == "corrupt"
    assert "unsafe_path" in result.detail
    cli = run_cli("verify", "--root", str(tmp_path / "s"))
    assert cli.returncode == 1 and path in cli.stdout and "unsafe_path" in cli.stdout


def test_object_replaced_by_symlink_outside_root(tmp_path):
    store = open_store(tmp_path / "s")
    pages = conv_pages(1, 4, 4)
    store.publish(IDENT, conv_keys(1, 4), pages)
    obj = store.objects.path(store.lookup(IDENT, conv_keys(1, 4)).handle.pages[0].digest)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(pages[0])  # identical bytes: only the symlink is wrong
    os.unlink(obj)
    os.symlink(outside, obj)
    fresh = open_store(tmp_path / "s")
    lookup, read = fresh.fetch(IDENT, conv_keys(1, 4))
    assert not lookup.hit and lookup.reason == "corrupt" and "symlink" in lookup.detail
    cli = run_cli("verify", "--root", str(tmp_path / "s"))
    assert cli.returncode == 1 and obj in cli.stdout


def test_shard_directory_symlinked_outside_root(tmp_path):
    store = open_store(tmp_path / "s")
    store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4))
    digest = store.lookup(IDENT, conv_keys(1, 4)).handle.pages[0].digest
    shard = os.path.join(store.layout.objects_dir, digest[:2])
    elsewhere = tmp_path / "elsewhere"
    os.rename(shard, elsewhere)
    os.symlink(elsewhere, shard)
    result = open_store(tmp_path / "s").lookup(IDENT, conv_keys(1, 4), verify=True)
    assert result.reason == "corrupt" and "symbolic link" in result.detail
    assert run_cli("verify", "--root", str(tmp_path / "s")).returncode == 1


def test_manifest_symlink_is_refused(tmp_path):
    store = open_store(tmp_path / "s")
    store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4))
    entry = store.entry(store.lookup(IDENT, conv_keys(1, 4)).entry_id)
    moved = tmp_path / "manifest-elsewhere"
    os.rename(entry.path, moved)
    os.symlink(moved, entry.path)
    result = open_store(tmp_path / "s").lookup(IDENT, conv_keys(1, 4))
    assert not result.hit and result.reason == "corrupt" and "symlink" in result.detail
    assert run_cli("verify", "--root", str(tmp_path / "s")).returncode == 1
