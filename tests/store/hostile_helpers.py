"""Helpers for the hostile-filesystem tests (test_hostile.py, test_hostile_properties.py):
hang guards, snapshots of what lies outside the store root, bait, forged manifests, mounts,
a stopped lock holder, and one battery of public operations whose failures are collected
(so a test reports every operation that hung or raised, not only the first)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sparkcache.store import PassBudget, run_pass, verify_store
from sparkcache.store.identity import entry_id_for
from sparkcache.store.layout import StoreLayout
from sparkcache.store.manifests import MAGIC
from store_helpers import CLI_CAP, IDENT, REPO_ROOT, conv_keys, conv_pages, open_store

HANG_S = float(os.environ.get("HOSTILE_HANG_S", "10"))  # one in-process operation
CLI_TIMEOUT_S = float(os.environ.get("HOSTILE_CLI_TIMEOUT_S", "20"))
BIG_BUDGET = PassBudget(max_entries=1024, max_bytes=1 << 50, max_ms=5000.0)

# The store these tests build: conversations of 10 and 7 blocks, 4 blocks per page, 256
# bytes per block (3 + 2 page objects, 2 manifests); conversation 5 is published by the
# battery, 9 is the forged one.
GOOD = ((1, 10), (2, 7))
NEW_CONV = (5, 6)


class Hung(BaseException):
    """An operation outlived its bound (raised from SIGALRM in the main thread)."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise ``Hung`` in the main thread after ``seconds`` (interrupts a blocking open of a
    FIFO, a blocking flock, a wait on a pool's future)."""
    def _alarm(signum, frame):
        raise Hung(f"still running after {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def unjam(paths: Iterable[str]) -> None:
    """Release any thread blocked opening or reading one of these FIFOs: open each
    read-write (never blocks on Linux), give the blocked opener a moment, close (EOF)."""
    for path in paths:
        try:
            if not stat.S_ISFIFO(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            continue
        time.sleep(0.05)
        os.close(fd)


def find_fifos(top: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    out.append(p)
            except OSError:
                pass
    return out


class Trial:
    """Runs operations under a hang bound, collecting every hang and escaped exception."""

    def __init__(self, fifo_root: str | None = None, hang_s: float = HANG_S) -> None:
        self.problems: list[str] = []
        self.fifo_root = fifo_root
        self.hang_s = hang_s

    def run(self, name: str, fn: Callable[[], Any], seconds: float | None = None) -> Any:
        seconds = self.hang_s if seconds is None else seconds
        try:
            with bounded(seconds):
                return fn()
        except Hung:
            self.problems.append(f"{name}: HUNG (> {seconds:g}s)")
            if self.fifo_root:
                unjam(find_fifos(self.fifo_root))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the point is that nothing escapes
            self.problems.append(f"{name}: RAISED {type(exc).__name__}: {str(exc)[:300]}")
        return None

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)

    def check_cli(self, name: str, *args: str,
                  ok_codes=(0, 1)) -> subprocess.CompletedProcess | None:
        res = cli(*args)
        if res is None:
            self.problems.append(f"CLI {name}: HUNG (> {CLI_TIMEOUT_S:g}s)")
            return None
        if "Traceback" in res.stderr or res.returncode not in ok_codes:
            self.problems.append(f"CLI {name}: exit {res.returncode}, stderr: "
                                 f"{res.stderr.strip()[-600:]}")
        return res

    def assert_clean(self) -> None:
        assert not self.problems, "\n".join(self.problems)


def cli(*args: str, env: dict | None = None,
        timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess | None:
    """``python -m sparkcache ARGS`` in a subprocess; None if it ran past ``timeout``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKCACHE_")}
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    try:
        return subprocess.run([sys.executable, "-m", "sparkcache", *args], capture_output=True,
                              text=True, env=full_env, cwd=REPO_ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


# ---------------------------------------------------------------------- snapshots


def snapshot(top: str | Path, *, skip: Iterable[str] = ()) -> dict[str, tuple]:
    """Every path under ``top`` (itself included, links not followed) with its type, mode,
    size, mtime and, for regular files, bytes. ``skip``: top-level names left out."""
    top = str(top)
    skip = set(skip)
    out: dict[str, tuple] = {}

    def record(path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        data = b""
        if stat.S_ISREG(st.st_mode):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as exc:
                data = f"<unreadable {exc.errno}>".encode()
        elif stat.S_ISLNK(st.st_mode):
            data = os.readlink(path).encode()
        out[os.path.relpath(path, top)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                           st.st_size, st.st_mtime_ns, data)

    record(top)
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath == top:
            dirnames[:] = [d for d in dirnames if d not in skip]
            filenames = [f for f in filenames if f not in skip]
        for name in dirnames + filenames:
            record(os.path.join(dirpath, name))
    return out


def diff_snapshots(before: dict, after: dict) -> list[str]:
    out = []
    for path in sorted(set(before) | set(after)):
        if path not in after:
            out.append(f"removed {path}")
        elif path not in before:
            out.append(f"created {path}")
        elif before[path] != after[path]:
            b, a = before[path], after[path]
            fields = ("type", "mode", "size", "mtime", "bytes")
            what = [n for n, x, y in zip(fields, b, a) if x != y]
            out.append(f"changed {path} ({', '.join(what)})")
    return out


class OutsideWatch:
    """Watches everything under ``top`` except the store root's top-level name, after each
    operation, so a test can say which operation touched the outside first."""

    def __init__(self, top: str | Path, store_name: str) -> None:
        self.top = str(top)
        self.skip = (store_name,)
        self.before = snapshot(self.top, skip=self.skip)
        self.changes: list[str] = []

    def check(self, after_op: str) -> None:
        now = snapshot(self.top, skip=self.skip)
        diff = diff_snapshots(self.before, now)
        if diff:
            self.changes.append(f"after {after_op}: " + "; ".join(diff[:8]))
            self.before = now  # report each operation's own changes

    def assert_untouched(self) -> None:
        assert not self.changes, "outside the store root:\n" + "\n".join(self.changes)


# ---------------------------------------------------------------------- store fixtures


def publish_good(root: str | Path):
    store = open_store(root)
    for conv, n in GOOD:
        assert store.publish(IDENT, conv_keys(conv, n), conv_pages(conv, n, 4)).ok
    return store


def entry_path(store, conv: int, n: int) -> str:
    return store.entry(store.lookup(IDENT, conv_keys(conv, n)).entry_id).path


def object_paths(store, conv: int, n: int) -> list[str]:
    handle = store.lookup(IDENT, conv_keys(conv, n)).handle
    return [store.objects.path(p.digest) for p in handle.pages]


def forge_bytes(body: bytes) -> bytes:
    """A manifest file with a valid checksum around ``body``."""
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def forged_entry_path(layout: StoreLayout, keys: list[str]) -> str:
    idd = IDENT.digest()
    return layout.manifest_path(idd, entry_id_for(idd, keys[-1]))


def hex_name(n: int) -> str:
    return secrets.token_hex((n + 1) // 2)[:n]


def make_fifo(path: str) -> None:
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil
            shutil.rmtree(path)
        else:
            os.unlink(path)
    os.mkfifo(path)


def problem_names(report, path: str) -> bool:
    return any(p.path == path or path in p.detail for p in report.problems)


# ---------------------------------------------------------------------- the battery


def battery(trial: Trial, root: str, *, watch: OutsideWatch | None = None,
            good: Iterable[tuple[int, int]] = GOOD, must_hit: Iterable[int] = (),
            evict: bool = True, run_cli: bool = True, store_kw: dict | None = None) -> dict:
    """Every public operation once: open a writer (recovery), lookups (plain, leased +
    release, verified) with a check that a hit reads exactly the published bytes, publish,
    a maintenance pass with a full orphan sweep, an evicting pass (a second writer whose TTL
    expires every entry), verify_store, and the CLI's status, verify, inspect and gc. Returns what
    it saw: ``store``, ``hits`` (conv -> LookupResult), ``publish``, ``verify``,
    ``cli_verify``."""
    seen: dict[str, Any] = {"hits": {}}
    kw = dict(store_kw or {})

    def step(name: str, fn: Callable[[], Any], seconds: float | None = None) -> Any:
        out = trial.run(name, fn, seconds)
        if watch is not None:
            watch.check(name)
        return out

    store = step("PageStore(writer) open + recovery", lambda: open_store(root, **kw))
    seen["store"] = store
    if store is not None:
        for conv, n in good:
            keys, pages = conv_keys(conv, n), conv_pages(conv, n, 4)
            plain = step(f"lookup conv{conv}", lambda: store.lookup(IDENT, keys))
            seen["hits"][conv] = plain
            if conv in must_hit:
                trial.expect(plain is not None and plain.hit,
                             f"good entry conv{conv} no longer hits: {plain}")
            if plain is not None and plain.hit:
                read = step(f"read conv{conv}", lambda: store.read(plain.handle, plain.hit_blocks))
                if read is not None and read.ok:
                    trial.expect(list(read.pages) == pages[:len(read.pages)],
                                 f"conv{conv}: a hit returned WRONG BYTES")
            leased = step(f"lookup(lease=True) conv{conv}",
                          lambda: store.lookup(IDENT, keys, lease=True))
            if leased is not None:
                trial.expect(leased.hit or bool(leased.reason and leased.reason != "hit"),
                             f"conv{conv}: leased lookup is neither a hit nor a miss with a reason")
                if leased.hit:
                    step(f"release conv{conv}", lambda: store.release(leased.lease_id))
            step(f"lookup(verify=True) conv{conv}", lambda: store.lookup(IDENT, keys, verify=True))
        conv, n = NEW_CONV
        seen["publish"] = step("publish", lambda: store.publish(
            IDENT, conv_keys(conv, n), conv_pages(conv, n, 4)))
        step("capacity", store.capacity)
        step("run_pass(sweep_shards=256)", lambda: run_pass(store, BIG_BUDGET, sweep_shards=256))
    layout = store.layout if store is not None else StoreLayout.create(str(root), make=False)
    seen["verify"] = step("verify_store", lambda: verify_store(layout))
    if run_cli:
        res = trial.check_cli("status", "status", "--root", str(root))
        if watch is not None:
            watch.check("CLI status")
        res = trial.check_cli("verify", "verify", "--root", str(root))
        seen["cli_verify"] = res
        if watch is not None:
            watch.check("CLI verify")
        hit = next((r for r in seen["hits"].values() if r is not None and r.entry_id), None)
        prefix = hit.entry_id[:8] if hit is not None else "0"
        trial.check_cli("inspect", "inspect", prefix, "--root", str(root), "--verify")
        if watch is not None:
            watch.check("CLI inspect")
        trial.check_cli("gc", "gc", "--root", str(root), "--config", CLI_CAP)  # the writers' cap
        if watch is not None:
            watch.check("CLI gc")
    if evict:  # every writer of a root has one cap: this one evicts by a TTL shorter than any age
        evictor = step("PageStore(writer, ttl_seconds=1e-6) open",
                       lambda: open_store(root, ttl_seconds=1e-6, **kw))
        if evictor is not None:
            step("evicting run_pass", lambda: run_pass(evictor, BIG_BUDGET, sweep_shards=256))
    return seen


# ---------------------------------------------------------------------- mounts and locks


@contextmanager
def small_tmpfs(at: Path, size: str = "1m") -> Iterator[str]:
    """A real tmpfs of ``size`` at ``at`` (the tests run as root, as CI does)."""
    at.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}"
    try:
        yield str(at)
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)


def fill_filesystem(directory: str) -> str:
    """Write a filler file until the filesystem says ENOSPC; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in (1 << 16, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        break
                    raise
    finally:
        os.close(fd)
    return path


@contextmanager
def bind_mount(source: Path, at: Path) -> Iterator[Path]:
    """``source`` bind-mounted at ``at`` (read-write until ``remount_read_only``)."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)


def remount_read_only(at: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro,bind", str(at)], check=True)


@contextmanager
def stopped_lock_holder(lock_path: str) -> Iterator[subprocess.Popen]:
    """A process that holds ``lock_path`` with flock(LOCK_EX) and is then SIGSTOPped."""
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({lock_path!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def json_body(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
