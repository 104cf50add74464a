"""SIGKILL a publishing process at random points, 200+ times.

After every kill: a fresh store (startup recovery) returns, for every prefix, either the
complete verified entry or a miss; every entry that was complete before the trial began is
still complete; ``verify`` passes. The child also runs orphan sweeps, so kills land inside
maintenance too.
"""

import os
import random
import select
import signal
import time

from sparkcache.store import PassBudget, run_pass, verify_store
from store_helpers import IDENT, conv_keys, conv_pages, open_store, run_cli

TRIALS = 220
CONVS = 4
BPP = 4


def _child(root: str, state: dict, seed: int, wfd: int) -> None:
    """Publish growing conversations forever; report each completed publication."""
    try:
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
                os.write(wfd, f"{conv} {new}\n".encode())
            if rng.random() < 0.15:
                run_pass(store, PassBudget(max_ms=1000), sweep_shards=64)
    finally:
        os._exit(0)


def _wait_for_lines(fd: int, count: int, timeout_s: float = 60.0) -> bytes:
    """What fd gave until count complete lines arrived."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while (got := buf.count(b"\n")) < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"the publishing child reported {got} of {count} publications in {timeout_s} s"
        chunk = os.read(fd, 4096)
        assert chunk, "the publishing child exited"
        buf += chunk
    return buf


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
    started = time.monotonic()
    for trial in range(TRIALS):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(root, state, rng.randrange(1 << 30), wfd)
        os.close(wfd)
        # Kill after the child reported 0-2 publications (its own progress, not the machine's
        # speed), then at a random moment up to 20 ms into what it does next.
        reported = _wait_for_lines(rfd, rng.randrange(3))
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(rfd, "rb") as pipe:
            lines = (reported + pipe.read()).decode().split("\n")[:-1]  # a cut-off last line is not complete
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
    cli = run_cli("gc", "--root", root, "--config", '{"maintenance_max_ms": 30000}')
    assert cli.returncode == 0 and "stopped_by=done" in cli.stdout, cli.stdout + cli.stderr
    assert [n for n in os.listdir(os.path.join(root, "default", "staging"))] == []
    cli = run_cli("verify", "--root", root)
    assert cli.returncode == 0 and "orphans=0" in cli.stdout, cli.stdout
    assert time.monotonic() - started < 120
