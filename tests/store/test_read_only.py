"""A reader writes nothing under the root: restore-only's store, ``sparkcache status``,
``verify`` and ``inspect``. Shown on a real read-only bind mount (this suite runs as root, as
CI does) and on a writable root, where every file's bytes and mtime and the set of files
and directories must stay as they were."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkcache.store import PageStore

from mounts import read_only_view
from store_helpers import IDENT, conv_keys, conv_pages, open_store, run_cli

pytestmark = [pytest.mark.root]


def _state(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns,
                                             p.read_bytes() if p.is_file() else b"")
    return out


@pytest.fixture
def published(tmp_path) -> Path:
    root = tmp_path / "store"
    store = open_store(root)
    for conv in (1, 2):
        assert store.publish(IDENT, conv_keys(conv, 10), conv_pages(conv, 10, 4)).ok
    return root


@pytest.fixture
def read_only_mount(published, tmp_path):
    with read_only_view(published, tmp_path / "ro") as mnt:
        yield mnt


def _read_everything(root: Path) -> None:
    store = PageStore(str(root), page_blocks=4, read_only=True)
    lookup = store.lookup(IDENT, conv_keys(1, 10), lease=True)
    assert lookup.hit_blocks == 10 and lookup.lease_id is None
    found, read = store.fetch(IDENT, conv_keys(2, 10))
    assert found.hit and read.ok and list(read.pages) == conv_pages(2, 10, 4)
    assert store.capacity().entries == 2
    with pytest.raises(PermissionError, match="read-only"):
        store.publish(IDENT, conv_keys(3, 4), conv_pages(3, 4, 4))
    for args in (["status", "--root", str(root)], ["verify", "--root", str(root)],
                 ["inspect", lookup.entry_id[:12], "--root", str(root), "--verify"]):
        res = run_cli(*args)
        assert res.returncode == 0, (args, res.stdout, res.stderr)


def test_a_reader_works_on_a_read_only_mount(read_only_mount):
    before = _state(read_only_mount)
    _read_everything(read_only_mount)
    assert _state(read_only_mount) == before


def test_a_reader_changes_nothing_on_a_writable_root(published):
    before = _state(published)
    _read_everything(published)
    assert _state(published) == before
