"""Several processes publishing, reading and maintaining one root at once."""

import multiprocessing as mp
import random
import time

from sparkcache.store import PassBudget, run_pass, verify_store
from store_helpers import IDENT, conv_keys, conv_pages, open_store

BPP = 4
SECONDS = 4.0


def _publisher(root, worker, convs, log_path, seconds):
    rng = random.Random(worker)
    store = open_store(root, page_blocks=BPP)
    state = {c: 0 for c in convs}
    with open(log_path, "w") as log:
        end = time.time() + seconds
        while time.time() < end:
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


def _reader(root, worker, convs, out_path, seconds, use_lease):
    rng = random.Random(1000 + worker)
    store = open_store(root, page_blocks=BPP)
    hits = bad = pinned_failures = 0
    end = time.time() + seconds
    while time.time() < end:
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


def _maintainer(root, seconds, max_bytes, low, out_path):
    store = open_store(root, page_blocks=BPP, max_bytes=max_bytes, low_watermark_bytes=low)
    evicted = 0
    end = time.time() + seconds
    while time.time() < end:
        report = run_pass(store, PassBudget(max_entries=16, max_bytes=1 << 30, max_ms=50),
                          sweep_shards=32)
        evicted += report.entries_evicted
        time.sleep(0.02)
    with open(out_path, "w") as f:
        f.write(f"{evicted}\n")


def _run(tmp_path, max_bytes, low, use_lease):
    root = str(tmp_path / "store")
    open_store(root, page_blocks=BPP)
    ctx = mp.get_context("fork")
    procs, logs, outs = [], [], []
    # conv 0 and 1 are published by two workers each (same bytes: dedup races)
    plans = {0: [0, 1, 2], 1: [1, 3], 2: [0, 4, 5], 3: [6, 7]}
    for w, convs in plans.items():
        logs.append(str(tmp_path / f"pub{w}.log"))
        procs.append(ctx.Process(target=_publisher, args=(root, w, convs, logs[-1], SECONDS)))
    for w in range(3):
        outs.append(str(tmp_path / f"read{w}.out"))
        procs.append(ctx.Process(target=_reader, args=(root, w, list(range(8)), outs[-1],
                                                       SECONDS, use_lease)))
    evicted_path = str(tmp_path / "maintainer.out")
    procs.append(ctx.Process(target=_maintainer, args=(root, SECONDS, max_bytes, low, evicted_path)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"{p.name} exited {p.exitcode}"
    totals = [tuple(map(int, open(o).read().split())) for o in outs]
    return root, logs, totals, int(open(evicted_path).read())


def test_concurrent_publish_read_and_maintenance_lose_nothing(tmp_path):
    root, logs, totals, evicted = _run(tmp_path, max_bytes=1 << 30, low=1 << 29, use_lease=False)
    assert evicted == 0
    assert sum(t[0] for t in totals) > 50 and sum(t[1] for t in totals) == 0
    complete = {}
    for log in logs:
        for line in open(log):
            conv, n = map(int, line.split())
            complete[conv] = max(complete.get(conv, 0), n)
    assert len(complete) == 8
    store = open_store(root, page_blocks=BPP)
    for conv, n in complete.items():
        lookup, read = store.fetch(IDENT, conv_keys(conv, n))
        assert lookup.hit_blocks == n and read.ok, (conv, n, lookup)
        assert list(read.pages) == conv_pages(conv, lookup.handle.block_count, BPP)[: len(read.pages)]
    report = verify_store(store.layout)
    assert report.ok, report.problems


def test_concurrent_eviction_never_breaks_a_leased_read(tmp_path):
    # 96 KiB max: the maintainer evicts continuously while readers hold leases
    root, _, totals, evicted = _run(tmp_path, max_bytes=96 << 10, low=48 << 10, use_lease=True)
    assert evicted > 20  # eviction really ran all along
    hits = sum(t[0] for t in totals)
    assert hits > 20 and sum(t[1] for t in totals) == 0
    assert sum(t[2] for t in totals) == 0  # a leased entry's pages were never deleted
    store = open_store(root, page_blocks=BPP)
    assert verify_store(store.layout).ok
