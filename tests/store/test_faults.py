"""Deletion is decided only on positive knowledge: on a real filesystem that fails on demand
(``tests/faultfs.py``: FUSE), an I/O or permission error at any listing or read that a
writer's open or a maintenance pass makes never removes a file the same work would keep
without the error.

The scenario: a store over its cap (the pass evicts its least recently used entries), one
old entry pinned (never evicted), an orphan object (swept), a live publication's declared
object that no manifest names yet (kept). The clean run removes some files; a run with one
failure injected may remove fewer, never another: ``removed(fault) <= removed(clean)``.

Below them, what the state machine of ``test_fault_properties.py`` found, each reduced to one
fault at one place: a manifest whose unlink fails keeps its objects (an eviction, a
supersession); a pass that cannot stamp the pins directory expires nothing by its wall clock;
a failed close of an object, of a publication's intent, of an abandoned temp file or of a
manifest is not an exception; a view that could not read a manifest or list its directory
at open finds its entries once they read again, in a process that runs no pass; and a
publication that fails with its manifest in place (from the rename on) leaves its intent, whose
removal (a failed close there being no error) waits until the journal asks every process to
list the manifests again, so another process's sweep keeps that manifest's objects.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from sparkcache.store import PageStore, PassBudget, run_pass, verify_store
from sparkcache.store.clocks import Clock
from sparkcache.store.objects import digest_of
from sparkcache.store.pins import create_pin
from sparkcache.store.staging import Staging

from faultfs import FaultFS
from store_helpers import IDENT, conv_keys, conv_pages, stopped_clock

pytestmark = pytest.mark.root  # FUSE mounts need root (CI and the developers' machines)

CONVS = (1, 2, 3, 4, 5)  # published oldest first
PINNED = 1
PER_BLOCK = 2048
BUDGET = PassBudget(max_entries=1000, max_bytes=1 << 40, max_ms=1e9)
ORPHAN = b"orphan page bytes" * 64
LIVE = b"a live publication's page" * 64
LISTINGS_AND_READS = ("readdir", "open", "read")  # at every path
# and every lookup or open of a directory on the way to what decides a deletion (the walk to an
# object only ever fails its removal)
DECIDING = ("getattr", "opendir")
DECIDING_UNDER = ("/default/manifests", "/default/staging", "/default/pins")


def _open(root: Path, **kw) -> PageStore:
    return PageStore(str(root), page_blocks=4, max_bytes=kw.pop("max_bytes", 1 << 30),
                     low_watermark_bytes=kw.pop("low", 1 << 29), **kw)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> tuple[Path, int, int]:
    """A store (plain directory) with five entries of different ages, an orphan object,
    and the caps that make a pass evict about half of them."""
    root = tmp_path_factory.mktemp("template")
    store = _open(root, max_bytes=1 << 20, low=1 << 19)
    for age, conv in enumerate(CONVS):
        assert store.publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4, PER_BLOCK)).ok
        entry = store.catalog.entry(_entry_id(store, conv))
        store.accesses.flush()  # the lookup's own stamp lands first (accesses.py), then ours
        os.utime(entry.path, (1000.0 + age, 1000.0 + age))
    orphan = store.objects.path(digest_of(ORPHAN))
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    Path(orphan).write_bytes(ORPHAN)
    used = store.capacity().used_bytes
    store.close()
    os.unlink(root / "default" / "locks" / "cap.json")  # each run's writer records its own cap
    return root, used - 1, used // 2


def _entry_id(store: PageStore, conv: int) -> str:
    hit = store.lookup(IDENT, conv_keys(conv, 8))
    assert hit.hit, hit
    return hit.entry_id


def _files(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")
            if p.is_file() and "/staging/" not in f"/{p.relative_to(top)}" and "/locks/" not in str(p)}


class _LivePublication:
    """A publication in flight in this process: its intent holds the flock and declares an
    object that no manifest names yet."""

    def __init__(self, store_root: Path) -> None:
        from sparkcache.store.layout import StoreLayout
        self.layout = StoreLayout.create(str(store_root), make=False)
        self.staging = Staging(self.layout)

    def __enter__(self):
        self.staging.open()
        digest = digest_of(LIVE)
        self.staging.declare([digest])
        path = Path(self.layout.object_path(digest))
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(LIVE)
        return self

    def __exit__(self, *exc) -> None:
        self.staging.close()


def _run(fs: FaultFS, template, fault: tuple[str, str, int, int] | None) -> set[str]:
    """Copy the template into the backing directory, open a writer on the mount (recovery),
    pin the oldest entry, run one pass with a full sweep while a publication is live, and
    return the files removed. ``fault``: (op, path, occurrence, errno) failed once."""
    root, cap, low = template
    shutil.rmtree(fs.backing / "default", ignore_errors=True)
    shutil.copytree(root / "default", fs.backing / "default", copy_function=shutil.copy2)
    before = _files(fs.backing)
    fs.clear()
    with _LivePublication(fs.mount):
        pin_store = _open(fs.mount, read_only=True)
        pinned = _entry_id(pin_store, PINNED)
        create_pin(pin_store.layout, pinned, 3600)
        pin_store.close()
        if fault is not None:
            op, path, nth, err = fault
            fs.fail(op, "^" + path + "$", err, after=nth)
        try:
            store = _open(fs.mount, max_bytes=cap, low=low)
        except OSError as exc:  # a writer that cannot open removes nothing
            report = f"open failed: {exc}"
        else:
            report = run_pass(store, BUDGET, sweep_shards=256, timer=stopped_clock)
            store.close()
    assert fs.fired() == (fault is not None), f"the fault {fault} never happened"
    after = _files(fs.backing)
    return before - after, report


_RANDOM_NAMES = ((re.compile(r"(?<=/staging/)[0-9a-f]{24}"), "PUBLICATIONTOKEN", "[0-9a-f]{24}"),
                 (re.compile(r"(?<=\.)[0-9a-f]{16}(?=\.pin)"), "PINTOKEN", "[0-9a-f]{16}"))


def _pattern(path: str) -> str:
    """A path as a regular expression, with the names a run draws at random (publication
    tokens, pin tokens) matching any such name."""
    for name, word, _ in _RANDOM_NAMES:
        path = name.sub(word, path)
    out = re.escape(path)
    for _, word, any_such in _RANDOM_NAMES:
        out = out.replace(word, any_such)
    return out


def _ops_of_clean_run(fs: FaultFS, template) -> list[tuple[str, str, int]]:
    """Every listing and read (op, path, occurrence) a writer's open and a pass make."""
    root, cap, low = template
    shutil.rmtree(fs.backing / "default", ignore_errors=True)
    shutil.copytree(root / "default", fs.backing / "default", copy_function=shutil.copy2)
    with _LivePublication(fs.mount):
        pin_store = _open(fs.mount, read_only=True)
        create_pin(pin_store.layout, _entry_id(pin_store, PINNED), 3600)
        pin_store.close()
        fs.record(True)
        store = _open(fs.mount, max_bytes=cap, low=low)
        run_pass(store, BUDGET, sweep_shards=256, timer=stopped_clock)
        store.close()
        log = fs.take_log()
    seen: dict[tuple[str, str], int] = {}
    out = []
    for op, path in log:
        path = _pattern(path)
        n = seen.get((op, path), 0)
        seen[(op, path)] = n + 1
        if op in LISTINGS_AND_READS or (op in DECIDING and path.startswith(DECIDING_UNDER)):
            out.append((op, path, n))
    return out


@pytest.fixture(scope="module")
def fs(tmp_path_factory):
    with FaultFS(tmp_path_factory.mktemp("faultfs")) as mounted:
        yield mounted


def test_the_clean_run_evicts_sweeps_and_keeps_the_pinned_and_the_live(fs, template):
    removed, report = _run(fs, template, None)
    manifests = [r for r in removed if "/manifests/" in r]
    objects = [r for r in removed if "/objects/" in r]
    assert 1 <= len(manifests) < len(CONVS) - 1, (removed, report)
    assert any(r.endswith(digest_of(ORPHAN)[2:]) for r in objects), removed
    assert not any(r.endswith(digest_of(LIVE)[2:]) for r in objects), removed
    assert not any(r.startswith("default/pins/") for r in removed), removed


def test_a_failed_listing_of_manifests_during_a_pass_removes_nothing_more(fs, template):
    """The field's data loss: one failed listing of manifests/ emptied the view and the same
    pass swept every object."""
    clean, _ = _run(fs, template, None)
    ops = [o for o in _ops_of_clean_run(fs, template) if o[:2] == ("readdir", "/default/manifests")]
    assert ops, "the pass lists manifests/"
    for op, path, nth in ops:
        removed, report = _run(fs, template, (op, path, nth, errno.EIO))
        assert removed <= clean, (op, path, nth, sorted(removed - clean), report)


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES], ids=["EIO", "EACCES"])
def test_an_error_at_any_listing_or_read_removes_nothing_more(fs, template, err):
    clean, _ = _run(fs, template, None)
    ops = [o for o in _ops_of_clean_run(fs, template)
           if err == errno.EIO or o[0] in LISTINGS_AND_READS]
    wrong = []
    for op, path, nth in ops:
        removed, report = _run(fs, template, (op, path, nth, err))
        if not removed <= clean:
            wrong.append((op, path, nth, sorted(removed - clean), getattr(report, "stopped_by", report)))
    assert not wrong, f"{len(wrong)} of {len(ops)} injected errors removed more: {wrong[:5]}"


def test_a_manifest_unreadable_at_open_is_read_once_readable_again(fs, template):
    """EACCES when a writer first reads a manifest is 'unknown', not 'corrupt': the next pass
    reads it again, serves it and sweeps none of its objects."""
    root, cap, low = template
    shutil.rmtree(fs.backing / "default", ignore_errors=True)
    shutil.copytree(root / "default", fs.backing / "default", copy_function=shutil.copy2)
    before = _files(fs.backing)
    fs.fail("open", r"^/default/manifests/[0-9a-f]+/[0-9a-f]+\.mf$", errno.EACCES, times=-1)
    store = _open(fs.mount, max_bytes=1 << 20, low=1 << 19)
    fs.clear()
    run_pass(store, BUDGET, sweep_shards=256, timer=stopped_clock)
    store.close()
    removed = before - _files(fs.backing)
    assert all(r.endswith(digest_of(ORPHAN)[2:]) for r in removed), sorted(removed)
    for conv in CONVS:
        assert store.lookup(IDENT, conv_keys(conv, 8)).hit, conv


# ------------------------------------------------------------------ found by the state machine
# (tests/store/test_fault_properties.py): each reduced to one fault at one place.

MANIFEST = r"^/default/manifests/[0-9a-f]{32}/[0-9a-f]{40}\.mf$"
OBJECT = r"^/default/objects/[0-9a-f]{2}/[0-9a-f]{62}$"


def _fresh(fs: FaultFS, convs=(1, 2), n: int = 8) -> PageStore:
    """An empty store on the mount with ``convs`` published (``n`` blocks each)."""
    fs.clear()
    # through the mount, so the next files are new ones to the kernel too (not the old
    # writers.lock, which a store an earlier test left open still holds)
    shutil.rmtree(fs.mount / "default", ignore_errors=True)
    store = _open(fs.mount)
    for conv in convs:
        assert store.publish(IDENT, conv_keys(conv, n), conv_pages(conv, n, 4)).ok
    return store


def _dangling(store: PageStore) -> list:
    """What verify finds: with only faults (no damage), nothing."""
    return list(verify_store(store.layout).problems)


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES], ids=["EIO", "EACCES"])
def test_a_manifest_whose_unlink_fails_keeps_its_objects(fs, err):
    """A pass evicts an entry, the unlink of its manifest fails: the manifest stays, so must
    its objects (the pass deleted them, leaving an entry that names objects that are gone)."""
    first = _fresh(fs)
    used = first.capacity().used_bytes
    first.close()
    evictor = _open(fs.mount, max_bytes=used - 1, low=0)  # evicts both
    fs.fail("unlink", MANIFEST, err, times=1)
    report = run_pass(evictor, BUDGET, sweep_shards=256, timer=stopped_clock)
    assert fs.fired() == 1, report
    fs.clear()
    reader = _open(fs.mount, read_only=True)
    assert _dangling(reader) == [], report
    kept = [conv for conv in (1, 2) if reader.lookup(IDENT, conv_keys(conv, 8)).hit]
    assert len(kept) == 1, (kept, report)
    assert report.entries_evicted == 1, report


def test_a_superseded_manifest_whose_unlink_fails_keeps_its_objects(fs):
    """The same through supersession: a longer publication discards the shorter entry."""
    store = _fresh(fs, convs=(1,), n=6)  # pages of 4 and 2 blocks: the second is its own
    fs.fail("unlink", MANIFEST, errno.EIO, times=1)
    result = store.publish(IDENT, conv_keys(1, 8), conv_pages(1, 8, 4))
    assert result.ok and fs.fired() == 1, result
    fs.clear()
    assert _dangling(store) == []
    assert store.lookup(IDENT, conv_keys(1, 6)).hit_blocks == 6


def test_a_pass_that_cannot_read_the_filesystems_clock_expires_nothing(fs):
    """A new maintainer (no reading of the filesystem's clock yet) whose stamp of the pins
    directory fails used its wall clock: ten years ahead, the TTL took every entry."""
    _fresh(fs)
    before = _files(fs.backing)
    maintainer = _open(fs.mount, ttl_seconds=60)
    maintainer.clocks = Clock()  # its own process: no reading of the filesystem's clock yet
    real = time.time
    fs.fail("utimens", r"^/default/pins$", errno.EIO, times=1)
    with mock.patch.object(time, "time", lambda: real() + 10 * 365.25 * 86400):
        report = run_pass(maintainer, BUDGET, sweep_shards=0, timer=stopped_clock)
    assert fs.fired() == 1
    fs.clear()
    assert before - _files(fs.backing) == set(), report
    assert report.entries_expired == 0, report


def test_a_failed_close_of_an_object_is_not_an_exception(fs):
    """A read of an object whose close (a FUSE or network filesystem's flush) fails returns a
    result: its verified bytes or a reason, never an OSError out of ``read``."""
    store = _fresh(fs, convs=(1,))
    hit = store.lookup(IDENT, conv_keys(1, 8))
    fs.fail("flush", OBJECT, errno.EIO, times=-1)
    read = store.read(hit.handle)
    verified = store.lookup(IDENT, conv_keys(1, 8), verify=True)
    assert fs.fired() > 0
    fs.clear()
    assert read.ok or read.reason == "io_error", read
    assert not read.ok or [bytes(p) for p in read.pages] == conv_pages(1, 8, 4)
    assert verified.hit or verified.reason == "io_error", verified


def test_a_failed_close_of_a_publications_intent_is_not_an_exception(fs):
    """A publication's last step closes its intent, unlinked just before (FaultFS sees no
    path): an error there (a network filesystem's flush) must not escape ``publish``, whose
    outcome is decided by then."""
    store = _fresh(fs, convs=(1,))
    fs.fail("flush", r"^$", errno.EIO, times=-1)
    result = store.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4))
    assert fs.fired() > 0
    fs.clear()
    assert result.ok, result
    assert store.lookup(IDENT, conv_keys(2, 8)).hit_blocks == 8


def test_a_failed_close_of_an_abandoned_temp_file_is_not_an_exception(fs):
    """A publication fails writing a page (EIO); closing the temp file it leaves fails too:
    ``publish`` answers io_error rather than raise the close's error."""
    store = _fresh(fs, convs=(1,))
    fs.fail("write", r"^/default/staging/[0-9a-f]{24}-[0-9a-f]{64}\.tmp$", errno.EIO, times=-1)
    fs.fail("flush", r"^/default/staging/[0-9a-f]{24}-[0-9a-f]{64}\.tmp$", errno.EIO, times=-1)
    result = store.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4))
    fs.clear()
    assert not result.ok and result.reason == "io_error", result
    assert _dangling(store) == []


def test_a_failed_close_of_a_manifest_is_not_an_exception(fs):
    """Another process published; this one's next refresh reads the new manifest and its
    close (flush) fails: ``publish`` and ``capacity`` raise OSError instead of answering."""
    store = _fresh(fs, convs=(1,))
    other = _open(fs.mount)
    assert other.publish(IDENT, conv_keys(2, 8), conv_pages(2, 8, 4)).ok
    fs.fail("flush", MANIFEST, errno.EIO, times=1)
    try:
        result = store.publish(IDENT, conv_keys(3, 8), conv_pages(3, 8, 4))
    finally:
        fs.clear()
    assert result.ok or result.reason == "io_error", result


def test_a_manifest_unreadable_at_open_is_found_by_a_lookup_once_readable(fs):
    """A writer opens while the manifests cannot be read (EIO): they are unknown, "read again
    by every refresh". Once readable, a lookup (a refresh that is not forced) must find them;
    it does not while their directory's mtime stays the same, so a process that runs no
    maintenance pass (a restore-only reader) misses them until something is published."""
    _fresh(fs)
    time.sleep(0.1)  # the directory's mtime is old enough to trust (index._MTIME_TRUST_S)
    fs.fail("read", MANIFEST, errno.EIO, times=-1)
    reader = _open(fs.mount)
    assert fs.fired() > 0 and len(reader.catalog.unknown()) == 2
    fs.clear()
    assert reader.lookup(IDENT, conv_keys(1, 8)).hit


def test_an_identity_directory_unlistable_at_open_is_listed_once_readable(fs):
    """A writer opens while an identity directory cannot be listed (EIO): its entries are
    unknown. Once it lists again, a lookup must find them; the failed listing left the
    directory's mtime recorded, the next refresh trusts it and forgets that the directory
    was never read, so the entries stay missing (not even unknown) until the mtime moves."""
    _fresh(fs)
    time.sleep(0.1)  # the directory's mtime is old enough to trust (index._MTIME_TRUST_S)
    fs.fail("readdir", r"^/default/manifests/[0-9a-f]{32}$", errno.EIO, times=-1)
    reader = _open(fs.mount)
    assert fs.fired() > 0 and reader.catalog.unknown()
    fs.clear()
    assert reader.lookup(IDENT, conv_keys(1, 8)).hit


def test_a_replaced_manifest_unreadable_when_a_lookup_finds_the_old_objects_gone_keeps_its_objects(fs):
    """Another process publishes an entry again (its manifest renamed over the old one) and
    sweeps the old objects; this process's lookup still holds the old entry, finds its
    objects gone, and the new manifest cannot be read (EIO). The lookup dropped the name
    (and its "unknown" mark), the view was complete again without it, and this process's
    next pass swept the new manifest's objects: a manifest naming objects that are gone."""
    reader = _fresh(fs, convs=())
    other = _open(fs.mount)
    keys = conv_keys(1, 8)
    assert other.publish(IDENT, keys, conv_pages(1, 8, 4)).ok
    assert reader.lookup(IDENT, keys).hit_blocks == 8
    assert other.publish(IDENT, keys, conv_pages(9, 8, 4)).ok  # same entry, other bytes
    assert run_pass(other, BUDGET, sweep_shards=256, timer=stopped_clock).orphans_collected > 0
    fs.fail("open", MANIFEST, errno.EIO, times=-1)
    try:
        missed = reader.lookup(IDENT, keys)
    finally:
        fs.clear()
    assert not missed.hit, missed
    run_pass(reader, BUDGET, sweep_shards=256, timer=stopped_clock)
    assert _dangling(reader) == []
    found, read = _open(fs.mount, read_only=True).fetch(IDENT, keys)
    assert found.hit and read.ok and [bytes(p) for p in read.pages] == conv_pages(9, 8, 4), found


def test_a_view_that_cannot_list_manifests_still_follows_the_journal(fs):
    """While manifests/ cannot be listed, each lookup tried the whole listing again, which
    first skipped the journal to its end and dropped the records read but not applied:
    another process's publications never reached this view."""
    _fresh(fs, convs=()).close()
    other = _open(fs.mount)
    fs.fail("readdir", r"^/default/manifests$", errno.EACCES, times=-1)
    try:
        reader = _open(fs.mount, read_only=True)
        assert reader.catalog.unknown()
        for conv in range(1, 21):
            assert other.publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4)).ok
        hits = [reader.lookup(IDENT, conv_keys(conv, 8)).hit_blocks == 8 for conv in range(1, 21)]
    finally:
        fs.clear()
    assert all(hits), hits


GC_LOCK = r"^/default/locks/gc\.lock$"
IDENTITY_DIR = r"^/default/manifests/[0-9a-f]{32}$"


def _second_pages_kept_by_a_sweep(fs: FaultFS, reader: PageStore, maintainer: PageStore) -> None:
    """After a publication of conversation 1 at 6 blocks that failed with its manifest in
    place: a new writer's open (recovery, under the fault armed), then the other process's
    pass with a full orphan sweep. Whatever the publication's manifest names stays."""
    reopened = _open(fs.mount)  # under the fault armed, if any
    fs.clear()
    reader.close()
    report = run_pass(maintainer, BUDGET, sweep_shards=256, timer=stopped_clock)
    assert _dangling(reopened) == [], report
    found = reopened.lookup(IDENT, conv_keys(1, 6))
    assert found.hit_blocks in (4, 6), found
    if found.hit_blocks == 6:
        assert reopened.read(found.handle).ok
    reopened.close()


def test_a_dead_intent_removed_while_its_close_fails_still_asks_for_a_rescan(fs):
    """A publication that cannot take the shared gc lock to journal its manifest leaves its
    intent (the sign that a manifest may be in place unjournaled). The next writer's open
    removed it, then the close of its descriptor failed (a flush on the removed file):
    the open took it for a staging it could not read and asked no rescan, so another
    process's sweep deleted objects the manifest names."""
    reader = _fresh(fs, convs=(1,), n=4)
    maintainer = _open(fs.mount)
    fs.fail("open", GC_LOCK, errno.EACCES, after=2, times=-1)  # the journaling's
    result = reader.publish(IDENT, conv_keys(1, 6), conv_pages(1, 6, 4))
    assert not result.ok and fs.fired() > 0, result
    fs.clear()
    fs.fail("flush", r"^$", errno.EACCES, times=-1)  # a file removed while open
    _second_pages_kept_by_a_sweep(fs, reader, maintainer)


def test_a_publication_that_fails_after_renaming_its_manifest_keeps_its_objects(fs):
    """The fsync of the manifest's directory fails after the rename: the manifest is in
    place and not journaled, so the failed publication must leave the sign of it (its
    intent) for the other processes, not remove it."""
    reader = _fresh(fs, convs=(1,), n=4)
    maintainer = _open(fs.mount)
    fs.fail("fsyncdir", IDENTITY_DIR, errno.EIO, times=-1)
    result = reader.publish(IDENT, conv_keys(1, 6), conv_pages(1, 6, 4))
    assert not result.ok and fs.fired() > 0, result
    _second_pages_kept_by_a_sweep(fs, reader, maintainer)


def test_a_dead_intent_whose_rescan_cannot_be_journaled_stays(fs):
    """The journal refuses the rescan record: the dead intent is the only sign left that a
    manifest may be in place unjournaled, so no open or pass removes it."""
    reader = _fresh(fs, convs=(1,), n=4)
    fs.fail("open", GC_LOCK, errno.EACCES, after=2, times=-1)  # the journaling's
    result = reader.publish(IDENT, conv_keys(1, 6), conv_pages(1, 6, 4))
    assert not result.ok and fs.fired() > 0, result
    fs.clear()
    intents = [n for n in os.listdir(fs.backing / "default" / "staging") if n.endswith(".intent")]
    assert len(intents) == 1, (intents, result)
    fs.fail("write", r"^/default/journal/current$", errno.EIO, times=-1)
    fs.fail("open", r"^/default/journal/current$", errno.EIO, times=-1)
    other = _open(fs.mount)
    run_pass(other, BUDGET, sweep_shards=256, timer=stopped_clock)
    assert fs.fired() > 0
    fs.clear()
    assert (fs.backing / "default" / "staging" / intents[0]).exists()
    other.close()
    reader.close()
