"""Whole units on the scheduler: an entry of an engine with several ranks is a unit of shards,
one per rank (``identity.shard_identities``), restorable only while every rank holds its
shard. A shard without its siblings can never be restored and makes the next capture skip the
ranks that hold it, so it is removed:

- when every rank reported a request's captures settled (``settled``): the entries some ranks
  published and another did not (a refused publication: over the cap, a full disk);
- every ``UNIT_RECONCILE_S`` while the engine steps (``tick``, from ``build_meta``): whatever
  left them (each rank's own maintenance when every rank has its own root, an engine stopped
  between its ranks' publications), once older than ``UNIT_GRACE_S``.

Never a unit a capture this scheduler still waits for (``planned`` .. ``settled``/``dropped``):
its other shards may be being written. A removal that finds the store's lock held or a reader's
pin is retried every ``LONE_RETRY_S`` for up to ``UNIT_GRACE_S`` (``pending`` keeps vLLM
stepping meanwhile); after that the next reconciliation finds it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterable

from sparkcache.store.identity import entry_id_for
from sparkcache.store.units import incomplete_units

if TYPE_CHECKING:
    from sparkcache.store import Identity, PageStore

    from .scheduler_side import SchedulerCounters

logger = logging.getLogger("sparkcache.connector")

# A unit some of whose shards are younger than this may still be being written by its other
# ranks (a publication takes well under it); ``reconcile`` leaves it alone.
UNIT_GRACE_S = 10.0
UNIT_RECONCILE_S = 60.0  # how often the scheduler looks for shards without their siblings
LONE_RETRY_S = 0.05  # how often a lone shard's removal that found the store's lock held is retried


class ShardUnits:
    def __init__(self, identities: tuple[Identity, ...], stores: tuple[PageStore, ...],
                 counters: SchedulerCounters) -> None:
        self.identities = identities
        self.stores = stores
        self.counters = counters
        self._digests = tuple(i.digest() for i in identities)
        self.capture_ends: dict[str, list[str]] = {}  # req_id -> last keys of its unsettled captures
        # (rank, entry id) -> until when: lone shards whose removal found the store's lock held
        self.lone_pending: dict[tuple[int, str], float] = {}
        self._next_reconcile = 0.0
        self._next_lone_retry = 0.0

    def planned(self, req_id: str, last_key: str) -> None:
        self.capture_ends.setdefault(req_id, []).append(last_key)

    def dropped(self, req_id: str) -> None:
        """A request's captures will not be reported (their report is lost): not waited for."""
        self.capture_ends.pop(req_id, None)

    def _in_flight(self) -> set[str]:
        return {k for ends in self.capture_ends.values() for k in ends}

    def settled(self, req_id: str) -> None:
        """Every rank reported ``req_id``'s captures: remove the shards of the entries some
        ranks published and another did not, unless another request's capture of the same
        entry is still in flight (it may be writing the missing shard)."""
        last_keys = set(self.capture_ends.pop(req_id, ())) - self._in_flight()
        lone = []
        for last in last_keys:
            ids = [entry_id_for(d, last) for d in self._digests]
            held = [self.stores[r].entry(e) is not None for r, e in enumerate(ids)]
            if any(held) and not all(held):
                lone += [(r, e) for r, e in enumerate(ids) if held[r]]
        if lone:
            self._remove(lone)

    def tick(self, now: float | None = None) -> None:
        """Per engine step: the periodic reconciliation (O(entries): once a minute, never per
        step) and the retries of removals that found a lock held."""
        now = time.monotonic() if now is None else now
        if now >= self._next_reconcile:
            self._next_reconcile = now + UNIT_RECONCILE_S
            self.reconcile()
        if self.lone_pending and now >= self._next_lone_retry:
            self._next_lone_retry = now + LONE_RETRY_S
            self._remove(list(self.lone_pending))

    def reconcile(self, now: float | None = None) -> None:
        """Remove this engine's entries that some rank's store holds and another's does not:
        published more than ``UNIT_GRACE_S`` ago (``now``: wall-clock seconds, as manifests
        record their creation) and not a capture this scheduler still waits for."""
        now = time.time() if now is None else now
        in_flight = self._in_flight()
        ours = set(self.identities)
        entries = {e.entry_id: e for store in dict.fromkeys(self.stores) for e in store.entries()
                   if e.manifest.identity in ours}
        lone = []
        for unit in incomplete_units(entries.values(), len(self.identities)):
            shards = [entries[i] for i in unit.entry_ids]
            if (unit.last_block_key not in in_flight
                    and now - max(e.manifest.created_at for e in shards) >= UNIT_GRACE_S):
                lone += [(e.manifest.identity.tp_rank, e.entry_id) for e in shards]
        if lone:
            self._remove(lone)

    def _remove(self, shards: Iterable[tuple[int, str]]) -> None:
        """Remove (rank, entry id) shards, one batch per store; what a store cannot remove now
        is retried (module docstring)."""
        by_store: dict[PageStore, list[tuple[int, str]]] = {}
        for shard in shards:
            by_store.setdefault(self.stores[shard[0]], []).append(shard)
        until = time.monotonic() + UNIT_GRACE_S
        for store, batch in by_store.items():
            removed = set(store.discard([entry_id for _, entry_id in batch]))
            self.counters.add("lone_shards_removed", len(removed))
            for shard in batch:
                if shard[1] in removed or store.entry(shard[1]) is None:
                    self.lone_pending.pop(shard, None)
                else:
                    self.lone_pending.setdefault(shard, until)

    def pending(self, now: float) -> bool:
        """Whether a lone shard's removal is still being retried (``now``: monotonic); a lock
        that is never let go must not keep the engine busy forever."""
        for shard, until in list(self.lone_pending.items()):
            if now > until:
                logger.warning("sparkcache: could not remove rank %d's shard %s for %.0f s (the "
                               "store's lock held, or a reader pins it); the next reconciliation "
                               "will", shard[0], shard[1], UNIT_GRACE_S)
                del self.lone_pending[shard]
        return bool(self.lone_pending)
