"""The shared tier's capacity sweeper (sparkcache/store/remote_sweeper.py, ``remote-gc``) on a real
S3 server (the tests' SeaweedFS): a namespace filled as the tier fills it (remote_gc_helpers), then
swept. Over the bound the entries least recently accessed go first and every entry left reads
back whole; objects no manifest names go only once older than the grace; pointers follow their
entries; a server that stops answering, before or during a pass, deletes nothing it should not
and says why; two sweepers at once leave the bucket consistent."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import obstore
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remote_gc_helpers import NAMESPACE, RemoteNamespace, tick
from remote_helpers import fresh_prefix, random_pages, remote_keys_of, tier_of, two_stores
from sparkcache.store.remote_census import SweepRequests, take_census
from sparkcache.store.remote_counts import FetchReason
from sparkcache.store.identity import Identity
from sparkcache.store.remote_keys import KeyKind, RemoteKeys
from sparkcache.store.remote_sweeper import StoppedBy, Why, apply_sweep, plan_sweep, sweep
from sparkcache.store.s3_location import S3Location
from store_helpers import IDENT, open_store, run_cli
from testing.seaweedfs import SeaweedFS

GRACE_S = 3600.0


def _sweep(ns: RemoteNamespace, max_bytes: int, **kw):
    return sweep(ns.location, NAMESPACE, max_bytes, kw.pop("grace_s", GRACE_S), **kw)


def _filled(ns: RemoteNamespace):
    """Four entries, accessed in a known order: ``a`` (conversation 1, 8 blocks) is never
    fetched after its upload, ``c`` (conversation 2) next, then ``b`` (conversation 1 grown to
    12 blocks: it shares a's two pages, and a's first block key, whose pointer names a), then
    ``d`` (conversation 3) last. Returns them and the bytes only c holds."""
    a = ns.upload(1, 8)
    b = ns.upload(1, 12)
    c = ns.upload(2, 12)
    d = ns.upload(3, 12)
    for entry in (c, b, d):
        tick()
        ns.access(entry)
    c_bytes = sum(ref.size for ref in c.manifest.objects)
    return a, b, c, d, c_bytes


def test_over_the_bound_the_least_recently_accessed_go_first_and_every_entry_left_reads_back(
        seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    a, b, c, d, c_bytes = _filled(ns)
    used = ns.used_bytes()
    bound = used - c_bytes  # evicting a frees nothing (b holds its pages): c must go too
    planned = _sweep(ns, bound, dry_run=True)
    assert planned.dry_run and planned.entries_evicted == 2 and planned.used_bytes_after == bound
    assert ns.used_bytes() == used  # a dry run deletes nothing
    report = _sweep(ns, bound)
    assert report.stopped_by is StoppedBy.DONE, report
    assert (report.entries_evicted, report.used_bytes_before, report.used_bytes_after) == (2, used, bound)
    assert report.bytes_freed == c_bytes and not report.over_bound
    assert ns.used_bytes() == bound
    assert ns.assert_consistent() == sorted([b.entry_id, d.entry_id])  # b's shared pages survived a
    kinds = ns.kinds()
    assert kinds[KeyKind.ACCESS] == {b.entry_id, d.entry_id}
    assert report.pointers_repointed == 1  # the first block key's pointer named a: now b
    again = _sweep(ns, bound)
    assert again.entries_evicted == 0 and again.requests_done == 0 and again.stopped_by is StoppedBy.DONE


def test_an_entry_accessed_recently_survives_one_uploaded_long_ago(seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    old = ns.upload(4, 8)
    new = ns.upload(5, 8)
    tick()
    ns.access(old)  # fetched after new was uploaded: new is now the least recently accessed
    report = _sweep(ns, ns.used_bytes() - 1)
    assert report.entries_evicted == 1 and ns.assert_consistent() == [old.entry_id]
    assert new.entry_id not in ns.kinds()[KeyKind.MANIFEST]


def test_unreferenced_objects_go_once_older_than_the_grace_and_young_ones_stay(seaweedfs, monkeypatch, tmp_path):
    """An upload in progress has PUT objects and not yet its manifest: its objects are younger
    than the grace and stay. An upload cut short long ago left objects older than it: they go.
    So do a pointer and an access mark of an entry that is not there, once as old."""
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    kept = ns.upload(6, 8)
    gone = ns.orphan(os.urandom(3000))
    ghost = "f" * 40
    ns.put(ns.keys.pointer_key("c99-b0"), ghost.encode())
    ns.put(ns.keys.access_key(ghost), b"")
    tick()
    tick()
    young = ns.orphan(os.urandom(5000))
    listing = ns.listing()
    now = listing[young]["last_modified"].timestamp()
    grace = (now - listing[gone]["last_modified"].timestamp()) / 2  # between the two
    report = _sweep(ns, 0, grace_s=grace, now=now)
    assert report.stopped_by is StoppedBy.DONE, report
    assert (report.orphans_deleted, report.pointers_deleted, report.access_marks_deleted) == (1, 1, 1)
    assert (report.young_unreferenced_objects, report.young_unreferenced_bytes) == (1, 5000)
    after = ns.listing()
    assert young in after and gone not in after
    assert ns.kinds()[KeyKind.ACCESS] == set() and ns.assert_consistent() == [kept.entry_id]


def test_a_pointer_an_entry_lacks_is_put_naming_it(seaweedfs, monkeypatch, tmp_path):
    """An upload cut short between its manifest and its pointers (or a pointer deleted while an
    upload found it present) leaves an entry the lookup's bisection cannot reach: the pass puts
    the pointer back, naming that entry, and leaves the others as they are. A recent pointer
    naming an entry that is not there is pointed at one that holds its key."""
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    entry = ns.upload(15, 20)  # pointers at positions 0 and 15
    lost = ns.keys.pointer_key(entry.manifest.block_keys[15])
    obstore.delete(ns.raw, lost)
    kept = ns.listing()[ns.keys.pointer_key(entry.manifest.block_keys[0])]
    report = _sweep(ns, 0)
    assert report.pointers_restored == 1 and report.requests_done == 1, report
    assert bytes(obstore.get(ns.raw, lost).bytes()) == entry.entry_id.encode()
    assert ns.listing()[ns.keys.pointer_key(entry.manifest.block_keys[0])]["e_tag"] == kept["e_tag"]
    assert ns.assert_consistent() == [entry.entry_id]
    ns.put(lost, b"f" * 40, create=False)  # a race of two sweepers: it names an entry not there
    report = _sweep(ns, 0)
    assert report.pointers_repointed == 1 and report.requests_done == 1, report
    assert ns.assert_consistent() == [entry.entry_id]


def test_an_entry_whose_object_is_missing_is_dropped_whatever_the_bound(seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    whole = ns.upload(7, 8)
    broken = ns.upload(8, 8)
    obstore.delete(ns.raw, ns.keys.object_key(broken.manifest.pages[1].digest))  # lost
    report = _sweep(ns, 0)
    assert (report.entries_evicted, report.incomplete_entries) == (1, 1)
    assert ns.assert_consistent() == [whole.entry_id]


def test_a_manifest_that_cannot_be_read_stops_the_pass_before_any_deletion(seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    first = ns.upload(9, 8)
    ns.upload(10, 8)
    ns.put(first.manifest_key, b"SPKM1 not a manifest", create=False)
    before = ns.listing()
    report = _sweep(ns, 1)
    assert report.stopped_by is StoppedBy.UNKNOWN and not report.ok
    assert first.manifest_key in report.error and "nothing was deleted" in report.error
    assert "remove that key" in report.error
    assert ns.listing().keys() == before.keys()


def test_a_server_that_stops_answering_deletes_nothing_and_the_cli_says_why(tmp_path, monkeypatch):
    """Before the pass (SIGKILL): the census fails, nothing is deleted, the report and the CLI
    (exit 1) name the endpoint and the fix. During the pass (SIGKILL once its first eviction
    is done): it stops with ``error``, and what it left is consistent; the next pass finishes."""
    with SeaweedFS(tmp_path / "s3") as server:
        bounds = dict(timeout_s=2.0, connect_timeout_s=0.5, retries=0)
        ns = RemoteNamespace(server, monkeypatch, tmp_path / "local", **bounds)
        for conv in (11, 12, 13, 14):
            ns.upload(conv, 8)
        before = ns.listing()
        server.kill()
        try:
            report = _sweep(ns, 1)
            assert report.stopped_by is StoppedBy.UNKNOWN and report.requests_done == 0, report
            assert server.endpoint.url in report.error and "SPARKCACHE_REMOTE_ENDPOINT" in report.error
            metrics = tmp_path / "remote_gc.prom"
            cli = run_cli("remote-gc", "--metrics-file", str(metrics), env=_cli_env(ns, max_bytes=1))
            assert cli.returncode == 1, (cli.stdout, cli.stderr)
            assert "nothing was deleted" in cli.stderr and "SPARKCACHE_REMOTE_ENDPOINT" in cli.stderr
            assert "stopped_by=unknown" in cli.stdout and "used_bytes" not in cli.stdout
            assert f'vllm:sparkcache_remote_gc_last_pass_ok{{namespace="{NAMESPACE}"}} 0.0' in metrics.read_text()
            assert "remote_gc_used_bytes" not in metrics.read_text()  # not known: not said
            status = run_cli("remote-status", env=_cli_env(ns, max_bytes=1))
            assert status.returncode == 1 and "could not be listed" in status.stderr
        finally:
            server.start()
        assert ns.listing().keys() == before.keys()

        bucket = SweepRequests(ns.location)
        plan = plan_sweep(bucket, take_census(bucket, NAMESPACE), 1, GRACE_S)
        assert [e.why for e in plan.evictions] == [Why.LRU] * 4
        killed = []

        def kill_after_first(progress):
            if not killed:
                killed.append(progress)
                server.kill()

        try:
            report = apply_sweep(bucket, plan, 10_000, on_progress=kill_after_first)
        finally:
            server.start()
            bucket.close()
        assert report.stopped_by is StoppedBy.ERROR and report.entries_evicted == 1, report
        assert server.endpoint.url in report.error
        left = ns.assert_consistent()
        assert len(left) == 3 and plan.evictions[0].entry.entry_id not in left
        assert _sweep(ns, 1).entries_evicted == 3 and ns.assert_consistent() == []


def test_against_a_server_that_hangs_a_batch_of_requests_waits_for_one_round_of_timeouts(tmp_path, monkeypatch):
    """SIGSTOPped, the server accepts and never answers: the sweeper's batch of many requests
    (a census reads every manifest this way) fails within one request timeout, however few it
    keeps in flight (once one has failed, the rest are not sent), as the object backend's do."""
    timeout_s = 1.0
    with SeaweedFS(tmp_path / "s3") as server:
        ns = RemoteNamespace(server, monkeypatch, tmp_path / "local", timeout_s=timeout_s,
                             connect_timeout_s=0.5, retries=0, requests_in_flight=2)
        bucket = SweepRequests(ns.location)
        sent = []

        def get(key):
            sent.append(key)
            return bucket.get(key, 1 << 20)

        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as caught:
                bucket.each(get, [f"{ns.location.prefix}/never/{i}" for i in range(12)])
            took = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            bucket.close()
        assert server.endpoint.url in str(caught.value)
        assert took < 2 * timeout_s + 1.0 and len(sent) < 12, (took, len(sent))


def test_two_sweepers_at_once_leave_the_bucket_consistent(seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    entries = [ns.upload(conv, 12) for conv in range(20, 26)] + [ns.upload(20, 16), ns.upload(21, 20)]
    bound = ns.used_bytes() // 2
    start = threading.Barrier(2)
    reports = []

    def one():
        start.wait()
        reports.append(_sweep(ns, bound))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.stopped_by is StoppedBy.DONE for r in reports), reports
    left = ns.assert_consistent()
    assert ns.used_bytes() <= bound and 0 < len(left) < len(entries)


def _cli_env(ns: RemoteNamespace, max_bytes: int) -> dict[str, str]:
    e = ns.server.endpoint
    return {**e.aws_env(), "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
            "SPARKCACHE_REMOTE_BUCKET": e.bucket, "SPARKCACHE_REMOTE_ENDPOINT": e.url,
            "SPARKCACHE_REMOTE_PREFIX": ns.location.prefix, "SPARKCACHE_NAMESPACE": NAMESPACE,
            "SPARKCACHE_REMOTE_MAX_BYTES": str(max_bytes), "SPARKCACHE_REMOTE_TIMEOUT_SECONDS": "2",
            "SPARKCACHE_REMOTE_RETRIES": "0"}


def test_the_cli_plans_with_dry_run_then_applies_and_status_reports(seaweedfs, monkeypatch, tmp_path):
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path / "local")
    a, b, c, d, c_bytes = _filled(ns)
    used = ns.used_bytes()
    env = _cli_env(ns, used - c_bytes)
    status = run_cli("remote-status", env=env)
    assert status.returncode == 0, status.stderr
    assert f"used_bytes={used} max_bytes={used - c_bytes} over_bound=yes entries=4" in status.stdout
    dry = run_cli("remote-gc", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert "dry run (nothing deleted) stopped_by=done" in dry.stdout and "entries_evicted=2" in dry.stdout
    assert ns.used_bytes() == used
    metrics = tmp_path / "remote_gc.prom"
    done = run_cli("remote-gc", "--metrics-file", str(metrics), env=env)
    assert done.returncode == 0, done.stderr
    text = metrics.read_text()
    for name, value in (("last_pass_ok", 1), ("used_bytes", used - c_bytes), ("limit_bytes", used - c_bytes),
                        ("entries", 2), ("evicted_entries", 2), ("freed_bytes", c_bytes), ("requests_left", 0)):
        assert f'vllm:sparkcache_remote_gc_{name}{{namespace="{NAMESPACE}"}} {float(value)}' in text, (name, text)
    assert f"used_bytes {used} -> {used - c_bytes}" in done.stdout and "over_bound=no" in done.stdout
    assert ns.assert_consistent() == sorted([b.entry_id, d.entry_id])
    after = run_cli("remote-status", env=env)
    assert "over_bound=no entries=2" in after.stdout, after.stdout
    for cmd in ("remote-gc", "remote-status"):
        help_text = run_cli(cmd, "--help").stdout
        assert "one place" in help_text.replace("\n", " ") or cmd == "remote-status", help_text
        assert "Exit 0" in help_text


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(uploads=st.lists(st.tuples(st.integers(40, 42), st.sampled_from([1, 4, 8, 16, 17, 24])), min_size=1, max_size=6),
       fetched=st.lists(st.integers(0, 5), max_size=6), share=st.floats(0.0, 1.0))
def test_any_namespace_swept_to_any_bound_is_consistent_and_kept_the_most_recent(
        seaweedfs, monkeypatch, tmp_path_factory, uploads, fetched, share):
    """Entries sharing prefixes (conversations grown), fetched in any order, swept to any
    bound: every entry left reads back whole and its pointers name entries there, the bytes end
    at or under the bound, and no entry evicted was accessed later than one kept."""
    ns = RemoteNamespace(seaweedfs, monkeypatch, tmp_path_factory.mktemp("local"))
    entries = [ns.upload(conv, n) for conv, n in uploads]
    for i in fetched:
        if i < len(entries):
            ns.access(entries[i])
    bucket = SweepRequests(ns.location)
    try:
        last_access = {e.entry_id: e.last_access for e in take_census(bucket, NAMESPACE).entries}
    finally:
        bucket.close()
    bound = max(1, int(ns.used_bytes() * share))  # 0 would be no bound
    report = _sweep(ns, bound)
    assert report.stopped_by is StoppedBy.DONE, report
    left = ns.assert_consistent()
    assert ns.used_bytes() <= bound or not left, (ns.used_bytes(), bound, left)
    gone = set(last_access) - set(left)
    assert max((last_access[e] for e in gone), default=0) <= min((last_access[e] for e in left), default=float("inf"))


def test_the_tiers_own_uploads_and_fetches_then_a_pass_leave_every_fetch_a_hit_or_a_miss(
        seaweedfs, monkeypatch, tmp_path):
    """With the tier itself (remote_tier): store a uploads x1 (20 blocks), x2 (x1 grown to 40,
    its pages shared) and y; store b fetches x2. Over the bound, x1 (never fetched: it frees
    nothing, x2 holds its pages) and y go. A third store then fetches y: a miss; x1's prompt: a
    hit through x2, since x1's pointers were re-pointed to it; the tier's bucket check is clean."""
    a, b = two_stores(tmp_path)
    c = open_store(tmp_path / "c")
    prefix = fresh_prefix()
    up, mid, down = (tier_of(seaweedfs, monkeypatch, store, prefix) for store in (a, b, c))
    try:
        keys = [f"{i:08x}{'cd' * 12}" for i in range(1, 41)]
        pages = random_pages(10, 3000)
        other = [f"{i:08x}{'ef' * 12}" for i in range(1, 9)]
        x1 = a.publish(IDENT, keys[:20], pages[:5]).entry_id
        assert up.upload(x1) and up.uploads.wait_idle(60), up.uploads.last_error
        x2 = a.publish(IDENT, keys, pages).entry_id  # supersedes x1 locally: uploaded before
        assert up.upload(x2) and up.uploads.wait_idle(60), up.uploads.last_error
        tick()
        y = a.publish(IDENT, other, random_pages(2, 3000)).entry_id
        assert up.upload(y) and up.uploads.wait_idle(60), up.uploads.last_error
        tick()
        assert mid.fetch(IDENT, keys).hit
        assert mid.fetcher.marks_sent(10)  # x2 is the most recently accessed (its mark is PUT after the fetch)
        location = S3Location(seaweedfs.endpoint.bucket, prefix, seaweedfs.endpoint.url)
        used = sum(size for key, size in remote_keys_of(seaweedfs, prefix).items() if "/objects/" in key)
        report = sweep(location, "default", used - 2 * 3000, GRACE_S)
        assert report.stopped_by is StoppedBy.DONE and report.entries_evicted == 2, report
        assert report.pointers_repointed == 2 and report.used_bytes_after == used - 2 * 3000, report
        assert down.fetch(IDENT, other).reason is FetchReason.NOT_FOUND
        got = down.fetch(IDENT, keys[:20])
        assert got.hit and got.entry_id == x2 and got.blocks == 20, got
        assert up.check().clean and up.check().entries == 1
    finally:
        for tier in (up, mid, down):
            tier.close()


def test_a_unit_s_ranks_share_their_objects_and_evicting_one_rank_s_shard_keeps_what_the_other_names(
        seaweedfs, monkeypatch, tmp_path):
    """Rank 0's and rank 1's shards of one prompt share two pages and differ in the third (the
    shared tier keeps a unit's objects once, under rank 0's identity: remote_keys). Over the
    bound by the third page, rank 0's shard (never fetched) goes and frees only its own page;
    rank 1's is fetched whole after, and the census counts each shared page once."""
    a, b = two_stores(tmp_path)
    rank1 = dataclasses.replace(IDENT, tp_rank=1)
    prefix = fresh_prefix()
    up, down = (tier_of(seaweedfs, monkeypatch, store, prefix) for store in (a, b))
    try:
        keys = [f"{i:08x}{'a1' * 12}" for i in range(1, 13)]
        shared, own0, own1 = random_pages(2, 3000), random_pages(1, 3000), random_pages(1, 2000)
        e0 = a.publish(IDENT, keys, shared + own0).entry_id
        e1 = a.publish(rank1, keys, shared + own1).entry_id
        for entry_id in (e0, e1):
            assert up.upload(entry_id) and up.uploads.wait_idle(60), up.uploads.last_error
        tick()
        assert down.fetch(rank1, keys).hit and down.fetcher.marks_sent(10)  # rank 1's is the newer
        location = S3Location(seaweedfs.endpoint.bucket, prefix, seaweedfs.endpoint.url)
        used = sum(size for key, size in remote_keys_of(seaweedfs, prefix).items() if "/objects/" in key)
        assert used == 3 * 3000 + 2000
        requests = SweepRequests(location)
        try:
            census = take_census(requests, "default")
        finally:
            requests.close()
        assert census.used_bytes == used and len(census.entries) == 2 and census.complete
        report = sweep(location, "default", used - 1, GRACE_S)
        assert report.stopped_by is StoppedBy.DONE and report.entries_evicted == 1, report
        assert report.bytes_freed == 3000 and report.used_bytes_after == used - 3000, report
        fresh = open_store(tmp_path / "c")
        again = tier_of(seaweedfs, monkeypatch, fresh, prefix)
        try:
            assert again.fetch(IDENT, keys).reason is FetchReason.NOT_FOUND
            got = again.fetch(rank1, keys)
            assert got.hit and got.entry_id == e1, got
            assert fresh.read_pages(list(fresh.entry(e1).manifest.objects)) == shared + own1
        finally:
            again.close()
        report = up.check()
        assert report.clean and report.entries == 1, report
    finally:
        up.close()
        down.close()


class _UploadWhileListing(SweepRequests):
    """The sweeper's requests, with ``action`` run once right after the listing of ``prefix``
    (an upload that lands between two of the census's listings, on the real server)."""

    def __init__(self, location: S3Location, prefix: str, action) -> None:
        super().__init__(location)
        self.prefix, self.action = prefix, action

    def list(self, prefix: str):
        listed = super().list(prefix)
        if prefix == self.prefix and self.action is not None:
            self.action, action = None, self.action
            action()
        return listed


def test_a_rank_s_upload_landing_between_the_census_s_listings_is_not_taken_for_an_incomplete_entry(
        seaweedfs, monkeypatch, tmp_path):
    """Rank 1's shard is uploaded (a new object under the unit's prefix, then its manifest under
    its own) right after the census listed the unit's objects. Every manifest is listed before
    any object, so the census either has rank 1's manifest with its object or neither: nothing
    is incomplete and a pass deletes nothing. (Listing each identity's manifests then its objects
    in turn, with the unit's folder first, took rank 1's entry for incomplete and dropped it.)"""
    rank0 = next(i for i in (Identity(f"m{k}", "bf16:L2", 16, 0, "lock") for k in range(64))
                 if i.digest() < dataclasses.replace(i, tp_rank=1).digest())  # the unit's folder listed first
    rank1 = dataclasses.replace(rank0, tp_rank=1)
    a = open_store(tmp_path / "a")
    prefix = fresh_prefix()
    up = tier_of(seaweedfs, monkeypatch, a, prefix)
    location = S3Location(seaweedfs.endpoint.bucket, prefix, seaweedfs.endpoint.url)
    try:
        keys = [f"{i:08x}{'b2' * 12}" for i in range(1, 9)]
        shared = random_pages(1, 3000)
        e0 = a.publish(rank0, keys, shared + random_pages(1, 3000)).entry_id
        e1 = a.publish(rank1, keys, shared + random_pages(1, 2000)).entry_id
        earlier = a.publish(rank1, [f"{i:08x}{'c3' * 12}" for i in range(1, 5)], random_pages(1, 1000)).entry_id
        for entry_id in (e0, earlier):  # rank 1's prefix is there when the census starts
            assert up.upload(entry_id) and up.uploads.wait_idle(60), up.uploads.last_error

        def upload_rank1() -> None:
            assert up.upload(e1) and up.uploads.wait_idle(60), up.uploads.last_error

        units = RemoteKeys.of(prefix, "default", rank0)
        requests = _UploadWhileListing(location, units.kind_prefix(KeyKind.OBJECT), upload_rank1)
        try:
            census = take_census(requests, "default")
            assert requests.action is None  # the upload ran between the listings
            plan = plan_sweep(requests, census, 1 << 30, GRACE_S)
        finally:
            requests.close()
        assert census.complete and {e.entry_id for e in census.entries} == {e0, earlier}, census.entries
        assert not plan.evictions and not plan.orphans, plan
        report = sweep(location, "default", 1 << 30, GRACE_S)
        assert report.entries_evicted == 0 and report.stopped_by is StoppedBy.DONE, report
        assert up.check().clean and up.check().entries == 3
    finally:
        up.close()
