"""The scheduler's fetches from the shared tier after a local miss, off vLLM's scheduler thread.

``SchedulerSide.get_num_new_matched_tokens`` asks ``poll(req_id, keys)`` when the local store
offers fewer blocks than the prompt could use. The first ask starts one fetch per rank's shard
(``RemoteTier.fetch``, each under its rank's identity, in parallel on this module's threads)
and answers None: the scheduler then returns None to vLLM, which skips the request this step
and asks again the next. Later asks answer None while a rank's fetch runs, then the unit's
outcome (``UnitFetch``), once: a hit only when every rank's shard was fetched (or held locally
already), since vLLM restores all ranks or none. The scheduler then looks the prompt up locally
again and offers what is local now. However a fetch goes, it ends within
``SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS`` (the tier's bound); a fetch asked about past that
bound and a grace is given up here too, as a miss, so a request never waits past it.

``wait(timeout_s)`` blocks until a rank's fetch still running ends, at most ``timeout_s``: what
the scheduler does at the end of a step that scheduled nothing (``scheduler_side``), rather than
have vLLM step again straight away.

One fetch per request: a request that had its outcome is not fetched again (``forget`` at its
end). Negative answers are cached by the tier (``SPARKCACHE_REMOTE_NEGATIVE_CACHE_SECONDS``).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkcache.store.remote_counts import FetchReason
from sparkcache.store.remote_fetch import FetchResult

if TYPE_CHECKING:
    from sparkcache.store import Identity
    from sparkcache.store.remote_tier import RemoteTier

GRACE_S = 0.5  # past the deadline, how much longer a rank's fetch is waited for before giving up
MAX_WAITERS = 16  # threads that wait on the tier's fetches (rank fetches queue behind them)


@dataclass(frozen=True)
class UnitFetch:
    """How one request's fetch of every rank's shard ended: ``entry_ids`` per rank (None where
    a rank missed), ``reasons`` per rank, ``blocks`` the blocks every rank's fetched entry holds
    of the prompt (0 unless every rank hit)."""

    entry_ids: tuple[str | None, ...]
    reasons: tuple[FetchReason, ...]
    blocks: int
    bytes_fetched: int
    duration_s: float

    @property
    def hit(self) -> bool:
        return all(r is FetchReason.HIT for r in self.reasons)


@dataclass
class _Running:
    futures: tuple[Future, ...]
    started: float


class RemoteFetches:
    """The fetches of the scheduler's requests (the module docstring). ``tiers`` and
    ``identities`` are per rank (the same tier for ranks that share a store)."""

    def __init__(self, tiers: tuple[RemoteTier, ...], identities: tuple[Identity, ...], deadline_s: float,
                 clock=time.monotonic) -> None:
        if len(tiers) != len(identities):
            raise ValueError(f"{len(tiers)} tiers for {len(identities)} ranks' identities")
        self.tiers, self.identities, self.deadline_s = tiers, identities, deadline_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(MAX_WAITERS, thread_name_prefix="sparkcache-remote")
        self._running: dict[str, _Running] = {}
        self._done: set[str] = set()  # requests whose outcome was given: not fetched again
        self.idle_waits = 0  # calls of ``wait`` (how often the scheduler held a step for a fetch)

    def pending(self) -> bool:
        return bool(self._running)

    def poll(self, req_id: str, keys: list[str]) -> UnitFetch | None:
        """None while ``req_id``'s fetch runs (started by this call when there is none); its
        outcome once, when it ended (then ``is_done``: the caller asks no more)."""
        running = self._running.get(req_id)
        now = self._clock()
        if running is None:
            futures = tuple(self._pool.submit(tier.fetch, identity, list(keys))
                            for tier, identity in zip(self.tiers, self.identities))
            self._running[req_id] = _Running(futures, now)
            return None
        late = now - running.started > self.deadline_s + GRACE_S
        if not late and not all(f.done() for f in running.futures):
            return None
        del self._running[req_id]
        self._done.add(req_id)
        return self._outcome(running, now)

    def wait(self, timeout_s: float) -> None:
        """Until a rank's fetch still running ends, or ``timeout_s`` passed (at once when none
        runs). Fetches that ended are left out: one rank's shard fetched while another's runs
        must not end every wait at once."""
        running = [f for fetch in self._running.values() for f in fetch.futures if not f.done()]
        if running:
            self.idle_waits += 1
            wait(running, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _outcome(self, running: _Running, now: float) -> UnitFetch:
        results = [f.result() if f.done() and f.exception() is None else
                   FetchResult(FetchReason.DEADLINE, detail="given up past the deadline")
                   for f in running.futures]
        hit = all(r.hit for r in results)
        return UnitFetch(tuple(r.entry_id if r.hit else None for r in results), tuple(r.reason for r in results),
                         min(r.blocks for r in results) if hit else 0, sum(r.bytes_fetched for r in results),
                         now - running.started)

    def running(self, req_id: str) -> bool:
        """Whether ``req_id``'s fetch was started and its outcome not given yet (the caller polls
        it whatever the local store says now: the fetch may have written the entry already)."""
        return req_id in self._running

    def is_done(self, req_id: str) -> bool:
        return req_id in self._done

    def forget(self, req_id: str) -> None:
        """The request ended: its fetch, if one runs, ends by itself (its result unused)."""
        self._running.pop(req_id, None)
        self._done.discard(req_id)

    def drain_counts(self) -> dict[str, int]:
        """The tiers' counts since the last drain (each tier once, however many ranks share it)."""
        out: dict[str, int] = {}
        for tier in dict.fromkeys(self.tiers):
            for key, n in tier.counts.drain().items():
                out[key] = out.get(key, 0) + n
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for tier in dict.fromkeys(self.tiers):
            tier.close(timeout_s=0.0)
