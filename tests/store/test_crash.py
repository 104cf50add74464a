"""SIGKILL a publishing process at random points, 200+ times.

After every kill: a fresh store (startup recovery) returns, for every prefix, either the
complete verified entry or a miss; every entry that was complete before the trial began is
still complete; ``verify`` passes. The child also runs orphan sweeps, so kills land inside
maintenance too.

Where a kill lands is chosen by the child's own progress, never by a clock: the child is
SIGKILLed just before its k-th call that changes the disk (a write, fsync, rename, unlink,
mkdir, a file created; k drawn per trial), so the same seed kills at the same points on a
fast or a loaded machine. Only those calls change what recovery finds; a kill between two of
them leaves the same files as a kill at the next one.
"""

import json
import os
import random
import select
import signal

from sparkcache.store import PassBudget, run_pass, verify_store
from store_helpers import CLI_CAP, IDENT, conv_keys, conv_pages, open_store, run_cli

TRIALS = 220
CONVS = 4
BPP = 4
KILL_WITHIN = 120  # calls that change the disk: a store opening plus about three publications
HANG_S = 120  # a hang guard per trial (a child that never reaches its kill point), not a speed target

_CHANGES_DISK = ("write", "pwrite", "fsync", "fdatasync", "rename", "replace", "link", "unlink",
                 "rmdir", "mkdir", "utime", "ftruncate")


def _kill_at_call(k: int) -> None:
    """In the child: SIGKILL this process just before its k-th call that changes the disk."""
    left = [k]
    kill = os.kill

    def counted(fn):
        def call(*args, **kwargs):
            left[0] -= 1
            if left[0] <= 0:
                kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return call

    def open_counted(path, flags, *args, **kwargs):
        return (counted(real_open) if flags & os.O_CREAT else real_open)(path, flags, *args, **kwargs)

    real_open = os.open
    for name in _CHANGES_DISK:
        if hasattr(os, name):
            setattr(os, name, counted(getattr(os, name)))
    os.open = open_counted


def _child(root: str, state: dict, seed: int, kill_at: int, wfd: int) -> None:
    """Publish growing conversations until killed; report each completed publication."""
    try:
        report = os.write  # the reports to the parent are not store work: never counted
        _kill_at_call(kill_at)
        rng = random.Random(seed)
        store = open_store(root, page_blocks=BPP)
        state = dict(state)
        while True:
            conv = rng.randrange(CONVS)
            old = state[conv]
            new = old + rng.randint(1, 6)
            pages = conv_pages(conv, new, BPP)
            if old and rng.random() < 0.5:  # grow without re-capturing full stored pages
                pages = [None if (i + 1) * BPP <= old else p for i, p in enumerate(pages)]
            result = store.publish(IDENT, conv_keys(conv, new), pages)
            if result.ok:
                state[conv] = new
                report(wfd, f"{conv} {new}\n".encode())
            if rng.random() < 0.15:
                run_pass(store, PassBudget(max_ms=1000), sweep_shards=64)
    finally:
        os._exit(0)


def _read_until_exit(fd: int) -> bytes:
    """Everything the child wrote before it died (EOF on the pipe)."""
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], HANG_S)
        assert ready, f"the publishing child neither published nor died in {HANG_S} s"
        chunk = os.read(fd, 4096)
        if not chunk:
            return buf
        buf += chunk


def _check_conversation(store, conv: int, complete: int) -> None:
    if complete:
        lookup, read = store.fetch(IDENT, conv_keys(conv, complete))
        assert lookup.hit and lookup.hit_blocks == complete, (conv, complete, lookup)
        assert read.ok
        expect = conv_pages(conv, lookup.handle.block_count, BPP)
        assert list(read.pages) == expect[: len(read.pages)]
    # a longer request: a hit must be complete and verified, anything else a miss
    lookup, read = store.fetch(IDENT, conv_keys(conv, complete + 12))
    if lookup.hit:
        assert read.ok and lookup.hit_blocks >= complete
        expect = conv_pages(conv, lookup.handle.block_count, BPP)
        assert list(read.pages) == expect[: len(read.pages)]
    else:
        assert complete == 0 and lookup.reason == "not_found", lookup


def test_sigkill_publisher_at_random_points(tmp_path):
    root = str(tmp_path / "store")
    open_store(root, page_blocks=BPP)
    rng = random.Random(2024)
    state = {c: 0 for c in range(CONVS)}
    kills_with_work = interrupted = 0
    for trial in range(TRIALS):
        rfd, wfd = os.pipe()
        kill_at = rng.randrange(1, KILL_WITHIN + 1)
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(root, state, rng.randrange(1 << 30), kill_at, wfd)
        os.close(wfd)
        try:
            out = _read_until_exit(rfd)
        except BaseException:
            os.kill(pid, signal.SIGKILL)  # the hang guard tripped
            raise
        finally:
            os.close(rfd)
            _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the child ended (status {status}) before its kill point: an error in it")
        lines = out.decode().split("\n")[:-1]
        before = dict(state)
        for line in lines:
            conv, n = map(int, line.split())
            state[conv] = n
        kills_with_work += bool(lines)
        store = open_store(root, page_blocks=BPP)  # startup recovery
        interrupted += store.last_recovery.stale_publications_removed
        for conv in range(CONVS):
            assert state[conv] >= before[conv]
            _check_conversation(store, conv, state[conv])
        if trial % 20 == 19:
            report = verify_store(store.layout)
            assert report.ok, report.problems
        if sum(state.values()) > 600:  # keep the entries small: start new conversations
            state = {c: 0 for c in range(CONVS)}
            root = str(tmp_path / f"store{trial}")
            open_store(root, page_blocks=BPP)  # exists even if no later trial runs (the gc below)
    assert kills_with_work > TRIALS // 5  # many children finished publications before the kill
    assert interrupted > TRIALS // 5  # and many kills landed inside a publication
    # recovery leaves no stale publication behind, and a full gc + verify is clean
    cli = run_cli("gc", "--root", root, "--config", json.dumps(  # the writers' cap: one per root
        {"maintenance_max_ms": 30000, **json.loads(CLI_CAP)}))
    assert cli.returncode == 0 and "stopped_by=done" in cli.stdout, cli.stdout + cli.stderr
    assert [n for n in os.listdir(os.path.join(root, "default", "staging"))] == []
    cli = run_cli("verify", "--root", root)
    assert cli.returncode == 0 and "orphans=0" in cli.stdout, cli.stdout
