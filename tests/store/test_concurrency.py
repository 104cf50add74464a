"""Several processes publishing, reading and maintaining one root at once."""

import multiprocessing as mp
import random

from sparkcache.store import PassBudget, run_pass, verify_store
from store_helpers import IDENT, conv_keys, conv_pages, open_store

BPP = 4
PUBLISHES = 40  # attempts per publisher (more while eviction has not run enough yet)
MAX_PASSES = 500  # ... but not past this many maintenance passes: a store that never evicts fails
READER_HITS = 20  # verified reads per reader, at least
JOIN_S = 600  # a hang guard, not a speed target: every process stops on its own progress


def _publisher(root, cap, worker, convs, log_path, evicted, passes, min_evicted):
    rng = random.Random(worker)
    store = open_store(root, page_blocks=BPP, **cap)
    state = {c: 0 for c in convs}
    attempts = 0
    with open(log_path, "w") as log:
        while attempts < PUBLISHES or (evicted.value < min_evicted and passes.value < MAX_PASSES):
            attempts += 1
            conv = rng.choice(convs)
            n = state[conv] + rng.randint(1, 5)
            pages = conv_pages(conv, n, BPP)
            result = store.publish(IDENT, conv_keys(conv, n), pages)
            if result.ok:
                state[conv] = n
                log.write(f"{conv} {n}\n")
                log.flush()
            elif result.reason != "over_capacity":
                raise AssertionError(result)


def _reader(root, cap, worker, convs, out_path, publishers_done, use_lease):
    rng = random.Random(1000 + worker)
    store = open_store(root, page_blocks=BPP, **cap)
    hits = bad = pinned_failures = 0
    while not (publishers_done.is_set() and hits >= READER_HITS):
        conv = rng.choice(convs)
        lookup = store.lookup(IDENT, conv_keys(conv, 200), lease=use_lease)
        if not lookup.hit:
            continue
        read = store.read(lookup.handle, lookup.hit_blocks)
        store.release(lookup.lease_id)
        if not read.ok:
            pinned_failures += use_lease
            continue
        hits += 1
        expect = conv_pages(conv, lookup.handle.block_count, BPP)
        bad += list(read.pages) != expect[: len(read.pages)]
    with open(out_path, "w") as f:
        f.write(f"{hits} {bad} {pinned_failures}\n")


def _maintainer(root, cap, evicted, passes, publishers_done):
    store = open_store(root, page_blocks=BPP, **cap)
    while not publishers_done.is_set():
        report = run_pass(store, PassBudget(max_entries=16, max_bytes=1 << 30, max_ms=50),
                          sweep_shards=32)
        with evicted.get_lock():
            evicted.value += report.entries_evicted
        with passes.get_lock():
            passes.value += 1
        publishers_done.wait(0.02)  # an idle gap between passes


def _run(tmp_path, max_bytes, low, use_lease, min_evicted=0):
    """Publishers, readers and a maintainer on one root at once. Each publisher makes
    PUBLISHES attempts, and goes on until the maintainer evicted ``min_evicted`` entries (or
    ran MAX_PASSES passes); the
    maintainer runs until the publishers are done; each reader until then and until it read
    READER_HITS entries. Progress, not a duration: the same work on a fast or a slow machine."""
    root = str(tmp_path / "store")
    cap = {"max_bytes": max_bytes, "low_watermark_bytes": low}  # every writer of a root: one cap
    open_store(root, page_blocks=BPP, **cap)
    ctx = mp.get_context("forkserver")  # workers fork from a small server, not from a pytest process that loaded vLLM
    evicted, passes, publishers_done = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
    publishers, others, logs, outs = [], [], [], []
    # conv 0 and 1 are published by two workers each (same bytes: dedup races)
    plans = {0: [0, 1, 2], 1: [1, 3], 2: [0, 4, 5], 3: [6, 7]}
    for w, convs in plans.items():
        logs.append(str(tmp_path / f"pub{w}.log"))
        publishers.append(ctx.Process(target=_publisher,
                                      args=(root, cap, w, convs, logs[-1], evicted, passes,
                                            min_evicted)))
    for w in range(3):
        outs.append(str(tmp_path / f"read{w}.out"))
        others.append(ctx.Process(target=_reader, args=(root, cap, w, list(range(8)), outs[-1],
                                                        publishers_done, use_lease)))
    others.append(ctx.Process(target=_maintainer, args=(root, cap, evicted, passes, publishers_done)))
    try:
        for p in publishers + others:
            p.start()
        for p in publishers:
            p.join(JOIN_S)
            assert p.exitcode == 0, f"publisher {p.name} exited {p.exitcode}"
        publishers_done.set()
        for p in others:
            p.join(JOIN_S)
            assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"
    finally:
        publishers_done.set()
        for p in publishers + others:
            if p.is_alive():
                p.kill()
                p.join()
    totals = [tuple(map(int, open(o).read().split())) for o in outs]
    return root, logs, totals, evicted.value


def test_concurrent_publish_read_and_maintenance_lose_nothing(tmp_path):
    root, logs, totals, evicted = _run(tmp_path, max_bytes=1 << 30, low=1 << 29, use_lease=False)
    assert evicted == 0
    assert sum(t[1] for t in totals) == 0  # every read returned the bytes published
    complete = {}
    for log in logs:
        for line in open(log):
            conv, n = map(int, line.split())
            complete[conv] = max(complete.get(conv, 0), n)
    assert len(complete) == 8
    store = open_store(root, page_blocks=BPP, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    for conv, n in complete.items():
        lookup, read = store.fetch(IDENT, conv_keys(conv, n))
        assert lookup.hit_blocks == n and read.ok, (conv, n, lookup)
        assert list(read.pages) == conv_pages(conv, lookup.handle.block_count, BPP)[: len(read.pages)]
    report = verify_store(store.layout)
    assert report.ok, report.problems


def test_concurrent_eviction_never_breaks_a_leased_read(tmp_path):
    # 96 KiB max: the maintainer evicts continuously while readers hold leases
    root, _, totals, evicted = _run(tmp_path, max_bytes=96 << 10, low=48 << 10, use_lease=True,
                                    min_evicted=21)
    assert evicted > 20  # eviction really ran while the publishers published
    assert sum(t[1] for t in totals) == 0
    assert sum(t[2] for t in totals) == 0  # a leased entry's pages were never deleted
    store = open_store(root, page_blocks=BPP, read_only=True)
    assert verify_store(store.layout).ok
