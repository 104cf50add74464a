"""The scheduler's fetches from the shared tier (``connector/remote_fetches.py``) on tiers that
answer when a test lets them: None while a rank's fetch runs, the unit's outcome once, a hit only
when every rank's shard was fetched, given up past the deadline, one fetch per request. (The
whole path, on the engine and SeaweedFS: ``test_engine_remote.py``.)"""

from __future__ import annotations

import threading
import time

from sparkcache.connector.remote_fetches import GRACE_S, RemoteFetches
from sparkcache.store import Identity
from sparkcache.store.remote_counts import FETCH_HITS, FetchReason, RemoteCounts
from sparkcache.store.remote_fetch import FetchResult

RANKS = tuple(Identity("m", "w", 32, rank, "lock") for rank in (0, 1))


class GatedTier:
    """A tier whose fetch of each identity returns ``answers[rank]`` once ``gate`` is set."""

    def __init__(self, answers: dict[int, FetchResult]) -> None:
        self.answers, self.gate, self.counts, self.asked = answers, threading.Event(), RemoteCounts(), []
        self.closed = False

    def fetch(self, identity: Identity, keys: list[str]) -> FetchResult:
        self.asked.append((identity.tp_rank, tuple(keys)))
        self.gate.wait(10)
        self.counts.add(FETCH_HITS)
        return self.answers[identity.tp_rank]

    def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True


def _hit(entry: str, blocks: int = 4) -> FetchResult:
    return FetchResult(FetchReason.HIT, entry, blocks, 100)


def _until_done(fetches: RemoteFetches, req: str, keys: list[str]):
    for _ in range(2000):
        out = fetches.poll(req, keys)
        if out is not None:
            return out
        threading.Event().wait(0.005)
    raise AssertionError("the fetch never ended")


def test_none_while_running_then_the_outcome_once_and_no_second_fetch():
    tier = GatedTier({0: _hit("e0"), 1: _hit("e1", 3)})
    fetches = RemoteFetches((tier, tier), RANKS, deadline_s=5.0)
    assert fetches.poll("r", ["k1", "k2"]) is None and fetches.running("r")
    assert fetches.poll("r", ["k1", "k2"]) is None
    tier.gate.set()
    out = _until_done(fetches, "r", ["k1", "k2"])
    assert out.hit and out.entry_ids == ("e0", "e1") and out.blocks == 3 and out.bytes_fetched == 200
    assert fetches.is_done("r") and not fetches.running("r") and not fetches.pending()
    assert sorted(tier.asked) == [(0, ("k1", "k2")), (1, ("k1", "k2"))]  # every rank's shard, once
    assert fetches.drain_counts() == {FETCH_HITS: 2}  # a tier shared by two ranks drained once
    fetches.forget("r")
    assert not fetches.is_done("r")
    fetches.close()
    assert tier.closed


def test_a_rank_that_misses_makes_the_unit_a_miss():
    tier = GatedTier({0: _hit("e0"), 1: FetchResult(FetchReason.NOT_FOUND)})
    tier.gate.set()
    fetches = RemoteFetches((tier, tier), RANKS, deadline_s=5.0)
    assert fetches.poll("r", ["k"]) is None
    out = _until_done(fetches, "r", ["k"])
    assert not out.hit and out.entry_ids == ("e0", None) and out.blocks == 0
    assert out.reasons == (FetchReason.HIT, FetchReason.NOT_FOUND)
    fetches.close()


def test_a_fetch_past_its_deadline_is_given_up_as_a_miss():
    now = [0.0]
    tier = GatedTier({0: _hit("e0"), 1: _hit("e1")})  # never let through
    fetches = RemoteFetches((tier, tier), RANKS, deadline_s=1.0, clock=lambda: now[0])
    assert fetches.poll("r", ["k"]) is None
    now[0] = 1.0 + GRACE_S / 2
    assert fetches.poll("r", ["k"]) is None
    now[0] = 1.0 + GRACE_S * 2
    out = fetches.poll("r", ["k"])
    assert out is not None and not out.hit and set(out.reasons) == {FetchReason.DEADLINE}
    tier.gate.set()
    fetches.close()


def test_a_wait_lasts_while_a_rank_s_fetch_runs_though_another_rank_s_ended():
    """``wait`` (an idle step's) ends when a running fetch ends: one rank's shard fetched while
    the other's still runs must not end every wait at once (the idle engine would spin again)."""
    done, gated = GatedTier({0: _hit("e0")}), GatedTier({1: _hit("e1")})
    done.gate.set()
    fetches = RemoteFetches((done, gated), RANKS, deadline_s=30.0)
    assert fetches.poll("r", ["k"]) is None
    assert fetches.poll("other", ["k"]) is None
    until = time.monotonic() + 10
    while len(done.asked) < 2 and time.monotonic() < until:
        time.sleep(0.01)
    time.sleep(0.05)  # rank 0's fetches have returned
    started = time.monotonic()
    fetches.wait(0.3)
    assert time.monotonic() - started >= 0.25
    gated.gate.set()
    started = time.monotonic()
    while fetches.running("r") and time.monotonic() - started < 10:
        fetches.wait(5.0)
        fetches.poll("r", ["k"])
    assert not fetches.running("r") and time.monotonic() - started < 5  # a wait ends with the fetch
    fetches.close()
