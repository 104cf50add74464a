"""Property: whatever damage a hostile or broken filesystem does to a store, the store never
raises, never hangs, never returns wrong bytes, never touches anything outside its root, and
``verify`` names every damaged manifest and object.

Each example copies a small real store (three published conversations and a live pin),
puts bait beside it (``outside/``: files named like intents, temps, pins, objects and a
valid manifest), applies a drawn list of damage operations (flip, truncate or extend bytes;
a FIFO, a directory, a symlink out or to another store file in place of a file; a file or a
symlink out in place of a directory; chmod 000; a manifest with a valid checksum around a
random JSON value or around a valid body with one field replaced; a pin with random
content; stray files, directories, FIFOs and links with store-like names), then runs: a
writer's open (recovery), lookups with and without a lease (and release), verified reads,
a publication, a maintenance pass with a full orphan sweep, ``verify_store`` and (in about
one example in ``HOSTILE_CLI_EVERY``) ``sparkcache verify`` in a subprocess.

What "damaged" means is decided from the disk as ``verify`` sees it, not from the list of
operations (the store may legitimately clean up a stray or unreferenced file before): a
manifest file that is not a regular file, or is one whose body is unambiguously invalid; an
object referenced by a valid manifest that is not a regular file with the recorded size and
the right BLAKE3; a non-regular file at an object name; a shard, identity, objects/ or
manifests/ path that is not a real directory. Each must be named by a problem (its own
path, an ancestor's, or in a problem's detail).

Settings: ``HOSTILE_EXAMPLES`` (default 200), ``HOSTILE_OP_HANG_S`` (default 5: the bound
of one in-process operation), ``HOSTILE_CLI_EVERY`` (default 8). chmod 000 does not stop
root (the suite runs as root); it is applied anyway and never relied on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcache.store import Identity, run_pass, verify_store
from sparkcache.store.identity import entry_id_for
from sparkcache.store.layout import StoreLayout
from sparkcache.store.manifests import MAGIC
from sparkcache.store.objects import digest_of

from hostile_helpers import (BIG_BUDGET, OutsideWatch, Trial, cli, find_fifos, forge_bytes,
                             unjam)
from store_helpers import IDENT, conv_keys, conv_pages, open_store

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "200"))
OP_HANG_S = float(os.environ.get("HOSTILE_OP_HANG_S", "5"))
CLI_EVERY = max(1, int(os.environ.get("HOSTILE_CLI_EVERY", "8")))
CONVS = ((1, 10), (2, 7), (3, 4))
NEW = (5, 6)
BPP = 4
FIELDS = ["format", "entry_id", "identity", "block_keys", "blocks_per_page", "pages",
          "created_at", "pages.0.digest", "pages.0.size", "identity.block_size"]
BAIT = {
    "bait.bin": bytes(range(256)) * 4,
    "ab" * 31: b"object-like bait",  # 62 hex: what a shard's orphan sweep deletes
    "0123456789abcdef01234567.intent": b"ab" * 32 + b"\n",
    "0123456789abcdef01234567-x.tmp": b"temp-like bait",
    "89abcdef0123456789abcdef.new": b"",
    ("c" * 40) + ".0123456789abcdef.pin": b"1.0\n",
}


class Pristine:
    """The published store every example copies (not a dataclass: hypothesis would print
    every byte of it with each falsifying example)."""

    def __init__(self, root: str, files, dirs, manifests, data: dict, entry_ids) -> None:
        self.root = root
        self.files: tuple[str, ...] = tuple(files)  # relative to the namespace directory
        self.dirs: tuple[str, ...] = tuple(dirs)
        self.manifests: tuple[str, ...] = tuple(manifests)
        self.data = data
        self.entry_ids: tuple[str, ...] = tuple(entry_ids)

    def __repr__(self) -> str:
        return f"Pristine({self.root!r})"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    root = tmp_path_factory.mktemp("hostile-pristine") / "store"
    store = open_store(root, page_blocks=BPP)
    entry_ids = []
    for conv, n in CONVS:
        result = store.publish(IDENT, conv_keys(conv, n), conv_pages(conv, n, BPP))
        assert result.ok
        entry_ids.append(result.entry_id)
    assert store.lookup(IDENT, conv_keys(*CONVS[2]), lease=True).lease_id  # a live pin file
    base = store.layout.base
    files, dirs, data = [], [], {}
    for dirpath, dirnames, filenames in os.walk(base):
        for d in dirnames:
            dirs.append(os.path.relpath(os.path.join(dirpath, d), base))
        for f in filenames:
            rel = os.path.relpath(os.path.join(dirpath, f), base)
            files.append(rel)
            with open(os.path.join(base, rel), "rb") as fh:
                data[rel] = fh.read()
    manifests = tuple(sorted(f for f in files if f.endswith(".mf")))
    return Pristine(str(root), tuple(sorted(files)), tuple(sorted(dirs)), manifests, data,
                    tuple(entry_ids))


# ----------------------------------------------------------------------------- strategies

json_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(json_scalars,
                           lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=8)
raw_bodies = st.one_of(  # (kind, value): printed short in a falsifying example
    st.tuples(st.just("json"), json_values),
    st.just(("deep_lists", 100000)),
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
)


def _raw_body(spec: tuple) -> bytes:
    kind, value = spec
    if kind == "json":
        return json.dumps(value).encode()
    if kind == "deep_lists":
        return b"[" * value + b"]" * value
    return value
stray_names = st.one_of(
    st.from_regex(r"[0-9a-f]{62}", fullmatch=True),
    st.from_regex(r"[0-9a-f]{40}\.mf", fullmatch=True),
    st.from_regex(r"[0-9a-f]{24}\.(intent|new)", fullmatch=True),
    st.from_regex(r"[0-9a-f]{24}-[a-z0-9]{1,8}\.tmp", fullmatch=True),
    st.from_regex(r"[0-9a-f]{40}\.[0-9a-f]{16}\.pin(\.tmp)?", fullmatch=True),
    st.from_regex(r"[0-9a-f]{32}|[0-9a-f]{2}", fullmatch=True),
    st.text(alphabet="abcXYZ019._-", min_size=1, max_size=12).filter(
        lambda s: s not in (".", "..")),
)
pin_contents = st.one_of(
    st.binary(max_size=40),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
    st.integers(-(10 ** 30), 10 ** 30).map(lambda i: str(i).encode()),
    st.sampled_from([b"1e18", b"inf", b"nan", b"-inf", b"", b"garbage", b"9" * 400]),
)


def operations(p: Pristine):
    """One damage operation; ``HOSTILE_OPS`` (comma-separated names) narrows the kinds, to
    chase one class of failure."""
    files = st.sampled_from(p.files)
    dirs = st.sampled_from(p.dirs)
    kinds = [
        st.tuples(st.just("flip"), files, st.integers(0, 1 << 16), st.integers(1, 255)),
        st.tuples(st.just("truncate"), files, st.integers(0, 1 << 16)),
        st.tuples(st.just("extend"), files, st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("fifo"), files),
        st.tuples(st.just("mkdir"), files),
        st.tuples(st.just("link_out"), files, st.sampled_from(sorted(BAIT) + ["missing"])),
        st.tuples(st.just("link_store"), files, files),
        st.tuples(st.just("dir_to_file"), dirs),
        st.tuples(st.just("dir_link_out"), dirs, st.booleans()),
        st.tuples(st.just("chmod0"), st.one_of(files, dirs)),
        st.tuples(st.just("raw_manifest"), st.integers(0, len(p.manifests)), raw_bodies),
        st.tuples(st.just("field_manifest"), st.sampled_from(p.manifests),
                  st.sampled_from(FIELDS), json_values),
        st.tuples(st.just("pin"), st.sampled_from(p.entry_ids + ("f" * 40,)), pin_contents),
        st.tuples(st.just("stray"), st.sampled_from(("",) + p.dirs), stray_names,
                  st.sampled_from(["file", "dir", "fifo", "link_out"]), st.binary(max_size=64)),
    ]
    only = {k for k in os.environ.get("HOSTILE_OPS", "").split(",") if k}
    if only:
        assert only <= set(_OP_NAMES), f"HOSTILE_OPS: unknown {sorted(only - set(_OP_NAMES))}"
        kinds = [k for k, name in zip(kinds, _OP_NAMES) if name in only]
    return st.one_of(kinds)


_OP_NAMES = ["flip", "truncate", "extend", "fifo", "mkdir", "link_out", "link_store",
             "dir_to_file", "dir_link_out", "chmod0", "raw_manifest", "field_manifest", "pin",
             "stray"]


# ----------------------------------------------------------------------------- applying damage


def _real_dirs_up_to(base: str, path: str) -> bool:
    """Every directory from ``base`` down to ``path``'s parent is a real directory (so a
    damage operation never writes through a link out of the root)."""
    rel = os.path.relpath(os.path.dirname(path), base)
    cur = base
    for part in ([] if rel == "." else rel.split(os.sep)):
        cur = os.path.join(cur, part)
        try:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                return False
        except OSError:
            return False
    return True


def _kind(path: str) -> str:
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def _remove(path: str) -> None:
    if _kind(path) == "dir":
        shutil.rmtree(path)
    elif _kind(path) != "missing":
        os.unlink(path)


def _write(path: str, data: bytes) -> bool:
    if _kind(path) not in ("file", "missing"):
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def apply(op: tuple, base: str, outside: str, p: Pristine, counter: list) -> bool:
    """Apply one damage operation; False when it does not apply to the state left by the
    earlier ones (its target gone, or reached only through a link)."""
    name = op[0]
    target = os.path.join(base, op[1]) if isinstance(op[1], str) else None
    if name in ("raw_manifest",):
        idd = IDENT.digest()
        if op[1] < len(p.manifests):
            target = os.path.join(base, p.manifests[op[1]])
        else:
            target = os.path.join(base, "manifests", idd,
                                  entry_id_for(idd, f"forged-{op[1]}") + ".mf")
    if name == "stray":
        target = os.path.join(base, op[1], op[2]) if op[1] else os.path.join(base, op[2])
    if target is None or not _real_dirs_up_to(base, target):
        return False
    kind = _kind(target)
    if name in ("flip", "truncate", "extend"):
        if kind != "file":
            return False
        size = os.path.getsize(target)
        fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if name == "flip" and size:
                offset = op[2] % size
                old = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([old[0] ^ op[3]]), offset)
            elif name == "truncate":
                os.ftruncate(fd, op[2] % (size + 1))
            elif name == "extend":
                os.pwrite(fd, op[2], size)
        finally:
            os.close(fd)
        return True
    if name in ("fifo", "mkdir", "link_out", "link_store"):
        if kind == "missing":
            return False
        _remove(target)
        if name == "fifo":
            os.mkfifo(target)
        elif name == "mkdir":
            os.mkdir(target)
            with open(os.path.join(target, "inner"), "wb") as f:
                f.write(b"x")
        elif name == "link_out":
            os.symlink(os.path.join(outside, op[2]), target)
        else:
            os.symlink(os.path.join(base, op[2]), target)
        return True
    if name == "dir_to_file":
        if kind != "dir":
            return False
        shutil.rmtree(target)
        with open(target, "wb") as f:
            f.write(b"a file where a directory belongs\n")
        return True
    if name == "dir_link_out":
        if kind != "dir":
            return False
        if op[2]:  # move the directory out: the store finds real data through the link
            counter[0] += 1
            moved = os.path.join(outside, f"moved-{counter[0]}")
            shutil.move(target, moved)
            os.symlink(moved, target)
        else:
            shutil.rmtree(target)
            os.symlink(os.path.join(outside, "sub"), target)
        return True
    if name == "chmod0":
        if kind not in ("file", "dir"):
            return False
        os.chmod(target, 0)
        return True
    if name == "raw_manifest":
        return _write(target, forge_bytes(_raw_body(op[2])))
    if name == "field_manifest":
        original = p.data[op[1]]
        body = json.loads(original.split(b"\n", 1)[1])
        field, value = op[2], op[3]
        if field == "pages.0.digest":
            body["pages"][0][0] = value
        elif field == "pages.0.size":
            body["pages"][0][1] = value
        elif field == "identity.block_size":
            body["identity"]["block_size"] = value
        else:
            body[field] = value
        return _write(target, forge_bytes(json.dumps(body, sort_keys=True,
                                                     separators=(",", ":")).encode()))
    if name == "pin":
        counter[0] += 1
        pin = os.path.join(base, "pins", f"{op[1]}.{counter[0]:016x}.pin")
        return _real_dirs_up_to(base, pin) and _write(pin, op[2])
    if name == "stray":
        if kind != "missing":
            return False
        what, data = op[3], op[4]
        if what == "file":
            return _write(target, data)
        if what == "dir":
            os.mkdir(target)
        elif what == "fifo":
            os.mkfifo(target)
        else:
            os.symlink(os.path.join(outside, "bait.bin"), target)
        return True
    raise AssertionError(op)


# ----------------------------------------------------------------------------- the oracle

VALID, INVALID, UNSURE = "valid", "invalid", "unsure"
_KEYS = {"format", "entry_id", "identity", "block_keys", "blocks_per_page", "pages", "created_at"}


def _is_int(x) -> bool:
    return type(x) is int


def _is_hex(name, length: int) -> bool:
    return type(name) is str and len(name) == length and all(c in "0123456789abcdef" for c in name)


def classify_manifest(data: bytes, idd: str, entry_id: str):
    """(VALID with its pages | INVALID | UNSURE, pages). INVALID only for an unambiguous
    breach of the format; what a stricter or laxer reader might both defend is UNSURE."""
    hl = len(MAGIC) + 65
    if len(data) < hl or not data.startswith(MAGIC) or data[hl - 1:hl] != b"\n":
        return INVALID, ()
    body = data[hl:]
    if hashlib.sha256(body).hexdigest().encode() != data[len(MAGIC):hl - 1]:
        return INVALID, ()
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return INVALID, ()
    if type(raw) is not dict or not _KEYS <= set(raw):
        return INVALID, ()
    verdict = VALID if set(raw) - {"checksums"} == _KEYS else UNSURE
    checksums = raw.get("checksums", [None] * len(raw["pages"]) if type(raw["pages"]) is list else [])
    if type(checksums) is not list or type(raw["pages"]) is not list or len(checksums) != len(raw["pages"]) \
            or not all(c is None or _is_hex(c, 32) for c in checksums):
        return INVALID, ()  # checksums: one XXH3-128 (or null) per page
    if raw["format"] != 2 or type(raw["format"]) is bool:
        return INVALID, ()
    if not _is_int(raw["format"]):
        verdict = UNSURE
    try:
        if type(raw["identity"]) is not dict:
            return INVALID, ()
        identity = Identity.from_dict(raw["identity"])
    except (ValueError, TypeError):
        return INVALID, ()
    if identity.digest() != idd:
        return INVALID, ()
    keys, bpp, pages = raw["block_keys"], raw["blocks_per_page"], raw["pages"]
    if type(keys) is not list or not keys or not all(type(k) is str and k for k in keys):
        return INVALID, ()
    if any("\n" in k for k in keys):
        verdict = UNSURE
    if not _is_int(bpp) or bpp <= 0:
        return INVALID, ()
    if type(pages) is not list:
        return INVALID, ()
    refs = []
    for item in pages:
        if type(item) is not list or len(item) != 2:
            return INVALID, ()
        digest, size = item
        if not _is_hex(digest, 64):
            return INVALID, ()
        if not _is_int(size) or size < 0:
            return INVALID, ()
        if size > 1 << 40:
            verdict = UNSURE
        refs.append((digest, size))
    if len(refs) != -(-len(keys) // bpp):
        return INVALID, ()
    if type(raw["entry_id"]) is not str or raw["entry_id"] != entry_id_for(idd, keys[-1]) \
            or raw["entry_id"] != entry_id:
        return INVALID, ()
    created = raw["created_at"]
    if type(created) not in (int, float) or not math.isfinite(created):
        return INVALID, ()
    return verdict, tuple(refs)


def required_reports(base: str) -> list[tuple[str, tuple[str, ...]]]:
    """(path, other paths whose report also covers it) that verify must name."""
    out: list[tuple[str, tuple[str, ...]]] = []
    objects, manifests = os.path.join(base, "objects"), os.path.join(base, "manifests")
    if _kind(manifests) != "dir":
        out.append((manifests, ()))
    else:
        for idd, idir, names in _subdirs(manifests, lambda n: _is_hex(n, 32), out):
            for name in names:
                stem = name[:-3]
                if not name.endswith(".mf") or not _is_hex(stem, 40):
                    continue
                path = os.path.join(idir, name)
                if _kind(path) != "file":
                    out.append((path, ()))
                    continue
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue  # unreadable (chmod 000 as non-root): not relied on
                verdict, refs = classify_manifest(data, idd, stem)
                if verdict == INVALID:
                    out.append((path, ()))
                elif verdict == VALID and _kind(objects) == "dir":
                    for digest, size in refs:
                        obj = os.path.join(objects, digest[:2], digest[2:])
                        if not _object_ok(obj, digest, size):
                            out.append((obj, (path,)))
    if _kind(objects) != "dir":
        out.append((objects, ()))
    else:
        for _, spath, names in _subdirs(objects, lambda n: _is_hex(n, 2), out):
            for name in names:
                if _is_hex(name, 62) and _kind(os.path.join(spath, name)) != "file":
                    out.append((os.path.join(spath, name), ()))
    return list(dict.fromkeys(out))


def _subdirs(top: str, named: Callable[[str], bool], out: list):
    """(name, path, sorted entries) of each entry of ``top`` whose name ``named`` accepts and
    that is a directory; one that is not a directory goes to ``out`` (verify must report it),
    an unreadable one is skipped."""
    for name in sorted(os.listdir(top)):
        path = os.path.join(top, name)
        if not named(name):
            continue
        if _kind(path) != "dir":
            out.append((path, ()))
            continue
        try:
            entries = sorted(os.listdir(path))
        except OSError:
            continue
        yield name, path, entries


def _object_ok(path: str, digest: str, size: int) -> bool:
    if _kind(path) != "file":
        return False
    try:
        if os.path.getsize(path) != size:
            return False
        with open(path, "rb") as f:
            return digest_of(f.read()) == digest
    except OSError:
        return True  # unreadable (chmod 000 as non-root): not relied on


def named(report, base: str, path: str, also: tuple[str, ...]) -> bool:
    for cand in (path,) + also:
        for prob in report.problems:
            ppath = prob.path.rstrip("/")
            if not ppath.startswith(base):
                continue
            if ppath == cand or cand.startswith(ppath + "/") or cand in prob.detail:
                return True
    return False


def named_in_cli(stdout: str, path: str, also: tuple[str, ...]) -> bool:
    for cand in (path,) + also:
        if cand in stdout:
            return True
        parent = cand
        while True:
            parent = os.path.dirname(parent)
            if not parent or parent == "/" or "/default" not in parent:
                break
            if f"{parent}: " in stdout:
                return True
    return False


# ----------------------------------------------------------------------------- the property


def _short(op: tuple) -> str:
    text = repr(op)
    return text if len(text) <= 160 else text[:157] + "..."


def _restore_perms(top: str) -> None:
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                if not os.path.islink(p):
                    os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
            except OSError:
                pass


def _check_hit(trial: Trial, store, conv: int, n: int, result, what: str) -> None:
    if result is None or not result.hit:
        if result is not None:
            trial.expect(bool(result.reason) and result.reason != "hit",
                         f"{what} conv{conv}: a miss without a reason: {result}")
        return
    trial.expect(result.hit_blocks <= n, f"{what} conv{conv}: {result.hit_blocks} > {n} blocks")
    read = trial.run(f"read after {what} conv{conv}",
                     lambda: store.read(result.handle, result.hit_blocks))
    if read is None or not read.ok:
        return
    expected = conv_pages(conv, n, BPP)
    full = len(read.pages) if result.hit_blocks == n else len(read.pages) - 1
    trial.expect([bytes(x) for x in read.pages[:full]] == expected[:full],
                 f"{what} conv{conv}: a hit returned WRONG BYTES")


def _lookups(trial: Trial, store, label: str) -> None:
    for conv, n in CONVS + (NEW,):
        keys = conv_keys(conv, n)
        plain = trial.run(f"{label} lookup conv{conv}", lambda: store.lookup(IDENT, keys))
        _check_hit(trial, store, conv, n, plain, f"{label} lookup")
        leased = trial.run(f"{label} lookup(lease) conv{conv}",
                           lambda: store.lookup(IDENT, keys, lease=True))
        _check_hit(trial, store, conv, n, leased, f"{label} lookup(lease)")
        if leased is not None and leased.hit:
            trial.run(f"{label} release conv{conv}", lambda: store.release(leased.lease_id))
        trial.run(f"{label} lookup(verify) conv{conv}",
                  lambda: store.lookup(IDENT, keys, verify=True))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_damage_never_escapes(pristine, data):
    ops = data.draw(st.lists(operations(pristine), min_size=1, max_size=6), label="damage")
    run_cli = data.draw(st.integers(0, CLI_EVERY - 1), label="cli") == CLI_EVERY - 1
    work = tempfile.mkdtemp(prefix="hostile-")
    try:
        root = os.path.join(work, "store")
        shutil.copytree(pristine.root, root, symlinks=True)
        outside = os.path.join(work, "outside")
        os.makedirs(os.path.join(outside, "sub"))
        with open(os.path.join(outside, "sub", "inner"), "wb") as f:
            f.write(b"inner bait")
        for name, content in BAIT.items():
            with open(os.path.join(outside, name), "wb") as f:
                f.write(content)
        base = os.path.join(os.path.realpath(root), "default")
        counter = [0]
        applied = [_short(op) for op in ops if apply(op, base, outside, pristine, counter)]
        watch = OutsideWatch(work, "store")
        trial = Trial(fifo_root=root, hang_s=OP_HANG_S)

        def step(name, fn):
            out = trial.run(name, fn)
            watch.check(name)
            return out

        store = step("open writer", lambda: open_store(root, page_blocks=BPP))
        if store is not None:
            _lookups(trial, store, "first")
            watch.check("lookups")
            pub = step("publish", lambda: store.publish(IDENT, conv_keys(*NEW),
                                                        conv_pages(*NEW, BPP)))
            trial.expect(pub is None or pub.ok or bool(pub.reason and pub.detail),
                         f"a failed publication without reason/detail: {pub}")
            step("capacity", store.capacity)
            step("run_pass", lambda: run_pass(store, BIG_BUDGET, sweep_shards=256))
            _lookups(trial, store, "after pass")
            watch.check("lookups after the pass")
        required = required_reports(base)
        report = step("verify_store", lambda: verify_store(StoreLayout.create(root, make=False)))
        if report is not None:
            for path, also in required:
                trial.expect(named(report, base, path, also),
                             f"verify_store does not name {os.path.relpath(path, base)}")
        if run_cli:
            res = cli("verify", "--root", root, timeout=20)
            watch.check("CLI verify")
            if res is None:
                trial.problems.append("CLI verify: HUNG")
            else:
                trial.expect(res.returncode in (0, 1) and "Traceback" not in res.stderr,
                             f"CLI verify exit {res.returncode}: {res.stderr[-800:]}")
                if "Traceback" not in res.stderr:
                    for path, also in required:
                        trial.expect(named_in_cli(res.stdout, path, also),
                                     f"CLI verify does not name {os.path.relpath(path, base)}")
        problems = trial.problems + (["OUTSIDE TOUCHED:"] + watch.changes if watch.changes else [])
        assert not problems, f"damage applied: {applied}\n" + "\n".join(problems)
    finally:
        unjam(find_fifos(work))
        _restore_perms(work)
        shutil.rmtree(work, ignore_errors=True)
