"""The shared tier when its S3 server dies (SIGKILL) or hangs (SIGSTOP), on a SeaweedFS of the
test's own: an upload cut short leaves the local store as it was and no manifest in the bucket
whose objects are incomplete or wrong, counts its failure, and completes once the server is
back; a fetch cut short, or against a hung server, is a miss within its deadline that writes
nothing locally."""

from __future__ import annotations

import os
import signal
import time

import pytest

from remote_helpers import KillingLocal, fresh_prefix, remote_keys_of, tier_of
from sparkcache.store import PageStore
from sparkcache.store.remote_counts import UPLOAD_FAILURES, UPLOADS_DONE, FetchReason
from store_helpers import IDENT, open_store
from testing.seaweedfs import SeaweedFS

KEYS = [f"{i:06x}{'cd' * 13}" for i in range(400)]  # 100 pages of 4 blocks: more than one round of PUTs
PAGE_BYTES = 2000


def _publish(store: PageStore) -> str:
    result = store.publish(IDENT, KEYS, [os.urandom(PAGE_BYTES) for _ in range(len(KEYS) // 4)])
    assert result.ok, result
    return result.entry_id


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("retry", ["when_told", "by_itself"])
def test_a_server_killed_during_an_upload_leaves_no_broken_entry_and_the_upload_completes_after(
        tmp_path, monkeypatch, retry):
    """``when_told``: the retry waits for ``retry_now``, so the bucket is looked at between the
    cut and the retry; ``by_itself``: the backoff's retry completes the upload once the server is
    back (the bucket check, whenever it runs, finds no broken entry)."""
    with SeaweedFS(tmp_path / "s3") as server:
        a = open_store(tmp_path / "a")
        entry_id = _publish(a)
        # the 80th object read is after the first round of PUTs (64 objects) and before the last
        local = KillingLocal(a, "read_pages", 80, server.kill)
        prefix = fresh_prefix()
        backoff = 3600 if retry == "when_told" else 0.2
        tier = tier_of(server, monkeypatch, local, prefix, timeout_s=2.0, connect_timeout_s=0.5, retries=0,
                       retry_first_s=backoff, retry_max_s=backoff)
        try:
            assert tier.upload(entry_id)
            _wait(lambda: tier.counts.peek().get(UPLOAD_FAILURES, 0) >= 1, 30, "the upload's failure counted")
            assert UPLOADS_DONE not in tier.counts.peek()
            assert PageStore.verify_root(str(tmp_path / "a")).ok
            server.start()
            report = tier.check()
            assert report.clean, report
            if retry == "when_told":
                assert report.entries == 0, report  # objects without a manifest: no entry
                placed = [k for k in remote_keys_of(server, prefix) if "/objects/" in k]
                assert 0 < len(placed) < len(KEYS) // 4, placed  # the cut fell inside the upload
                tier.uploads.retry_now()
            assert tier.uploads.wait_idle(60), tier.uploads.last_error
            report = tier.check()
            assert report.clean and report.entries == 1 and report.objects == len(KEYS) // 4, report
            assert tier.counts.peek()[UPLOADS_DONE] == 1
            assert PageStore.verify_root(str(tmp_path / "a")).ok
        finally:
            tier.close()


def test_a_fetch_from_a_killed_or_hung_server_is_a_miss_within_its_deadline(tmp_path, monkeypatch):
    deadline_s = 2.0
    with SeaweedFS(tmp_path / "s3") as server:
        a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
        prefix = fresh_prefix()
        up = tier_of(server, monkeypatch, a, prefix)
        # killed after the manifest was read, before the objects are
        local = KillingLocal(b, "entry", 1, server.kill)
        down = tier_of(server, monkeypatch, local, prefix, deadline_s=deadline_s, retries=0)
        try:
            entry_id = _publish(a)
            assert up.upload(entry_id) and up.uploads.wait_idle(60), up.uploads.last_error
            for cut in ("killed", "stopped"):
                started = time.monotonic()
                result = down.fetch(IDENT, KEYS)
                took = time.monotonic() - started
                assert not result.hit and took < deadline_s + 1.0, (cut, result, took)
                expected = FetchReason.IO_ERROR if cut == "killed" else FetchReason.DEADLINE
                assert result.reason is expected, (cut, result)
                assert b.entries() == [] and PageStore.verify_root(str(tmp_path / "b")).ok
                if cut == "killed":
                    server.start()
                    os.kill(server.proc.pid, signal.SIGSTOP)
            os.kill(server.proc.pid, signal.SIGCONT)
            time.sleep(deadline_s)  # the abandoned worker's requests end at their bound
            assert b.entries() == [] and PageStore.verify_root(str(tmp_path / "b")).ok
            assert down.fetch(IDENT, KEYS).hit
        finally:
            if server.running():
                os.kill(server.proc.pid, signal.SIGCONT)
            up.close()
            down.close()
