"""The shared tier's capacity bound: one namespace's objects kept under ``SPARKCACHE_REMOTE_MAX_BYTES``
by evicting the entries least recently accessed there, run from one place per namespace
(``python -m sparkcache remote-gc``; docs/REMOTE.md, "Remote capacity", says who and why two at
once are safe).

A pass is a plan (``plan_sweep``, from a ``remote_census.Census``: read-only) then its deletions
(``apply_sweep``). The plan:

- entries whose manifest names an object the bucket lacks (an upload cut short and repaired
  badly, a lost object) are dropped first: a fetch of them could only miss;
- objects no manifest references and older than the grace (``SPARKCACHE_REMOTE_GC_GRACE_SECONDS``,
  by LastModified: an upload in progress PUTs its objects before its manifest) go; younger ones
  stay and are counted;
- while the bytes left are over the bound, the entry least recently accessed (its access mark's
  LastModified, else its manifest's) is evicted, freeing the objects no remaining entry names;
- pointers naming an evicted or missing entry are re-pointed to a remaining entry that holds the
  same block key at an indexed position (so the entries sharing a prefix with it stay findable)
  or deleted; access marks of entries with no manifest, older than the grace, are deleted;
- a pointer younger than the grace that names an entry not there (a second sweeper's race) is
  re-pointed to a remaining holder too;
- a pointer a remaining entry should have and the bucket lacks (an upload cut short between its
  manifest and its pointers, or a pointer deleted while an upload found it present) is PUT
  (``If-None-Match: *``) naming the most recently accessed entry that holds its block key.

Each eviction is applied in the order that keeps a fetch safe: its pointers first (none is left
naming a manifest about to go), then its manifest (no fetch finds the entry from here on), then
its access mark, then its freed objects (no manifest names them any more). A pass stopped at any
point (a crash, a failed request, its budget) leaves no manifest whose objects are gone: what it
left is unreferenced objects and marks, which the next pass removes.

Deletion only on positive knowledge: a census with anything unknown (a listing failed, a manifest
could not be read) plans nothing, and the report says why (``stopped_by=unknown``).
"""

from __future__ import annotations

import enum
import errno
import heapq
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

from .layout import is_entry_id
from .remote_census import Census, Listed, SweepRequests, RemoteEntry, take_census
from .remote_keys import KeyKind
from .s3_location import S3Location


_POINTER_BYTES = 64  # a pointer's body is an entry id; a longer one is not ours


class StoppedBy(enum.Enum):
    """Why a pass ended: ``done`` (all planned), ``budget`` (its request budget: run it again),
    ``unknown`` (the census was not complete: nothing deleted), ``error`` (a request failed
    mid-pass: what was done is safe, the rest is the next pass's)."""

    DONE = "done"
    BUDGET = "budget"
    UNKNOWN = "unknown"
    ERROR = "error"


class Why(enum.Enum):
    """Why an entry is evicted."""

    INCOMPLETE = "incomplete"  # its manifest names an object the bucket lacks
    LRU = "lru"  # the namespace is over its bound and it was the least recently accessed


@dataclass(frozen=True)
class Eviction:
    """One entry's removal: pointers re-pointed (key, the remaining entry now named) or deleted,
    its manifest and access mark, then the objects no remaining entry names."""

    entry: RemoteEntry
    why: Why
    repoint: tuple[tuple[str, str], ...]
    drop_pointers: tuple[str, ...]
    objects: tuple[Listed, ...]

    @property
    def freed_bytes(self) -> int:
        return sum(listed.size for listed in self.objects)

    @property
    def requests(self) -> int:
        return len(self.repoint) + len(self.drop_pointers) + 2 + len(self.objects)


@dataclass(frozen=True)
class SweepPlan:
    """What a pass will delete, and the namespace around it. ``used_bytes_after``: the objects'
    bytes once it is applied."""

    max_bytes: int
    grace_s: float
    used_bytes: int
    entries: int
    evictions: tuple[Eviction, ...] = ()
    orphans: tuple[Listed, ...] = ()
    young_unreferenced: tuple[Listed, ...] = ()
    dangling_pointers: tuple[str, ...] = ()
    stale_access_marks: tuple[str, ...] = ()
    missing_pointers: tuple[tuple[str, str], ...] = ()  # (key, the entry id it will name)
    stale_pointers: tuple[tuple[str, str], ...] = ()  # (key, the remaining entry it will name instead)
    oldest_access: float | None = None
    unknown: tuple[str, ...] = ()

    @property
    def used_bytes_after(self) -> int:
        return self.used_bytes - sum(e.freed_bytes for e in self.evictions) - sum(o.size for o in self.orphans)

    @property
    def requests(self) -> int:
        return (sum(e.requests for e in self.evictions) + len(self.orphans) + len(self.dangling_pointers)
                + len(self.stale_access_marks) + len(self.missing_pointers) + len(self.stale_pointers))


@dataclass(frozen=True)
class SweepProgress:
    """How far a pass is: requests made of those planned, entries evicted, bytes freed."""

    requests_done: int
    requests_planned: int
    entries_evicted: int
    bytes_freed: int


@dataclass(frozen=True)
class SweepReport:
    """What a pass did (with ``dry_run``, what it would do). The fields an operator alerts on:
    ``stopped_by`` (not ``done`` or ``budget``: read ``error``), ``used_bytes_after`` against
    ``max_bytes`` (``over_bound``), ``incomplete_entries``, ``young_unreferenced_bytes``."""

    stopped_by: StoppedBy
    dry_run: bool
    max_bytes: int
    used_bytes_before: int
    used_bytes_after: int
    entries_before: int
    entries_after: int
    entries_evicted: int = 0
    incomplete_entries: int = 0
    objects_deleted: int = 0
    orphans_deleted: int = 0
    bytes_freed: int = 0
    pointers_repointed: int = 0
    pointers_deleted: int = 0
    pointers_restored: int = 0
    access_marks_deleted: int = 0
    young_unreferenced_objects: int = 0
    young_unreferenced_bytes: int = 0
    oldest_access: float | None = None
    requests_done: int = 0
    requests_left: int = 0
    error: str = ""

    @property
    def over_bound(self) -> bool:
        return self.max_bytes > 0 and self.used_bytes_after > self.max_bytes

    @property
    def ok(self) -> bool:
        return self.stopped_by in (StoppedBy.DONE, StoppedBy.BUDGET)


# ---------------------------------------------------------------------------- the plan


def plan_sweep(bucket: SweepRequests, census: Census, max_bytes: int, grace_s: float,
               now: float | None = None) -> SweepPlan:
    """The pass's plan (see the module docstring); reads the bodies of the pointers it may change
    (GETs), deletes nothing. ``now``: seconds since the epoch (default the host's clock; the
    grace must cover the skew between it and the object store's). An ``OSError`` from reading a
    pointer: the plan is empty and ``unknown`` says why."""
    now = time.time() if now is None else now
    base = SweepPlan(max_bytes, grace_s, census.used_bytes, len(census.entries),
                     oldest_access=min((e.last_access for e in census.entries), default=None),
                     unknown=census.unknown)
    if not census.complete:
        return base
    old = lambda listed: listed.modified <= now - grace_s  # noqa: E731
    refs: Counter = Counter()
    for entry in census.entries:
        refs.update(entry.object_names)  # a unit's ranks may name the same objects (remote_keys)
    unreferenced = [listed for named, listed in census.objects.items() if not refs[named]]
    orphans = tuple(listed for listed in unreferenced if old(listed))
    used = census.used_bytes - sum(o.size for o in orphans)
    chosen: list[tuple[RemoteEntry, Why, tuple[Listed, ...]]] = []

    def evict(entry: RemoteEntry, why: Why) -> None:
        nonlocal used
        freed = []
        for named in sorted(entry.object_names):
            refs[named] -= 1
            if not refs[named] and named in census.objects:
                freed.append(census.objects[named])
        used -= sum(listed.size for listed in freed)
        chosen.append((entry, why, tuple(freed)))

    complete, incomplete = [], []
    for entry in census.entries:
        (complete if entry.object_names <= census.objects.keys() else incomplete).append(entry)
    for entry in incomplete:
        evict(entry, Why.INCOMPLETE)
    by_age = [(e.last_access, e.keys.identity_digest, e.entry_id, e) for e in complete]
    heapq.heapify(by_age)
    while max_bytes > 0 and used > max_bytes and by_age:
        evict(heapq.heappop(by_age)[-1], Why.LRU)
    remaining = [item[-1] for item in by_age]
    holders: dict[tuple[str, str], RemoteEntry] = {}  # pointer -> the most recently accessed remaining holder
    for entry in sorted(remaining, key=lambda e: e.last_access):
        holders.update(((entry.keys.identity_digest, name), entry) for name in entry.pointer_names)
    missing = tuple((entry.keys.kind_prefix(KeyKind.POINTER) + named[1], entry.entry_id)
                    for named, entry in sorted(holders.items()) if named not in census.pointers)
    try:
        evictions, dangling, stale_pointers = _pointers(bucket, census, chosen, remaining, holders, old)
    except OSError as exc:
        return replace(base, unknown=(str(exc),))
    kept = {(e.keys.identity_digest, e.entry_id) for e in remaining}
    kept.update((e.keys.identity_digest, e.entry_id) for e, _, _ in chosen)  # their marks go with them
    stale = tuple(listed.key for named, listed in census.access_marks.items() if named not in kept and old(listed))
    return replace(base, evictions=evictions, orphans=orphans,
                   young_unreferenced=tuple(listed for listed in unreferenced if not old(listed)),
                   dangling_pointers=dangling, stale_access_marks=stale, missing_pointers=missing,
                   stale_pointers=stale_pointers,
                   oldest_access=min((e.last_access for e in remaining), default=None))


def _pointers(bucket: SweepRequests, census: Census, chosen: list, remaining: list[RemoteEntry],
              holders: dict[tuple[str, str], RemoteEntry], old: Callable[[Listed], bool]
              ) -> tuple[tuple[Eviction, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The evictions with their pointers (re-pointed to a remaining holder, else deleted); the
    pointers older than the grace that no remaining entry holds and that name no remaining entry;
    the pointers younger than the grace that a remaining entry holds and that name an entry not
    there, with the holder each will name. Reads each such pointer's body."""
    alive = {(e.keys.identity_digest, e.entry_id) for e in remaining}
    asked: dict[tuple[str, str], Listed] = {}
    for entry, _, _ in chosen:
        idd = entry.keys.identity_digest
        asked.update(((idd, n), census.pointers[(idd, n)]) for n in entry.pointer_names if (idd, n) in census.pointers)
    for named, listed in census.pointers.items():
        if (named not in holders) == old(listed):
            asked[named] = listed
    order = list(asked)
    bodies = dict(zip(order, bucket.each(lambda named: _pointer_body(bucket, asked[named].key), order)))

    def stale(named: tuple[str, str]) -> bool:
        body = bodies.get(named)
        if body is None:
            return False  # gone since listed
        text = body.decode("ascii", "replace").strip()
        return is_entry_id(text) and (named[0], text) not in alive

    evictions, handled = [], set()
    for entry, why, freed in chosen:
        idd = entry.keys.identity_digest
        mine = [(idd, n) for n in entry.pointer_names
                if (idd, n) in bodies and (idd, n) not in handled and stale((idd, n))]
        handled.update(mine)
        repoint = tuple((census.pointers[n].key, holders[n].entry_id) for n in mine if n in holders)
        drop = tuple(census.pointers[n].key for n in mine if n not in holders)
        evictions.append(Eviction(entry, why, repoint, drop, freed))
    dangling = tuple(asked[n].key for n in order if n not in handled and n not in holders and stale(n))
    fixes = tuple((asked[n].key, holders[n].entry_id) for n in order
                  if n not in handled and n in holders and stale(n))
    return tuple(evictions), dangling, fixes


def _pointer_body(bucket: SweepRequests, key: str) -> bytes | None:
    """A pointer's body; one longer than an entry id is none of ours (``b""``: left alone)."""
    try:
        return bucket.get(key, _POINTER_BYTES)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            return b""
        raise


# ---------------------------------------------------------------------------- applying it


def apply_sweep(bucket: SweepRequests, plan: SweepPlan, max_requests: int,
                on_progress: Callable[[SweepProgress], None] | None = None) -> SweepReport:
    """Make the plan's requests in the order of the module docstring, stopping once
    ``max_requests`` are made (an eviction begun is finished) or at the first failed request."""
    tally = _Tally(plan.requests)
    report = _empty_report(plan, dry_run=False)
    if plan.unknown:
        return report
    steps: list[tuple[int, Callable[[], None]]] = [(e.requests, lambda e=e: tally.evict(bucket, e))
                                                    for e in plan.evictions]
    steps += [(1, lambda o=o: tally.orphan(bucket, o)) for o in plan.orphans]
    steps += [(1, lambda k=k: tally.pointer(bucket, k)) for k in plan.dangling_pointers]
    steps += [(1, lambda k=k: tally.mark(bucket, k)) for k in plan.stale_access_marks]
    steps += [(1, lambda kv=kv: tally.restore(bucket, kv)) for kv in plan.missing_pointers]
    steps += [(1, lambda kv=kv: tally.repoint(bucket, kv)) for kv in plan.stale_pointers]
    stopped, error = StoppedBy.DONE, ""
    for cost, step in steps:
        if tally.requests and tally.requests + cost > max_requests:
            stopped = StoppedBy.BUDGET
            break
        try:
            step()
        except OSError as exc:
            stopped, error = StoppedBy.ERROR, str(exc)
            break
        if on_progress is not None:
            on_progress(SweepProgress(tally.requests, plan.requests, tally.evicted, tally.freed))
    return replace(report, stopped_by=stopped, error=error, used_bytes_after=plan.used_bytes - tally.freed,
                   entries_after=plan.entries - tally.evicted, entries_evicted=tally.evicted,
                   incomplete_entries=tally.incomplete, objects_deleted=tally.objects,
                   orphans_deleted=tally.orphans, bytes_freed=tally.freed, pointers_repointed=tally.repointed,
                   pointers_deleted=tally.pointers, pointers_restored=tally.restored,
                   access_marks_deleted=tally.marks,
                   requests_done=tally.requests, requests_left=plan.requests - tally.requests)


@dataclass
class _Tally:
    """What ``apply_sweep`` has done so far."""

    planned: int
    requests: int = 0
    evicted: int = 0
    incomplete: int = 0
    objects: int = 0
    orphans: int = 0
    freed: int = 0
    repointed: int = 0
    pointers: int = 0
    restored: int = 0
    marks: int = 0

    def evict(self, bucket: SweepRequests, e: Eviction) -> None:
        self._many(bucket, lambda kv: bucket.put(kv[0], kv[1].encode(), replace=True), list(e.repoint))
        self.repointed += len(e.repoint)
        self._many(bucket, bucket.delete, list(e.drop_pointers))
        self.pointers += len(e.drop_pointers)
        self._many(bucket, bucket.delete, [e.entry.manifest.key])
        self.evicted += 1
        self.incomplete += e.why is Why.INCOMPLETE
        self._many(bucket, bucket.delete, [e.entry.keys.access_key(e.entry.entry_id)])
        self.marks += e.entry.access is not None
        self._many(bucket, bucket.delete, [listed.key for listed in e.objects])
        self.objects += len(e.objects)
        self.freed += e.freed_bytes

    def orphan(self, bucket: SweepRequests, listed: Listed) -> None:
        self._many(bucket, bucket.delete, [listed.key])
        self.objects += 1
        self.orphans += 1
        self.freed += listed.size

    def pointer(self, bucket: SweepRequests, key: str) -> None:
        self._many(bucket, bucket.delete, [key])
        self.pointers += 1

    def restore(self, bucket: SweepRequests, key_and_entry: tuple[str, str]) -> None:
        self._many(bucket, lambda kv: bucket.put(kv[0], kv[1].encode(), replace=False), [key_and_entry])
        self.restored += 1

    def repoint(self, bucket: SweepRequests, key_and_entry: tuple[str, str]) -> None:
        self._many(bucket, lambda kv: bucket.put(kv[0], kv[1].encode(), replace=True), [key_and_entry])
        self.repointed += 1

    def mark(self, bucket: SweepRequests, key: str) -> None:
        self._many(bucket, bucket.delete, [key])
        self.marks += 1

    def _many(self, bucket: SweepRequests, fn: Callable, items: list) -> None:
        bucket.each(fn, items)
        self.requests += len(items)


def _empty_report(plan: SweepPlan, dry_run: bool) -> SweepReport:
    unknown = "; ".join(plan.unknown)
    return SweepReport(StoppedBy.UNKNOWN if plan.unknown else StoppedBy.DONE, dry_run, plan.max_bytes,
                       plan.used_bytes, plan.used_bytes, plan.entries, plan.entries,
                       young_unreferenced_objects=len(plan.young_unreferenced),
                       young_unreferenced_bytes=sum(o.size for o in plan.young_unreferenced),
                       oldest_access=plan.oldest_access, requests_left=plan.requests,
                       error=f"nothing was deleted: {unknown}" if unknown else "")


def dry_run_report(plan: SweepPlan) -> SweepReport:
    """What applying ``plan`` would do, as a report (nothing is requested)."""
    report = _empty_report(plan, dry_run=True)
    if plan.unknown:
        return report
    evictions = plan.evictions
    return replace(report, used_bytes_after=plan.used_bytes_after, entries_after=plan.entries - len(evictions),
                   entries_evicted=len(evictions),
                   incomplete_entries=sum(e.why is Why.INCOMPLETE for e in evictions),
                   objects_deleted=sum(len(e.objects) for e in evictions) + len(plan.orphans),
                   orphans_deleted=len(plan.orphans), bytes_freed=plan.used_bytes - plan.used_bytes_after,
                   pointers_repointed=sum(len(e.repoint) for e in evictions) + len(plan.stale_pointers),
                   pointers_deleted=sum(len(e.drop_pointers) for e in evictions) + len(plan.dangling_pointers),
                   pointers_restored=len(plan.missing_pointers),
                   access_marks_deleted=sum(e.entry.access is not None for e in evictions)
                   + len(plan.stale_access_marks))


def sweep(location: S3Location, namespace: str, max_bytes: int, grace_s: float, *, dry_run: bool = False,
          max_requests: int = 10_000, now: float | None = None,
          on_progress: Callable[[SweepProgress], None] | None = None) -> SweepReport:
    """One pass over ``namespace`` under ``location``'s prefix: census, plan, then (unless
    ``dry_run``) its requests, at most about ``max_requests`` of them."""
    bucket = SweepRequests(location)
    try:
        plan = plan_sweep(bucket, take_census(bucket, namespace), max_bytes, grace_s, now)
        return dry_run_report(plan) if dry_run else apply_sweep(bucket, plan, max_requests, on_progress)
    finally:
        bucket.close()


__all__ = ["Eviction", "StoppedBy", "SweepPlan", "SweepProgress", "SweepReport", "Why", "apply_sweep",
           "dry_run_report", "plan_sweep", "sweep"]
