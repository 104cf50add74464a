"""The shared tier's pieces that need no server: the upload queue (its bound in bytes, the entries
it drops and why, the retry of a failed upload after its backoff), the pointer bisection against
random sets of pointers present, the counts and their metric declarations."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkcache.metrics import COUNTER_KEYS
from sparkcache.store.remote_counts import (COUNT_KEYS, SKIP_KEYS, UPLOAD_FAILURES, UPLOADS_DONE, RemoteCounts,
                                            UploadSkip)
from sparkcache.store.remote_push import EntryGone, Pushed
from sparkcache.store.remote_upload import UploadJob, UploadQueue
from sparkcache.store.strides import STRIDE, deepest_indexed, deepest_indexed_rounds, indexed_positions


def _job(n: int, nbytes: int = 100, idd: str = "0" * 32) -> UploadJob:
    return UploadJob(f"{n:040x}", idd, f"k{n}", nbytes)


class _Remote:
    """What the queue's push does, scripted: entries gone, tries that fail, a gate to hold one."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.failures = 0
        self.pushed: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def push(self, entry_id: str) -> Pushed:
        self.gate.wait(10)
        if entry_id in self.gone:
            raise EntryGone(entry_id)
        if self.failures:
            self.failures -= 1
            raise OSError(111, "refused")
        self.pushed.append(entry_id)
        return Pushed(entry_id, 1, 0, 10, True, 1)


def test_the_queue_skips_past_its_bound_drops_the_gone_and_the_superseded():
    remote, counts = _Remote(), RemoteCounts()
    queue = UploadQueue(remote.push, counts, max_bytes=250)
    try:
        remote.gate.clear()  # the first entry's upload waits: the others queue behind it
        assert queue.submit(_job(1), ("k1",))
        assert queue.submit(_job(2), ("k2",))
        assert not queue.submit(_job(3, nbytes=100), ("k3",))  # 300 > 250
        assert queue.submit(_job(4), ("k2", "k4"))  # takes the place of 2, a prefix of it
        remote.gone.add(_job(4).entry_id)
        remote.gate.set()
        assert queue.wait_idle(10)
        assert remote.pushed == [_job(1).entry_id]
        assert counts.peek() == {UPLOADS_DONE: 1, SKIP_KEYS[UploadSkip.QUEUE_FULL]: 1,
                                 SKIP_KEYS[UploadSkip.SUPERSEDED]: 1, SKIP_KEYS[UploadSkip.EVICTED]: 1,
                                 "remote_upload_bytes": 10}
        assert queue.pending_bytes == 0
    finally:
        queue.close()


def test_a_failed_upload_is_tried_again_after_its_backoff_and_the_rest_wait_behind_it():
    remote, counts = _Remote(), RemoteCounts()
    remote.failures = 3
    queue = UploadQueue(remote.push, counts, max_bytes=1 << 20, retry_first_s=0.01, retry_max_s=0.05)
    try:
        for n in range(3):
            assert queue.submit(_job(n), (f"k{n}",))
        assert queue.wait_idle(10)
        assert remote.pushed == [_job(n).entry_id for n in range(3)]
        assert counts.peek()[UPLOAD_FAILURES] == 3 and counts.peek()[UPLOADS_DONE] == 3
    finally:
        queue.close()


def test_a_hybrid_entry_is_never_superseded_and_an_entry_no_retry_helps_is_dropped():
    remote, counts = _Remote(), RemoteCounts()
    refused = _job(9).entry_id

    def push(entry_id: str) -> Pushed:
        if entry_id == refused:
            raise ValueError("an object larger than one PUT carries")
        return remote.push(entry_id)

    queue = UploadQueue(push, counts, max_bytes=1 << 20)
    try:
        remote.gate.clear()
        assert queue.submit(_job(1), ("k1",))
        hybrid = UploadJob(_job(2).entry_id, "0" * 32, "k2", 100, holds_state=True)
        assert queue.submit(hybrid, ("k2",))
        assert queue.submit(_job(3), ("k2", "k3"))  # holds k2: a plain entry there would be superseded
        assert queue.submit(_job(9), ("k9",))
        remote.gate.set()
        assert queue.wait_idle(10)
        assert remote.pushed == [_job(n).entry_id for n in (1, 2, 3)]
        assert SKIP_KEYS[UploadSkip.SUPERSEDED] not in counts.peek()
        assert counts.peek()[SKIP_KEYS[UploadSkip.REFUSED]] == 1
    finally:
        queue.close()


def test_counts_refuse_an_undeclared_key_and_every_key_is_a_declared_metric():
    counts = RemoteCounts()
    with pytest.raises(ValueError, match="remote_counts.py"):
        counts.add("remote_nonsense")
    counts.add(UPLOADS_DONE, 2)
    assert counts.drain() == {UPLOADS_DONE: 2} and counts.drain() == {}
    assert COUNT_KEYS <= COUNTER_KEYS


@given(st.integers(min_value=1, max_value=40 * STRIDE), st.integers(min_value=0, max_value=60))
def test_the_bisection_finds_the_deepest_pointer_of_a_prefix_closed_set(n, present):
    positions = indexed_positions(n)
    stored = set(positions[:present])  # pointers present up to some depth (chained keys)
    asked = []

    def ask(p):
        asked.append(p)
        return p in stored

    found = deepest_indexed(n, ask)
    assert found == (max(stored) if stored else -1)
    assert len(asked) <= 2 + len(positions).bit_length()  # about log2 of the strides


@given(st.integers(min_value=1, max_value=20 * STRIDE), st.sets(st.integers(min_value=0, max_value=25)))
def test_the_bisection_never_claims_a_pointer_that_is_not_there(n, chosen):
    positions = indexed_positions(n)
    stored = {positions[i] for i in chosen if i < len(positions)}
    found = deepest_indexed(n, lambda p: p in stored)
    assert found == -1 or found in stored


@given(st.integers(min_value=1, max_value=40 * STRIDE), st.integers(min_value=0, max_value=60),
       st.integers(min_value=1, max_value=8))
def test_the_k_ary_search_finds_the_deepest_pointer_in_few_rounds(n, present, k):
    positions = indexed_positions(n)
    stored = set(positions[:present])
    rounds = []

    def ask(ps):
        assert len(ps) <= k and len(set(ps)) == len(ps)
        rounds.append(ps)
        return [p in stored for p in ps]

    found = deepest_indexed_rounds(n, ask, k)
    assert found == (max(stored) if stored else -1)
    if k == 1:
        assert len(rounds) <= 2 + len(positions).bit_length()  # the bisection's
    else:
        assert len(rounds) <= 1 + math.ceil(math.log(len(positions)) / math.log(k + 1))
    if k > 1 and present >= len(positions):
        assert len(rounds) == 1  # a prompt stored whole: found in the first round


@given(st.integers(min_value=1, max_value=20 * STRIDE), st.sets(st.integers(min_value=0, max_value=25)),
       st.integers(min_value=1, max_value=8))
def test_the_k_ary_search_never_claims_a_pointer_that_is_not_there(n, chosen, k):
    positions = indexed_positions(n)
    stored = {positions[i] for i in chosen if i < len(positions)}
    found = deepest_indexed_rounds(n, lambda ps: [p in stored for p in ps], k)
    assert found == -1 or found in stored
