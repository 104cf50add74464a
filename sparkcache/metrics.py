"""Prometheus metrics (``vllm:sparkcache_*``) and the one-line capacity report.

``StoreMetrics(registry=None)`` registers into a private ``CollectorRegistry`` (tests and
several stores in one process never collide); pass ``prometheus_client.REGISTRY`` to
expose them next to vLLM's own metrics. The store calls the ``on_*`` hooks.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from .store.reasons import LOOKUP_MISSES, PUBLISH_FAILURES, Reason

P = "vllm:sparkcache_"


class StoreMetrics:
    def __init__(self, registry: Any = None, *, rank: str = "0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["rank"]
        self.rank = rank

        def gauge(name: str, doc: str) -> Any:
            return Gauge(P + name, doc, labels, registry=r).labels(rank)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Any:
            c = Counter(P + name, doc, labels + list(extra), registry=r)
            return c if extra else c.labels(rank)

        self.pending_slots = gauge("publication_pending_slots", "Publications waiting or running.")
        self.pending_bytes = gauge("publication_pending_bytes", "Bytes of publications waiting or running.")
        self.oldest_pending_age = gauge("publication_oldest_pending_age_seconds",
                                        "Age of the oldest waiting publication.")
        self.maintenance_active = gauge("maintenance_active", "1 while a maintenance pass runs.")
        self.maintenance_remaining = gauge("maintenance_remaining_entries",
                                           "Entries the last pass left to evict (budget stop).")
        self.last_pass_duration = gauge("maintenance_last_pass_duration_seconds",
                                        "Wall time of the last maintenance pass.")
        self.last_pass_entries = gauge("maintenance_last_pass_entries", "Entries evicted by the last pass.")
        self.last_pass_bytes = gauge("maintenance_last_pass_bytes", "Bytes reclaimed by the last pass.")
        self.evictions = counter("evictions", "Entries evicted (LRU or TTL).")
        self.bytes_reclaimed = counter("bytes_reclaimed", "Bytes reclaimed by maintenance.")
        self.used_bytes = gauge("capacity_used_bytes", "Allocated bytes (shared objects once).")
        self.limit_bytes = gauge("capacity_limit_bytes", "max_bytes.")
        self.entries = gauge("entries", "Published entries.")
        self._publish_failures = counter("publish_failures", "Failed publications.", ["reason"])
        self._lookup_misses = counter("lookup_misses", "Lookups or reads that missed.", ["reason"])
        self.passes_stopped = counter("maintenance_passes_stopped",
                                      "Maintenance passes that gave up: lock (the gc lock stayed "
                                      "held past the wait bound) or error (the filesystem "
                                      "failed).", ["reason"])
        for reason in ("lock", "error"):
            self.passes_stopped.labels(rank, reason)
        self.publications = counter("publications", "Successful publications.")
        self.bytes_written = counter("bytes_written", "Page bytes written by publications.")
        for reason in PUBLISH_FAILURES:
            self._publish_failures.labels(rank, reason)  # exported at 0 from the start
        for reason in LOOKUP_MISSES:
            self._lookup_misses.labels(rank, reason)
        self._pending: dict[Any, tuple[float, int]] = {}
        self.last_capacity: Any = None

    # ------------------------------------------------------------------ hooks (store side)

    def on_publish(self, result: Any) -> None:
        if result.ok:
            self.publications.inc()
            self.bytes_written.inc(result.bytes_written)
        else:
            self._publish_failures.labels(self.rank, result.reason).inc()

    def on_lookup(self, result: Any) -> None:
        if result.reason != Reason.HIT:
            self._lookup_misses.labels(self.rank, result.reason).inc()

    def on_pass_start(self) -> None:
        self.maintenance_active.set(1)

    def on_pass(self, report: Any) -> None:
        self.maintenance_active.set(0)
        self.maintenance_remaining.set(report.remaining_entries)
        self.last_pass_duration.set(report.duration_s)
        evicted = report.entries_evicted + report.entries_expired
        self.last_pass_entries.set(evicted)
        self.last_pass_bytes.set(report.bytes_reclaimed)
        self.evictions.inc(evicted)
        self.bytes_reclaimed.inc(report.bytes_reclaimed)
        if report.stopped_by in ("lock", "error"):
            self.passes_stopped.labels(self.rank, report.stopped_by).inc()

    def on_capacity(self, snapshot: Any) -> None:
        self.last_capacity = snapshot
        self.used_bytes.set(snapshot.used_bytes)
        self.limit_bytes.set(snapshot.max_bytes)
        self.entries.set(snapshot.entries)

    # ------------------------------------------------------------------ publication backlog

    def publication_queued(self, key: Any, nbytes: int) -> None:
        self._pending[key] = (time.monotonic(), nbytes)
        self._update_backlog()

    def publication_done(self, key: Any) -> None:
        self._pending.pop(key, None)
        self._update_backlog()

    def refresh_backlog(self) -> None:
        """Re-compute the oldest pending age (call before scraping)."""
        self._update_backlog()

    def _update_backlog(self) -> None:
        pending = list(self._pending.values())
        self.pending_slots.set(len(pending))
        self.pending_bytes.set(sum(n for _, n in pending))
        self.oldest_pending_age.set(time.monotonic() - min(t for t, _ in pending) if pending else 0)

    # ------------------------------------------------------------------ reading

    def publish_failures(self, reason: str) -> float:
        return self._publish_failures.labels(self.rank, reason)._value.get()

    def lookup_misses(self, reason: str) -> float:
        return self._lookup_misses.labels(self.rank, reason)._value.get()

    def render(self) -> str:
        from prometheus_client import generate_latest

        self.refresh_backlog()
        return generate_latest(self.registry).decode()


def render_capacity_line(snapshots: Sequence[Any]) -> str:
    """``sparkcache: capacity ranks=R entries=N used=X.X/Y.YGiB healthy=yes|no``.

    Sums over ranks; healthy means every rank is at or under its max bytes and has no
    manifest that failed verification.
    """
    entries = sum(s.entries for s in snapshots)
    used = sum(s.used_bytes for s in snapshots) / (1 << 30)
    limit = sum(s.max_bytes for s in snapshots) / (1 << 30)
    healthy = bool(snapshots) and all(s.used_bytes <= s.max_bytes and not s.bad_manifests
                                      for s in snapshots)
    return (f"sparkcache: capacity ranks={len(snapshots)} entries={entries} "
            f"used={used:.1f}/{limit:.1f}GiB healthy={'yes' if healthy else 'no'}")
