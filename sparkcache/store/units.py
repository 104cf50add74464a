"""The shards that tensor-parallel ranks publish of one entry, seen as one unit.

Every rank of a tensor-parallel engine stores its own shard (its heads) of an entry, under
an identity that differs only in ``tp_rank``; vLLM restores all ranks or none, so a shard
without its siblings can never be restored. Maintenance plans and evicts a unit as one
(``shard_units``); the connector's scheduler removes the shards of a unit that one rank
failed to publish (``SchedulerSide``), and ``incomplete_units`` is the invariant both keep.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Iterable

from .index import IndexedEntry


@dataclass(frozen=True)
class IncompleteUnit:
    """One entry's shards on fewer ranks than the engine has."""
    block_count: int
    last_block_key: str
    ranks: tuple[int, ...]       # the tp ranks whose shard is stored
    entry_ids: tuple[str, ...]


def shard_units(entries: Iterable[IndexedEntry]) -> dict[str, list[IndexedEntry]]:
    """Entry id -> the unit it belongs to: every entry of the same blocks whose identity
    differs only in ``tp_rank`` (the shards that tensor-parallel ranks publish of one entry),
    itself included."""
    rank0: dict = {}  # identity -> its digest at tp_rank 0 (few identities, many entries)
    units: dict[tuple[str, str, int], list[IndexedEntry]] = collections.defaultdict(list)
    for e in entries:
        identity = e.manifest.identity
        if identity not in rank0:
            rank0[identity] = dataclasses.replace(identity, tp_rank=0).digest()
        units[(rank0[identity], e.manifest.block_keys[-1], e.manifest.block_count)].append(e)
    return {e.entry_id: unit for unit in units.values() for e in unit}


def incomplete_units(entries: Iterable[IndexedEntry], ranks: int) -> list[IncompleteUnit]:
    """The units of ``entries`` (the shards a ``ranks``-way tensor-parallel engine wrote,
    from one shared root or from every rank's own) that lack some rank's shard."""
    seen: dict[int, list[IndexedEntry]] = {}
    for unit in shard_units(entries).values():
        seen[id(unit)] = unit
    out = []
    for unit in seen.values():
        present = tuple(sorted({e.manifest.identity.tp_rank for e in unit}))
        if len(present) < ranks:
            m = unit[0].manifest
            out.append(IncompleteUnit(m.block_count, m.block_keys[-1], present,
                                      tuple(sorted(e.entry_id for e in unit))))
    return sorted(out, key=lambda u: (u.block_count, u.last_block_key))
