"""Opening a store with a snapshot (``journal/snapshot``) gives the view a full decode of every
manifest gives, reading only each manifest's header: what changed after the snapshot (a
manifest replaced, removed, added, damaged) is read from disk, a damaged snapshot is ignored,
and a writer's maintenance asks for one in its own process."""

from __future__ import annotations

import os

from sparkcache.store import snapshot
from sparkcache.store.snapshot import SnapshotWriter

from store_helpers import IDENT, conv_keys, conv_pages, open_store


def _view(store) -> dict:
    return {e.entry_id: (e.manifest, e.inode, e.manifest_bytes) for e in store.entries()}


def _published(root, convs) -> None:
    store = open_store(root)
    for conv in convs:
        assert store.publish(IDENT, conv_keys(conv, 9), conv_pages(conv, 9, 4)).ok
    store.close()


def _reads_whole_manifests(store_root, monkeypatch) -> list[str]:
    """Open a reader and return the manifests it read whole (decoded)."""
    from sparkcache.store import index
    decoded = []
    real = index.decode
    monkeypatch.setattr(index, "decode", lambda data, **kw: decoded.append(kw["expected_entry_id"]) or real(data, **kw))
    open_store(store_root, read_only=True).close()
    monkeypatch.undo()
    return decoded


def test_a_snapshot_gives_the_same_view_reading_only_headers(tmp_path, monkeypatch):
    _published(tmp_path, range(6))
    without = _view(open_store(tmp_path, read_only=True))
    from sparkcache.store.layout import StoreLayout
    layout = StoreLayout.create(str(tmp_path), make=False)
    assert snapshot.write(layout) == 6
    assert _reads_whole_manifests(tmp_path, monkeypatch) == []
    reader = open_store(tmp_path, read_only=True)
    assert _view(reader) == without
    assert reader.capacity() == open_store(tmp_path, read_only=True).capacity()
    assert all(reader.lookup(IDENT, conv_keys(c, 9)).hit for c in range(6))


def test_what_changed_after_the_snapshot_is_read_from_disk(tmp_path, monkeypatch):
    _published(tmp_path, range(4))
    from sparkcache.store.layout import StoreLayout
    layout = StoreLayout.create(str(tmp_path), make=False)
    snapshot.write(layout)
    store = open_store(tmp_path)
    gone = store.lookup(IDENT, conv_keys(0, 9)).entry_id
    assert store.discard([gone]) == (gone,)
    assert store.publish(IDENT, conv_keys(1, 9), conv_pages(7, 9, 4)).ok  # replaced: other pages
    assert store.publish(IDENT, conv_keys(5, 9), conv_pages(5, 9, 4)).ok  # new
    replaced = store.lookup(IDENT, conv_keys(1, 9)).entry_id
    added = store.lookup(IDENT, conv_keys(5, 9)).entry_id
    store.close()
    assert sorted(_reads_whole_manifests(tmp_path, monkeypatch)) == sorted([replaced, added])
    reader = open_store(tmp_path, read_only=True)
    assert reader.entry(gone) is None
    assert reader.read(reader.lookup(IDENT, conv_keys(1, 9)).handle).pages == tuple(conv_pages(7, 9, 4))
    assert _view(reader) == _view(open_store(tmp_path, read_only=True))


def test_a_damaged_snapshot_is_ignored(tmp_path, monkeypatch):
    _published(tmp_path, range(3))
    from sparkcache.store.layout import StoreLayout
    layout = StoreLayout.create(str(tmp_path), make=False)
    snapshot.write(layout)
    with open(layout.snapshot_path, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 1]))
    assert snapshot.read(layout) is None
    assert len(_reads_whole_manifests(tmp_path, monkeypatch)) == 3


def test_maintenance_asks_for_a_snapshot_in_its_own_process(tmp_path):
    _published(tmp_path, range(3))
    store = open_store(tmp_path)
    writer = SnapshotWriter(store.layout, min_entries=3, every_s=0.0)
    assert writer.maybe_start(store.capacity().entries)
    assert writer.wait(120) == 0
    loaded = snapshot.read(store.layout)
    assert loaded is not None and len(loaded) == 3
    assert not writer.maybe_start(store.capacity().entries)  # the journal did not move since
    store.close()


def test_verify_reads_every_manifest_whole_whatever_the_snapshot_says(tmp_path):
    """A manifest whose body was damaged after the snapshot (its header intact) opens as the
    snapshot recorded it, but ``verify``, the store's own check, must find it: it used the
    snapshot and reported the store clean."""
    from sparkcache.store import verify_store
    from sparkcache.store.layout import StoreLayout
    _published(tmp_path, range(3))
    layout = StoreLayout.create(str(tmp_path), make=False)
    snapshot.write(layout)
    reader = open_store(tmp_path, read_only=True)
    damaged = reader.entry(reader.lookup(IDENT, conv_keys(1, 9)).entry_id)
    with open(damaged.path, "r+b") as f:
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([byte[0] ^ 1]))
    problems = verify_store(layout).problems
    assert [(p.kind, p.entries) for p in problems] == [("corrupt_manifest", (damaged.entry_id,))], problems


def test_verify_refuses_a_huge_manifest_without_reading_it(tmp_path):
    """With a snapshot, verify read a manifest whole before looking at its size: one grown
    to 2 GiB (sparse) made it allocate that much (MemoryError under a memory limit) instead
    of reporting it, as it does without a snapshot."""
    import subprocess
    import sys
    from sparkcache.store.layout import StoreLayout
    _published(tmp_path, range(2))
    layout = StoreLayout.create(str(tmp_path), make=False)
    snapshot.write(layout)
    reader = open_store(tmp_path, read_only=True)
    huge = reader.entry(reader.lookup(IDENT, conv_keys(1, 9)).entry_id)
    os.truncate(huge.path, 2 << 30)
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20)); "
              "from sparkcache.store import verify_store; from sparkcache.store.layout import StoreLayout; "
              "print(sorted((p.kind, p.entries) for p in verify_store("
              "StoreLayout.create(sys.argv[1], make=False)).problems))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([("corrupt_manifest", (huge.entry_id,))]), done.stdout
