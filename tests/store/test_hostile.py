"""A hostile or damaged filesystem under the store root: one regression test per failure.

The contract (every test asserts the correct behaviour):
  * nothing outside the store root is ever created, changed or removed, whatever symlinks
    lie inside it (staging, a shard, pins, locks, gc.lock, an identity directory, objects/,
    manifests/);
  * a FIFO, a directory where a file belongs or a file where a directory belongs never
    hangs or crashes the store, a maintenance pass, ``verify_store`` or the CLI, and
    ``verify`` names the bad path;
  * a manifest with a valid checksum but a hostile body (not an object, 100000-deep lists,
    wrong types, bools for ints, NaN) is a bad manifest: reported, never loaded, never
    crashing anything; a declared size is never trusted for capacity;
  * no wait is unbounded (a stopped process holding the gc lock); a full or read-only
    filesystem is a miss or a failed result, never an exception;
  * a pin never protects an entry beyond the lease, whatever expiry it claims.

Operations may fail gracefully (a miss, a failed PublishResult, a pass stopped by "lock"),
but nothing may raise out of the public API or hang (bounded by SIGALRM / subprocess
timeouts). Runs as root (mounts), as CI does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sparkcache.store import PageStore, run_pass, verify_store
from sparkcache.store.identity import entry_id_for
from sparkcache.store.objects import digest_of

from hostile_helpers import (BIG_BUDGET, GOOD, NEW_CONV, OutsideWatch, Trial, battery,
                             bind_mount, fill_filesystem, forge_bytes, forged_entry_path,
                             hex_name, json_body, make_fifo, problem_names, publish_good,
                             remount_read_only, small_tmpfs, stopped_lock_holder)
from mounts import read_only_view
from store_helpers import CLI_CAP, IDENT, conv_keys, conv_pages, open_store, run_cli

LOCK_BOUND_S = 30.0


@pytest.fixture
def world(tmp_path):
    """tmp_path/store (a published store: conversations 1 and 2) beside tmp_path/outside."""
    root = tmp_path / "store"
    store = publish_good(root)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_bytes(b"must survive\n")
    return tmp_path, root, store


def _paths(store):
    lk1 = store.lookup(IDENT, conv_keys(*GOOD[0]))
    lk2 = store.lookup(IDENT, conv_keys(*GOOD[1]))
    return {
        "entry1": lk1.entry_id,
        "manifest2": store.entry(lk2.entry_id).path,
        "object2": store.objects.path(lk2.handle.pages[0].digest),
        "shard2": os.path.dirname(store.objects.path(lk2.handle.pages[0].digest)),
        "identity": store.layout.identity_dir(IDENT.digest()),
    }


# ----------------------------------------------------------------------------- symlinks out


def _bait_file(directory: Path, name: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)


def _link_out(kind: str, store, outside: Path) -> None:
    """Replace one path of the store by a symlink to a directory (or file) outside the root,
    with bait there named like what the store would create or delete."""
    lay = store.layout
    p = _paths(store)
    # the access marks of _paths' own lookups are recorded by a thread, later: recorded now,
    # inside the root, not after the move below (CI once saw one land on a moved manifest)
    assert store.accesses.flush()
    if kind == "staging":
        out = outside / "staging"
        token = hex_name(24)
        _bait_file(out, token + ".intent", ("ab" * 32 + "\n").encode())  # stale (unlocked)
        _bait_file(out, f"{token}-{'cd' * 32}.tmp", b"temp of a dead publisher")
        _bait_file(out, hex_name(24) + ".new", b"")
        _bait_file(out, f"{hex_name(24)}-manifest.tmp", b"orphan temp")
        _bait_file(out / "stray", "inner", b"a directory the recovery would rmtree")
        os.rmdir(lay.staging_dir)
        os.symlink(out, lay.staging_dir)
    elif kind == "objects_shard_new":  # the shard the battery's publication writes into
        shard = digest_of(conv_pages(*NEW_CONV, 4)[0])[:2]
        link = os.path.join(lay.objects_dir, shard)
        assert not os.path.exists(link), "pick another NEW_CONV: its shard is in use"
        out = outside / "shard"
        _bait_file(out, hex_name(62), b"an unreferenced object (orphan sweep bait)")
        os.symlink(out, link)
    elif kind == "objects_shard_existing":  # a shard holding a referenced object
        out = outside / "shard"
        shutil.move(p["shard2"], out)
        _bait_file(out, hex_name(62), b"an unreferenced object (orphan sweep bait)")
        os.symlink(out, p["shard2"])
    elif kind == "pins":
        out = outside / "pins"
        _bait_file(out, f"{p['entry1']}.{hex_name(16)}.pin", b"1.0\n")  # long expired
        _bait_file(out, f"{p['entry1']}.{hex_name(16)}.pin.tmp", b"")
        os.rmdir(lay.pins_dir)
        os.symlink(out, lay.pins_dir)
    elif kind == "locks_dir":
        out = outside / "locks"
        _bait_file(out, "other.lock", b"")
        shutil.rmtree(lay.locks_dir)
        os.symlink(out, lay.locks_dir)
    elif kind == "gc_lock":  # a dangling link: O_CREAT through it creates outside
        os.unlink(lay.gc_lock_path)
        os.symlink(outside / "gc.lock", lay.gc_lock_path)
    elif kind == "identity_dir":  # valid manifests outside: touched, evicted, written into
        shutil.move(p["identity"], outside / "identity")
        os.symlink(outside / "identity", p["identity"])
    elif kind == "objects_dir":
        shutil.move(lay.objects_dir, outside / "objects")
        _bait_file(outside / "objects" / "ee", hex_name(62), b"orphan bait")
        os.symlink(outside / "objects", lay.objects_dir)
    elif kind == "manifests_dir":
        shutil.move(lay.manifests_dir, outside / "manifests")
        os.symlink(outside / "manifests", lay.manifests_dir)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["staging", "objects_shard_new", "objects_shard_existing",
                                  "pins", "locks_dir", "gc_lock", "identity_dir", "objects_dir",
                                  "manifests_dir"])
def test_nothing_outside_the_root_is_touched_through_a_symlink(world, kind):
    tmp_path, root, store = world
    _link_out(kind, store, tmp_path / "outside")
    watch = OutsideWatch(tmp_path, "store")
    trial = Trial()
    battery(trial, str(root), watch=watch)
    problems = list(trial.problems)
    problems += watch.changes and ["OUTSIDE TOUCHED:"] + watch.changes
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- FIFOs, dirs, files


def _special_target(kind: str, store) -> str:
    lay = store.layout
    p = _paths(store)
    return {
        "manifest": p["manifest2"],
        "object": p["object2"],
        "pin": os.path.join(lay.pins_dir, f"{p['entry1']}.{hex_name(16)}.pin"),
        "intent": os.path.join(lay.staging_dir, hex_name(24) + ".intent"),
        "new": os.path.join(lay.staging_dir, hex_name(24) + ".new"),
        "gc_lock": lay.gc_lock_path,
    }[kind]


def _assert_verify_names(trial: Trial, seen: dict, path: str) -> None:
    if not os.path.lexists(path):
        return  # removed by the store from its own directory (an unreadable pin, a stray
        #         directory in staging): healed, nothing left to report
    report = seen.get("verify")
    if report is not None:
        trial.expect(problem_names(report, path),
                     f"verify_store does not name {path}: {report.problems}")
    res = seen.get("cli_verify")
    if res is not None:
        trial.expect(res.returncode == 1 and path in res.stdout,
                     f"CLI verify (exit {res.returncode}) does not name {path}:\n"
                     f"{res.stdout[-1500:]}")


@pytest.mark.parametrize("kind", ["manifest", "object", "pin", "intent", "new", "gc_lock"])
def test_fifo_in_place_of_a_file(world, kind):
    tmp_path, root, store = world
    target = _special_target(kind, store)
    make_fifo(target)
    trial = Trial(fifo_root=str(root))
    seen = battery(trial, str(root), must_hit=(1,), evict=False)
    _assert_verify_names(trial, seen, target)
    trial.assert_clean()


@pytest.mark.parametrize("kind", ["manifest", "object", "pin", "intent", "new", "gc_lock"])
def test_directory_in_place_of_a_file(world, kind):
    tmp_path, root, store = world
    target = _special_target(kind, store)
    if os.path.lexists(target):
        os.unlink(target)
    os.mkdir(target)
    (Path(target) / "inner").write_bytes(b"x")  # not empty: neither unlink nor rmdir works
    trial = Trial()
    seen = battery(trial, str(root), must_hit=(1,), evict=False)
    _assert_verify_names(trial, seen, target)
    trial.assert_clean()


@pytest.mark.parametrize("kind", ["objects_shard", "identity_dir", "pins", "staging", "locks",
                                  "objects", "manifests"])
def test_file_in_place_of_a_directory(world, kind):
    tmp_path, root, store = world
    lay = store.layout
    p = _paths(store)
    target = {"objects_shard": p["shard2"], "identity_dir": p["identity"],
              "pins": lay.pins_dir, "staging": lay.staging_dir, "locks": lay.locks_dir,
              "objects": lay.objects_dir, "manifests": lay.manifests_dir}[kind]
    shutil.rmtree(target)
    Path(target).write_bytes(b"a file where a directory belongs\n")
    trial = Trial()
    must_hit = (1,) if kind in ("objects_shard", "pins", "staging", "locks") else ()
    seen = battery(trial, str(root), must_hit=must_hit, evict=False)
    _assert_verify_names(trial, seen, target)
    trial.assert_clean()


# ----------------------------------------------------------------------------- hostile manifests


def _valid_forged_body(store, keys: list[str]) -> dict:
    """A manifest body that decodes: conversation 9's keys over conversation 1's first page."""
    ref = store.lookup(IDENT, conv_keys(*GOOD[0])).handle.pages[0]
    idd = IDENT.digest()
    return {"format": 2, "entry_id": entry_id_for(idd, keys[-1]), "identity": IDENT.to_dict(),
            "block_keys": keys, "blocks_per_page": 4,
            "pages": [[ref.digest, ref.size]] * -(-len(keys) // 4), "created_at": time.time()}


def _hostile_body(case: str, store) -> tuple[bytes, list[str]]:
    """(body bytes, the block keys a lookup of the forged entry uses)."""
    keys = conv_keys(9, 4)
    body = _valid_forged_body(store, keys)
    simple = {"list": [1, 2, 3], "string": "manifest", "number": 42, "null": None}
    if case in simple:
        return json_body(simple[case]), keys
    if case == "deep_lists":
        return b"[" * 100000 + b"]" * 100000, keys
    if case == "block_keys_string":  # tuple("abcd") would be 4 one-char keys
        keys = list("abcd")
        body = _valid_forged_body(store, keys)
        body["block_keys"] = "abcd"
        return json_body(body), keys
    if case == "pages_dict":
        body["pages"] = {body["pages"][0][0]: body["pages"][0][1]}
    elif case.startswith("size_"):
        body["pages"][0][1] = {"size_true": True, "size_negative": -1, "size_1e300": 1e300,
                               "size_string": "5", "size_64GiB": 64 << 30}[case]
    elif case == "blocks_per_page_true":
        keys = conv_keys(9, 1)
        body = _valid_forged_body(store, keys)
        body["blocks_per_page"] = True
    elif case.startswith("created_at_"):
        body["created_at"] = {"created_at_nan": math.nan, "created_at_inf": math.inf,
                              "created_at_-inf": -math.inf, "created_at_10**400": 10**400,
                              "created_at_1e20": 1e20}[case]
    elif case == "entry_id_int":
        body["entry_id"] = 12345
    elif case == "entry_id_list":
        body["entry_id"] = [body["entry_id"]]
    else:
        raise AssertionError(case)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), keys


@pytest.mark.parametrize("case", ["list", "string", "number", "null", "deep_lists",
                                  "block_keys_string", "pages_dict", "size_true", "size_negative",
                                  "size_1e300", "size_string", "blocks_per_page_true",
                                  "created_at_nan", "created_at_inf", "created_at_-inf",
                                  "created_at_10**400", "created_at_1e20", "size_64GiB",
                                  "entry_id_int", "entry_id_list"])
def test_checksummed_hostile_manifest_is_reported_not_loaded(world, case):
    tmp_path, root, store = world
    body, keys = _hostile_body(case, store)
    path = forged_entry_path(store.layout, keys)
    with open(path, "wb") as f:
        f.write(forge_bytes(body))
    trial = Trial()
    fresh = trial.run("open", lambda: open_store(root))
    if fresh is not None:
        forged = trial.run("lookup forged", lambda: fresh.lookup(IDENT, keys))
        trial.expect(forged is None or not forged.hit, f"the hostile manifest was loaded: {forged}")
        trial.run("capacity", fresh.capacity)
    seen = battery(trial, str(root), must_hit=(1, 2), evict=False)
    _assert_verify_names(trial, seen, path)
    entry = os.path.basename(path)[:12]
    trial.check_cli("inspect forged", "inspect", entry, "--root", str(root), "--verify")
    trial.assert_clean()


def test_a_declared_size_is_not_trusted_for_capacity(world):
    """A valid manifest that declares a 10 TB page whose object does not exist: capacity stays
    near the real use, publishing still works, a pass evicts none of the good entries."""
    tmp_path, root, store = world
    keys = conv_keys(9, 4)
    body = _valid_forged_body(store, keys)
    body["pages"] = [["ab" * 32, 10 ** 13]]
    with open(forged_entry_path(store.layout, keys), "wb") as f:
        f.write(forge_bytes(json_body(body)))
    fresh = open_store(root)
    used = fresh.capacity().used_bytes
    assert used < 1 << 20, f"capacity counts the declared size: used_bytes={used}"
    result = fresh.publish(IDENT, conv_keys(*NEW_CONV), conv_pages(*NEW_CONV, 4))
    assert result.ok, result
    assert fresh.capacity().used_bytes < 1 << 20, fresh.capacity()
    report = run_pass(fresh, BIG_BUDGET, sweep_shards=256)
    for conv, n in GOOD + (NEW_CONV,):  # the pass may drop the forged entry, not these
        hit, read = fresh.fetch(IDENT, conv_keys(conv, n))
        assert hit.hit and read.ok, (conv, hit, report)
        assert list(read.pages) == conv_pages(conv, n, 4), conv


# ----------------------------------------------------------------------------- bounded waits


def _in_thread(fn, bound: float):
    """(finished, result or exception)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound)
    return thread, box


@pytest.mark.parametrize("operation", ["publish", "lookup_lease"])
def test_a_stopped_lock_holder_does_not_block_forever(world, operation):
    tmp_path, root, store = world
    fresh = open_store(root)

    def call():
        if operation == "publish":
            return fresh.publish(IDENT, conv_keys(*NEW_CONV), conv_pages(*NEW_CONV, 4))
        return fresh.lookup(IDENT, conv_keys(*GOOD[0]), lease=True)

    with stopped_lock_holder(fresh.layout.gc_lock_path):
        started = time.monotonic()
        thread, box = _in_thread(call, LOCK_BOUND_S)
        waited = time.monotonic() - started
        finished = not thread.is_alive()
    thread.join(30)  # the holder is gone: let a blocked call finish
    assert finished, f"{operation} still blocked on gc.lock after {waited:.0f}s"
    assert "error" not in box, f"{operation} raised {box.get('error')!r}"
    result = box["value"]
    if operation == "publish":
        assert not result.ok and result.reason and result.detail, result
    else:
        assert not result.hit and result.reason and result.reason != "hit", result
        assert result.lease_id is None


def test_a_stopped_lock_holder_stops_a_pass_by_lock(world):
    """Already bounded before this suite: the pass polls the exclusive lock."""
    tmp_path, root, store = world
    fresh = open_store(root)
    with stopped_lock_holder(fresh.layout.gc_lock_path):
        with_trial = Trial()
        report = with_trial.run("run_pass", lambda: run_pass(fresh, BIG_BUDGET, sweep_shards=256),
                                seconds=LOCK_BOUND_S)
    with_trial.assert_clean()
    assert report.stopped_by == "lock"


# ----------------------------------------------------------------------------- full, read-only


@pytest.mark.root
def test_leased_lookup_on_a_full_disk_is_a_miss(tmp_path):
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        root = os.path.join(disk, "store")
        store = open_store(root)
        for conv, n in GOOD:
            assert store.publish(IDENT, conv_keys(conv, n), conv_pages(conv, n, 4)).ok
        fill_filesystem(disk)
        trial = Trial()
        for conv, n in GOOD:
            result = trial.run(f"lookup(lease=True) conv{conv}",
                               lambda: store.lookup(IDENT, conv_keys(conv, n), lease=True))
            if result is not None:
                trial.expect(not result.hit and result.reason and result.reason != "hit"
                             and result.lease_id is None,
                             f"conv{conv}: a leased lookup on a full disk must be a miss with a "
                             f"reason (no hit without a lease): {result}")
            plain = trial.run(f"lookup conv{conv}", lambda: store.lookup(IDENT, conv_keys(conv, n)))
            trial.expect(plain is None or plain.hit, f"conv{conv}: plain lookup: {plain}")
        pub = trial.run("publish", lambda: store.publish(IDENT, conv_keys(*NEW_CONV),
                                                         conv_pages(*NEW_CONV, 4)))
        trial.expect(pub is None or not pub.ok, f"publish on a full disk: {pub}")
        trial.run("run_pass", lambda: run_pass(store, BIG_BUDGET, sweep_shards=256))
        trial.run("reopen", lambda: open_store(root))
        leftovers = [n for n in os.listdir(store.layout.pins_dir) if n.endswith(".tmp")]
        trial.expect(not leftovers, f"temp files left in pins/: {leftovers}")
        trial.assert_clean()


def _read_only_ops(trial: Trial, store) -> None:
    for conv, n in GOOD:
        keys = conv_keys(conv, n)
        plain = trial.run(f"lookup conv{conv}", lambda: store.lookup(IDENT, keys))
        trial.expect(plain is None or plain.hit or bool(plain.reason), f"conv{conv}: {plain}")
        leased = trial.run(f"lookup(lease=True) conv{conv}",
                           lambda: store.lookup(IDENT, keys, lease=True))
        if leased is not None:
            trial.expect(leased.hit or bool(leased.reason), f"conv{conv}: {leased}")
            if leased.hit:
                trial.run("release", lambda: store.release(leased.lease_id))
        trial.run(f"fetch conv{conv}", lambda: store.fetch(IDENT, keys))
    pub = trial.run("publish", lambda: store.publish(IDENT, conv_keys(*NEW_CONV),
                                                     conv_pages(*NEW_CONV, 4)))
    trial.expect(pub is None or not pub.ok, f"publish on a read-only mount: {pub}")
    trial.run("capacity", store.capacity)
    trial.run("run_pass", lambda: run_pass(store, BIG_BUDGET, sweep_shards=256))
    trial.run("verify_store", lambda: verify_store(store.layout))


@pytest.mark.root
def test_writer_whose_root_is_remounted_read_only(tmp_path):
    root = tmp_path / "store"
    publish_good(root)
    with bind_mount(root, tmp_path / "mnt") as mnt:
        store = open_store(mnt)
        remount_read_only(mnt)
        trial = Trial()
        _read_only_ops(trial, store)
        trial.assert_clean()


@pytest.mark.root
def test_writer_opened_on_a_read_only_mount(tmp_path):
    """A writer opened on a read-only mount either refuses to open with an OSError (a clean
    refusal) or opens and then never raises from lookups (leased or not), publish or a pass."""
    root = tmp_path / "store"
    publish_good(root)
    with read_only_view(root, tmp_path / "ro") as mnt:
        try:
            store = open_store(mnt)
        except OSError:
            return
        trial = Trial()
        _read_only_ops(trial, store)
        store.close()  # its journal's descriptor would keep the mount busy
        trial.assert_clean()


# ----------------------------------------------------------------------------- absurd pins


@pytest.mark.parametrize("expiry", ["1e18", "inf", "nan", "garbage", "-inf", "",
                                    "9" * 400, "1e18 extra words\n"],
                         ids=["1e18", "inf", "nan", "garbage", "-inf", "empty", "400_nines",
                              "trailing_words"])
def test_a_pin_never_protects_beyond_the_lease(world, expiry):
    tmp_path, root, store = world
    entry = store.lookup(IDENT, conv_keys(*GOOD[0])).entry_id
    pin = os.path.join(store.layout.pins_dir, f"{entry}.{hex_name(16)}.pin")
    with open(pin, "w") as f:
        f.write(expiry)
    past = time.time() - 3600
    os.utime(pin, (past, past))
    time.sleep(1.2)  # past lease_seconds=1 even counted from the pin's ctime
    store.close()  # the evictor, alone, records its own cap
    evictor = PageStore(str(root), page_blocks=4, max_bytes=1, low_watermark_bytes=0,
                        lease_seconds=1)
    trial = Trial()
    report = trial.run("run_pass", lambda: run_pass(evictor, BIG_BUDGET, sweep_shards=256))
    trial.assert_clean()
    assert evictor.entry(entry) is None, (
        f"a pin claiming expiry {expiry!r} still protects the entry after the lease: {report}")
    assert not os.path.lexists(pin), f"the pin claiming expiry {expiry!r} was not removed"


@pytest.mark.parametrize("command", ["status", "verify", "inspect", "gc"])
def test_a_store_directory_that_is_a_link_is_refused_in_one_line(tmp_path, command):
    """ROOT/NAMESPACE itself a symbolic link: the store refuses to open it (nothing is
    created or removed where it points), and the CLI says so in one line, exit 1."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "bait.intent").write_bytes(b"x")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / "default")
    args = [command, "--root", str(root)] + (["0" * 8] if command == "inspect" else [])
    res = run_cli(*args)
    assert res.returncode == 1, res
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "symbolic link" in res.stderr
    assert sorted(os.listdir(elsewhere)) == ["bait.intent"]
    with pytest.raises(ValueError, match="symbolic link"):
        PageStore(str(root))
    assert sorted(os.listdir(elsewhere)) == ["bait.intent"]


def test_hard_links_do_not_multiply_what_capacity_counts(tmp_path):
    """One real object hard-linked under many object names (referenced by a forged manifest)
    occupies its blocks once: capacity stays near what is on disk, publication goes on and a
    pass evicts none of the good entries."""
    store = open_store(tmp_path / "s", max_bytes=4 << 20, low_watermark_bytes=3 << 20)
    for conv in (1, 2):
        assert store.publish(IDENT, conv_keys(conv, 8), conv_pages(conv, 8, 4, 1 << 16)).ok
    real = store.objects.path(store.lookup(IDENT, conv_keys(1, 8)).handle.pages[0].digest)
    before = store.capacity().used_bytes
    names = []
    for i in range(64):
        digest = f"{i:02x}" + "e" * 62
        path = store.objects.path(digest)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.link(real, path)
        names.append((digest, os.path.getsize(real)))
    from sparkcache.store.identity import entry_id_for
    from sparkcache.store.manifests import Manifest, PageRef, encode
    keys = conv_keys(9, 64 * 4)
    m = Manifest(entry_id_for(IDENT.digest(), keys[-1]), IDENT, tuple(keys), 4,
                 tuple(PageRef(d, n) for d, n in names), 0.0)
    os.makedirs(store.layout.identity_dir(IDENT.digest()), exist_ok=True)
    with open(store.layout.manifest_path(IDENT.digest(), m.entry_id), "wb") as f:
        f.write(encode(m))
    fresh = open_store(tmp_path / "s", max_bytes=4 << 20, low_watermark_bytes=3 << 20)
    assert fresh.capacity().used_bytes < before + (1 << 20), fresh.capacity()
    assert fresh.publish(IDENT, conv_keys(3, 8), conv_pages(3, 8, 4, 1 << 16)).ok
    run_pass(fresh, BIG_BUDGET, sweep_shards=0)
    for conv in (1, 2, 3):
        assert fresh.lookup(IDENT, conv_keys(conv, 8)).hit


def test_a_deep_directory_in_staging_neither_raises_nor_holds_a_pass(tmp_path):
    """A directory 3,000 levels deep in staging (rmtree recurses): recovery leaves it for the
    operator instead of raising RecursionError, a pass does not touch it, verify lists it."""
    store = open_store(tmp_path / "s")
    assert store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4)).ok
    top = os.path.join(store.layout.staging_dir, "deep")
    fd = os.open(store.layout.staging_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd) if _ else os.mkdir("deep", dir_fd=fd)
            nxt = os.open("d" if _ else "deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    try:
        fresh = open_store(tmp_path / "s")
        assert run_pass(fresh, BIG_BUDGET, sweep_shards=256).stopped_by == "done"
        assert fresh.lookup(IDENT, conv_keys(1, 4), lease=True).hit
        res = run_cli("gc", "--root", str(tmp_path / "s"), "--config", CLI_CAP)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert not os.path.exists(top) or top in run_cli("verify", "--root",
                                                         str(tmp_path / "s")).stdout
    finally:  # pytest's own cleanup of old temp dirs recurses too: remove it with GNU rm (fts)
        subprocess.run(["rm", "-rf", top], check=True)


def test_malformed_lease_ids_are_released_as_nothing(tmp_path):
    store = open_store(tmp_path / "s")
    for lease_id in ("garbage", "../../../", "a" * 40 + ".x/y", ""):
        store.release(lease_id)  # never raises, never removes anything
    assert store.publish(IDENT, conv_keys(1, 4), conv_pages(1, 4, 4)).ok
