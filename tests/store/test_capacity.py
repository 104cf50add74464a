"""Capacity accounting, LRU eviction toward the low watermark, pins, TTL, refusal above
max, and budgeted maintenance passes that report the work they left."""

import os
import time

from sparkcache.store import MaintenanceThread, PassBudget, run_pass, verify_store
from sparkcache.store.clocks import SYSTEM_CLOCK, Clock
from store_helpers import IDENT, conv_keys, conv_pages, open_store, stopped_clock

PAGE = 4096  # 16 blocks * 256 bytes: one filesystem block per page


def _fill(store, convs, n_blocks=16):
    for conv in convs:
        assert store.publish(IDENT, conv_keys(conv, n_blocks), conv_pages(conv, n_blocks, 16)).ok


def _age(store, conv, seconds_ago, n_blocks=16):
    entry = store.entry(store.lookup(IDENT, conv_keys(conv, n_blocks)).entry_id)
    store.accesses.flush()  # the lookup's own stamp lands first (accesses.py), then ours
    t = time.time() - seconds_ago
    os.utime(entry.path, (t, t))


def _small_store(root, **kw):
    # each entry: one 4 KiB page + one manifest block = 8 KiB
    kw.setdefault("max_bytes", 80 * 1024)
    kw.setdefault("low_watermark_bytes", 40 * 1024)
    return open_store(root, page_blocks=16, **kw)


def test_eviction_goes_to_low_watermark_in_lru_order(tmp_path):
    store = _small_store(tmp_path)
    _fill(store, range(10))
    for conv in range(10):
        _age(store, conv, 100 - conv)  # conv 0 oldest
    _age(store, 0, 0)  # conv 0 was just read: now the newest
    _fill(store, [10])  # 11 entries = 88 KiB > 80 KiB
    assert store.capacity().over_max
    report = run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000))
    assert report.stopped_by == "done" and report.remaining_entries == 0
    assert report.used_bytes_after <= 40 * 1024 < report.used_bytes_before
    alive = [c for c in range(11) if store.lookup(IDENT, conv_keys(c, 16)).hit]
    assert alive == [0, 7, 8, 9, 10]  # the least recently used went first
    assert report.entries_evicted == 6 and report.bytes_reclaimed == 6 * 8192
    assert verify_store(store.layout).ok
    # below max again: a further pass has nothing to do
    again = run_pass(store, PassBudget())
    assert again.entries_evicted == 0


def test_pinned_entry_is_not_evicted(tmp_path):
    store = _small_store(tmp_path)
    _fill(store, range(11))
    for conv in range(11):
        _age(store, conv, 100 - conv)
    lease = store.lookup(IDENT, conv_keys(0, 16), lease=True)
    assert lease.lease_id
    _age(store, 0, 1000)  # still the oldest after the lookup touched it
    report = run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000))
    assert report.pinned_skipped == 1
    assert store.lookup(IDENT, conv_keys(0, 16)).hit
    assert report.used_bytes_after <= 40 * 1024
    store.release(lease.lease_id)
    store.max_bytes = store.low_watermark_bytes = 8192  # now make room for one entry only
    store.collector.draining = True
    _age(store, 0, 1000)
    run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000))
    assert not store.lookup(IDENT, conv_keys(0, 16)).hit


def test_expired_pin_no_longer_protects(tmp_path):
    store = _small_store(tmp_path, lease_seconds=1)
    _fill(store, range(11))
    lease = store.lookup(IDENT, conv_keys(0, 16), lease=True)
    _age(store, 0, 1000)
    # a pass 2 s later on the boot clock (its clocks, not a sleep): past the 1 s lease
    later = Clock(boot=lambda: SYSTEM_CLOCK.boot() + 2, boot_id=SYSTEM_CLOCK.boot_id)
    run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000), clocks=later)
    assert not store.lookup(IDENT, conv_keys(0, 16)).hit
    assert os.listdir(store.layout.pins_dir) == []  # the expired pin file was collected
    assert lease.lease_id


def test_ttl_expiry(tmp_path):
    store = _small_store(tmp_path, ttl_seconds=60)
    _fill(store, range(3))
    _age(store, 1, 120)
    report = run_pass(store, PassBudget())
    assert report.entries_expired == 1 and report.entries_evicted == 0
    assert [c for c in range(3) if store.lookup(IDENT, conv_keys(c, 16)).hit] == [0, 2]


def test_publication_refused_above_max(tmp_path):
    store = _small_store(tmp_path)
    _fill(store, range(11))  # the 11th publication crossed max: allowed (in flight)
    result = store.publish(IDENT, conv_keys(99, 16), conv_pages(99, 16, 16))
    assert not result.ok and result.reason == "over_capacity" and "SPARKCACHE_MAX_BYTES" in result.detail
    run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000))
    assert store.publish(IDENT, conv_keys(99, 16), conv_pages(99, 16, 16)).ok


def test_pass_stops_on_entry_budget_and_reports_remaining(tmp_path):
    store = _small_store(tmp_path)
    _fill(store, range(11))
    report = run_pass(store, PassBudget(max_entries=3, max_bytes=1 << 30, max_ms=5000))
    assert report.stopped_by == "entries" and report.entries_evicted == 3
    assert report.remaining_entries == 3  # 11 -> 5 entries reaches 40 KiB
    # still draining although now under max: the next passes finish the job
    assert store.collector.draining and not store.capacity().over_max
    report2 = run_pass(store, PassBudget(max_entries=3, max_bytes=1 << 30, max_ms=5000))
    assert report2.entries_evicted == 3 and report2.remaining_entries == 0
    assert store.capacity().used_bytes <= 40 * 1024 and not store.collector.draining


def test_pass_stops_on_byte_budget(tmp_path):
    store = _small_store(tmp_path)
    _fill(store, range(11))
    report = run_pass(store, PassBudget(max_entries=100, max_bytes=20 * 1024, max_ms=5000))
    assert report.stopped_by == "bytes" and report.entries_evicted == 2
    assert report.bytes_reclaimed <= 20 * 1024 and report.remaining_entries == 4


def test_pass_stops_on_time_budget(tmp_path):
    store = open_store(tmp_path, page_blocks=16, max_bytes=1 << 30, low_watermark_bytes=0)
    _fill(store, range(300))  # 300 * 8 KiB = 2.4 MiB
    store.max_bytes = 1 << 20
    report = run_pass(store, PassBudget(max_entries=10000, max_bytes=1 << 40, max_ms=5))
    assert report.stopped_by == "time", report
    assert report.remaining_entries > 0
    # Counting what is left is itself bounded by a slice of the budget, so on a loaded
    # machine it is a lower bound; never more than what was there.
    assert report.remaining_entries + report.entries_evicted <= 300


def test_orphans_are_collected_but_not_live_publications(tmp_path):
    from sparkcache.store.staging import Staging

    store = _small_store(tmp_path)
    _fill(store, [1])
    from sparkcache.store.backend import NewObject

    def put(staging: Staging, data: bytes) -> str:
        batch = store.objects.put_batch(staging)
        batch.add(NewObject.of(data))
        return next(iter(batch.flush().written))

    with Staging(store.layout) as dead_writer_stand_in:
        d_orphan = put(dead_writer_stand_in, b"orphan" * 100)
    with Staging(store.layout) as inflight:
        live = NewObject.of(b"in flight" * 100)
        d_live = live.ref.digest
        inflight.declare([d_live])
        put(inflight, live.data)
        report = run_pass(store, PassBudget(), sweep_shards=256, timer=stopped_clock)
        assert report.orphans_collected == 1, report
        assert not os.path.exists(store.objects.path(d_orphan))
        assert os.path.exists(store.objects.path(d_live))  # protected by the live intent
    assert verify_store(store.layout).ok and store.lookup(IDENT, conv_keys(1, 16)).hit


def test_maintenance_thread_keeps_idle_gap_and_store_under_max(tmp_path, monkeypatch):
    """11 entries (88 KiB) over an 80 KiB max, 2 entries a pass: the thread drains to the
    40 KiB low watermark in passes, each starting no sooner than ``interval`` after the
    previous one ended. Waits on the thread's own reports, never on a deadline."""
    import threading

    from sparkcache.store import maintenance

    store = _small_store(tmp_path)
    _fill(store, range(11))
    assert store.capacity().over_max
    interval = 0.2
    spans = []  # (monotonic start, monotonic end) of each pass, as the thread runs them
    real_pass = maintenance.run_pass

    def timed_pass(*args, **kw):
        start = time.monotonic()
        report = real_pass(*args, **kw)
        spans.append((start, time.monotonic()))
        return report

    monkeypatch.setattr(maintenance, "run_pass", timed_pass)
    drained = threading.Event()

    def on_report(report):
        if not store.collector.draining and not store.capacity().over_max:
            drained.set()

    # no time limit on a pass (its pacing is test_pacing's): each stops on its entry budget
    thread = MaintenanceThread(store, PassBudget(max_entries=2, max_bytes=1 << 30, max_ms=60000),
                               interval, sweep_every_s=3600, on_report=on_report).start()
    try:
        assert drained.wait(120), "the maintenance thread did not drain the store"  # a hang guard
    finally:
        thread.stop()
    assert thread.error is None
    reports = list(thread.reports)
    assert all(r.entries_evicted <= 2 for r in reports), reports
    assert len(reports) >= 3  # 6 entries to evict, 2 a pass
    assert any(r.stopped_by == "entries" and r.remaining_entries > 0 for r in reports), reports
    assert store.capacity().used_bytes <= 40 * 1024
    for (_, prev_end), (next_start, _) in zip(spans, spans[1:]):
        assert next_start - prev_end >= interval, (prev_end, next_start)  # the idle gap


def test_objects_of_a_dropped_entry_stay_counted_until_deleted(tmp_path):
    from sparkcache.store.locks import exclusive_lock

    store = _small_store(tmp_path)
    _fill(store, range(3))
    before = store.capacity().used_bytes
    lookup = store.lookup(IDENT, conv_keys(0, 16))
    obj = store.objects.path(lookup.handle.pages[0].digest)
    with exclusive_lock(store.layout, 1.0):
        store.collector.refresh_view()
        # what a pass out of time leaves: the pass's own drop (maintenance._drop_planned), no fsync
        path, _, _ = store.collector.forget(lookup.entry_id)
        store.collector.unlink([path])
    assert os.path.exists(obj) and store.capacity().entries == 2
    assert store.capacity().used_bytes == before - 4096  # only the manifest is gone yet
    assert verify_store(store.layout).ok
    report = run_pass(store, PassBudget())
    assert report.deferred_objects == 0 and not os.path.exists(obj)
    assert store.capacity().used_bytes == before - 8192


def test_the_shards_of_one_entry_are_evicted_together(tmp_path):
    # Tensor-parallel ranks publish one shard each of every entry (same blocks, identities that
    # differ only in tp_rank, their own bytes). Eviction takes a unit whole, even past a pass's
    # entry budget, and never breaks a unit one of whose shards is pinned: a lone shard is
    # useless (vLLM restores all ranks or none).
    import dataclasses

    ranks = [IDENT, dataclasses.replace(IDENT, tp_rank=1)]
    store = _small_store(tmp_path, max_bytes=100 * 1024, low_watermark_bytes=40 * 1024)
    for conv in range(6):  # 12 entries of 8 KiB: 96 KiB
        for identity in ranks:
            pages = conv_pages(conv + 100 * identity.tp_rank, 16, 16)
            assert store.publish(identity, conv_keys(conv, 16), pages).ok
    for conv in range(6):  # rank 1's shards a little older than rank 0's, each pair apart
        for rank, identity in enumerate(ranks):
            entry = store.entry(store.lookup(identity, conv_keys(conv, 16)).entry_id)
            store.accesses.flush()  # the lookup's own stamp lands first (accesses.py), then ours
            t = time.time() - 1000 + 100 * conv - rank
            os.utime(entry.path, (t, t))
    pinned = store.lookup(ranks[0], conv_keys(0, 16), lease=True)  # the oldest unit, rank 0 pinned
    assert store.publish(IDENT, conv_keys(9, 16), conv_pages(9, 16, 16)).ok  # crosses max_bytes
    for _ in range(4):  # each pass may stop on its 3 entries; a unit is never split between passes
        run_pass(store, PassBudget(max_entries=3, max_bytes=1 << 30, max_ms=5000))
        for conv in range(1, 6):
            hits = [store.lookup(identity, conv_keys(conv, 16)).hit for identity in ranks]
            assert hits[0] == hits[1], (conv, hits)

    def present(conv):
        return [store.lookup(identity, conv_keys(conv, 16)).hit for identity in ranks]

    assert store.capacity().used_bytes <= 40 * 1024
    assert present(0) == [True, True]  # pinned on rank 0: kept whole
    for conv in range(1, 6):
        assert present(conv)[0] == present(conv)[1], (conv, present(conv))
    store.release(pinned.lease_id)


def test_discard_removes_entries_now_unless_it_cannot(tmp_path):
    # The connector's scheduler discards shards whose siblings are missing: the manifests and
    # the objects only they referenced go at once; objects another entry shares stay; a pinned
    # entry, or all of them while the collector holds the lock, are left for a later try.
    import dataclasses

    from sparkcache.store.locks import exclusive_lock

    store = open_store(tmp_path)
    own_page, shared_page = conv_pages(1, 8, 4)
    lone = store.publish(IDENT, conv_keys(1, 8), [own_page, shared_page])
    other = dataclasses.replace(IDENT, tp_rank=1)
    assert lone.ok and store.publish(other, conv_keys(1, 8), [conv_pages(2, 4, 4)[0], shared_page]).ok
    also = store.publish(IDENT, conv_keys(3, 4), conv_pages(3, 4, 4))
    own, shared = (p.digest for p in store.entry(lone.entry_id).manifest.pages)
    pinned = store.lookup(IDENT, conv_keys(1, 8), lease=True)
    assert store.discard([lone.entry_id]) == () and store.entry(lone.entry_id) is not None
    store.release(pinned.lease_id)
    with exclusive_lock(store.layout, timeout_s=1.0):
        assert store.discard([lone.entry_id, also.entry_id]) == ()
    assert store.discard([lone.entry_id, also.entry_id, "0" * 40]) == (lone.entry_id, also.entry_id)
    assert store.entry(lone.entry_id) is None and store.lookup(other, conv_keys(1, 8)).hit
    assert not os.path.exists(store.objects.path(own)) and os.path.exists(store.objects.path(shared))
    assert store.discard([lone.entry_id]) == ()  # already gone
    assert verify_store(store.layout).ok


def _refresh_before_each_manifest_unlink(store, monkeypatch):
    """Another thread's lookup re-lists the manifests (the directory changed since the pass
    listed it: its own unlinks and publications change it) in the window between the
    collector dropping an entry from the view and unlinking its manifest file."""
    real_unlink = type(store.layout).unlink

    def unlink(layout, path):
        if path.endswith(".mf"):
            listed = os.stat(os.path.dirname(path)).st_mtime_ns
            os.utime(os.path.dirname(path), ns=(listed - 10**9, listed - 10**9))
            store.capacity()  # a lookup's refresh: the manifest is still on disk here
        return real_unlink(layout, path)

    monkeypatch.setattr(type(store.layout), "unlink", unlink)  # a frozen dataclass


def test_a_refresh_while_a_pass_unlinks_manifests_brings_no_entry_back(tmp_path, monkeypatch):
    # An entry read back in from its manifest between the collector forgetting it and
    # unlinking the file held on to its objects ("referenced again"), so the pass skipped
    # them; once the file was gone the next refresh dropped the entry and its objects were
    # left on disk, neither counted as used nor reclaimed, until an orphan sweep reached them.
    store = _small_store(tmp_path)
    _fill(store, range(11))  # 11 entries = 88 KiB > 80 KiB
    pages = [store.objects.path(p.digest) for e in store.entries() for p in e.manifest.pages]
    _refresh_before_each_manifest_unlink(store, monkeypatch)
    report = run_pass(store, PassBudget(max_entries=100, max_bytes=1 << 30, max_ms=5000),
                      sweep_shards=0)
    assert report.entries_evicted == 6 and report.deferred_objects == 0
    assert report.bytes_reclaimed == 6 * 8192, report  # each entry's page and manifest
    assert store.capacity().entries == 5 and store.capacity().used_bytes == 5 * 8192
    assert sum(os.path.exists(p) for p in pages) == 5  # no object of an evicted entry is left
    assert verify_store(store.layout).ok


def test_a_refresh_while_discard_unlinks_manifests_brings_no_entry_back(tmp_path, monkeypatch):
    # The same window in ``discard`` (the connector's scheduler drops shards whose siblings
    # are missing while lookups run).
    store = _small_store(tmp_path)
    _fill(store, range(3))
    gone = [store.lookup(IDENT, conv_keys(conv, 16)) for conv in (0, 1)]
    pages = [store.objects.path(g.handle.pages[0].digest) for g in gone]
    _refresh_before_each_manifest_unlink(store, monkeypatch)
    assert store.discard([g.entry_id for g in gone]) == tuple(g.entry_id for g in gone)
    assert store.capacity().entries == 1 and store.capacity().used_bytes == 8192
    assert not any(os.path.exists(p) for p in pages)
    assert verify_store(store.layout).ok


def test_a_maintenance_pass_waits_in_its_pace_and_evicts_nothing_meanwhile(tmp_path):
    """``pace`` is called before each pass (the connector holds maintenance there while the
    model prefills): while it waits, the store over its max stays as it is."""
    import threading

    store = _small_store(tmp_path)
    _fill(store, range(11))
    go = threading.Event()
    paced = threading.Event()

    def pace() -> None:
        paced.set()
        go.wait(30)

    thread = MaintenanceThread(store, PassBudget(), 0.05, sweep_every_s=3600, pace=pace).start()
    try:
        assert paced.wait(30), "the maintenance thread never came to its pace"
        threading.Event().wait(0.3)
        assert not thread.reports and store.capacity().over_max, "a pass ran while its pace held it"
        assert len(store.entries()) == 11
        go.set()
        for _ in range(3000):
            if thread.reports:
                break
            threading.Event().wait(0.01)
    finally:
        go.set()
        thread.stop()
    assert thread.error is None and thread.reports and not store.capacity().over_max


def test_a_maintenance_thread_stopped_while_its_pace_holds_it_runs_no_pass(tmp_path):
    import threading

    store = _small_store(tmp_path)
    _fill(store, range(11))
    paced = threading.Event()

    def pace() -> None:  # as the connector's hold: a wait with a bound
        paced.set()
        threading.Event().wait(0.5)

    thread = MaintenanceThread(store, PassBudget(), 0.05, sweep_every_s=3600, pace=pace).start()
    assert paced.wait(30), "the maintenance thread never came to its pace"
    thread.stop()
    assert thread.error is None and not thread.reports, "a pass ran after the thread was stopped"
    assert len(store.entries()) == 11
