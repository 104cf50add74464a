"""sparkcache numbers on vLLM's own stats path and ``/metrics``.

Both connector halves return a ``SparkcacheStats`` from ``get_kv_connector_stats``:
``{"counters": {name: delta}, "gauges": {name: value}, "rank_gauges": {rank: {name: value}},
"observations": {histogram: [samples]}}``. vLLM aggregates worker and
scheduler stats, ships them to the frontend, and calls our ``build_prom_metrics`` object's
``observe``, which increments ``vllm:sparkcache_*`` counters and sets gauges on vLLM's own
registry. No request id is ever a label.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

from sparkcache.store.reasons import PUBLISH_FAILURES

from .samples import MAX_SAMPLES
from .scheduler_side import SKIP_REASONS

P = "vllm:sparkcache_"

# counter name -> (help, extra label name or None, {data key: label value})
COUNTERS: dict[str, tuple[str, str | None, dict[str, str]]] = {
    "attributed_tokens": ("Prompt tokens of finished requests by source.", "source",
                          {"attr_local_hit_tokens": "local_hit", "attr_external_tokens": "external",
                           "attr_recomputed_tokens": "recomputed"}),
    "attributed_requests": ("Finished requests with an attribution record.", "complete",
                            {"attr_requests_complete": "true", "attr_requests_incomplete": "false"}),
    "restores": ("Restores by outcome, once per request however many ranks placed their shards "
                 "(refused: any rank refused, vLLM recomputes on all).", "outcome",
                 {"restores_ok": "ok", "restores_failed": "refused"}),
    "restored_tokens": ("Prompt tokens restored by verified restores, once per request (not per "
                        "rank).", None,
                        {"restored_tokens": ""}),
    "restored_bytes": ("Bytes placed into the KV cache by verified restores, by kind: attention "
                       "pages, or the recurrent (Mamba / linear-attention) state of a hybrid model; "
                       "summed over ranks (each places its own shard).",
                       "kind", {"restored_page_bytes": "page", "restored_state_bytes": "state"}),
    "state_restores": ("Restores of a hybrid model (attention pages plus the recurrent state at "
                       "their depth, placed together or not at all), by outcome.", "outcome",
                       {"state_restores_ok": "ok", "state_restores_failed": "refused"}),
    "captured_bytes": ("Bytes copied out of the KV cache for publication, by kind (page or "
                       "recurrent state), summed over ranks.", "kind",
                       {"captured_page_bytes": "page", "captured_state_bytes": "state"}),
    "load_failures": ("Restores refused (corrupt, absent or unreadable); the request recomputes.",
                      None, {"restores_failed": ""}),
    "skipped_requests": ("Requests neither offered a restore nor captured (they recompute), by "
                         "why: an input sparkcache does not restore yet, an adapter it cannot "
                         "tell apart, or a cache reset.", "reason",
                         {"skipped_" + r: r for r in SKIP_REASONS}),
    "quarantined_objects": ("Page objects found corrupt on a restore and removed by a writing "
                            "worker, so the next capture of their prefix writes them again.", None,
                            {"objects_quarantined": ""}),
    "offered_tokens": ("Tokens offered to the scheduler beyond the local hit.", None,
                       {"offered_tokens": ""}),
    "captures": ("Captures by outcome, one per rank's shard.", "outcome",
                 {"captures_queued": "queued", "captures_published": "published",
                  "captures_publish_failed": "publish_failed",
                  "captures_skipped_slots_full": "skipped_slots_full",
                  "captures_skipped_too_large": "skipped_too_large"}),
    "publish_failures": ("Publications refused, by reason (over_capacity, low_free_space, "
                         "no_space, read_only_fs, io_error, lock_timeout, ...), one per rank's "
                         "shard.", "reason",
                         {"publish_failed_" + r: r for r in PUBLISH_FAILURES}),
    "lone_shards_removed": ("Shards of entries that some tensor-parallel ranks hold and another "
                            "does not (its publication refused, or evicted from its own root), "
                            "removed so the next capture publishes every rank's.", None,
                            {"lone_shards_removed": ""}),
    "evictions": ("Entries evicted or expired by maintenance.", None, {"evicted_entries": ""}),
    "bytes_reclaimed": ("Bytes reclaimed by maintenance from evicted entries.", None,
                        {"bytes_reclaimed": ""}),
    "maintenance_passes": ("Maintenance passes run by the workers.", None, {"maintenance_passes": ""}),
    "maintenance_passes_overrun": ("Maintenance passes longer than their time budget "
                                   "(SPARKCACHE_MAINTENANCE_MAX_MS) plus 20%, the bound a pass "
                                   "keeps: a slow disk, or the worker's cores taken.", None,
                                   {"maintenance_overrun": ""}),
    "maintenance_passes_stopped": ("Maintenance passes that gave up: the store's lock stayed "
                                   "held past the wait bound (lock) or the filesystem failed "
                                   "(error).", "reason",
                                   {"maintenance_stopped_lock": "lock",
                                    "maintenance_stopped_error": "error"}),
}
# gauge name -> (help, data key, per rank): a worker's gauge carries a ``rank`` label (each
# tensor-parallel rank has its own slots, and with ROOT holding {rank} its own store)
GAUGES: dict[str, tuple[str, str, bool]] = {
    "publication_pending_slots": ("Capture slots waiting for or under publication.", "pending_slots", True),
    "publication_pending_bytes": ("Bytes held by capture slots.", "pending_bytes", True),
    "publication_oldest_pending_age_seconds": ("Age of the oldest pending publication.", "oldest_pending_age", True),
    "capture_slots_total": ("Capture slots per rank.", "slots_total", True),
    "capacity_used_bytes": ("Allocated bytes in the store.", "used_bytes", True),
    "capacity_limit_bytes": ("Store max_bytes.", "max_bytes", True),
    "filesystem_free_bytes": ("Free bytes of the filesystem under the root (whatever fills it); "
                              "publications stop at SPARKCACHE_MIN_FREE_BYTES.", "free_bytes", True),
    "filesystem_floor_bytes": ("SPARKCACHE_MIN_FREE_BYTES: the free space maintenance keeps "
                               "(0: no floor).", "floor_bytes", True),
    "entries": ("Published entries in the store.", "entries", True),
    "captures_unsettled": ("Planned captures whose outcome the workers have not reported yet.",
                           "unsettled_captures", False),
    "maintenance_last_pass_duration_seconds": ("Wall time of the last maintenance pass.",
                                               "maintenance_last_pass_duration_seconds", True),
    "maintenance_remaining_entries": ("Entries the last pass left over its budget.",
                                      "maintenance_remaining_entries", True),
    "maintenance_healthy": ("1 while the writer's maintenance thread runs, 0 after it failed.",
                            "maintenance_healthy", True),
    "pending_block_frees": ("Finished requests whose blocks wait for a capture copy or a restore.", "pending_block_frees", False),
}


_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            120.0)
_STEP_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BYTES = tuple(float(1 << b) for b in range(16, 38, 2))  # 64 KiB .. 64 GiB, x4 apart
# histogram name -> (help, buckets): samples are shipped as lists per stats interval
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "restore_seconds": ("Wall time of one rank's restore of its shard (read, verify, place), "
                        "placed or refused.", _SECONDS),
    "restore_bytes": ("Bytes one rank placed by a verified restore (pages and state).", _BYTES),
    "publication_seconds": ("Wall time of one rank's publication of its shard, published or "
                            "refused.", _SECONDS),
    "publication_bytes": ("Bytes one published shard wrote (objects it did not reuse).", _BYTES),
    "capture_wait_seconds": ("From a request's last planned capture to every rank's report "
                             "that it settled (published, refused or skipped).", _SECONDS),
    "maintenance_pass_seconds": ("Wall time of one maintenance pass, lock wait included.", _SECONDS),
    "scheduler_step_seconds": ("Time one engine step spent in the connector's scheduler hooks on "
                               "vLLM's scheduler thread: lookups of waiting requests, load and "
                               "capture plans, reports, stats.", _STEP_SECONDS),
    "worker_step_seconds": ("Time one engine step spent in the connector's worker hooks on the "
                            "model's thread, restores aside (they are restore_seconds): capture "
                            "copies into slots, results and stats.", _STEP_SECONDS),
}


class SparkcacheStats(KVConnectorStats):
    """``data = {"counters": {...}, "gauges": {...}}`` (plain dicts: it crosses processes)."""

    def _part(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "rank_gauges": {}, "observations": {}}

    def add(self, name: str, n: float = 1) -> None:
        if n:
            c = self._part("counters")
            c[name] = c.get(name, 0) + n

    def set_gauge(self, name: str, value: float) -> None:
        self._part("gauges")[name] = value

    def observe(self, name: str, values: list[float]) -> None:
        """Histogram samples (``HISTOGRAMS``) to ship with these stats."""
        if values:
            samples = self._part("observations").setdefault(name, [])
            samples.extend(values[:max(0, MAX_SAMPLES - len(samples))])

    def set_rank_gauge(self, rank: int, name: str, value: float) -> None:
        """A worker's gauge: one value per tensor-parallel rank, never one rank's over another's."""
        self._part("rank_gauges").setdefault(str(rank), {})[name] = value

    def aggregate(self, other: KVConnectorStats) -> "SparkcacheStats":
        for k, v in (other.data.get("counters") or {}).items():
            self.add(k, v)
        self._part("gauges").update(other.data.get("gauges") or {})
        for rank, gauges in (other.data.get("rank_gauges") or {}).items():
            self._part("rank_gauges").setdefault(rank, {}).update(gauges)
        for name, values in (other.data.get("observations") or {}).items():
            self.observe(name, values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = dict(self._part("counters"))
        out.update(self._part("gauges"))
        for rank, gauges in self._part("rank_gauges").items():
            out.update({f"{k}[rank={rank}]": v for k, v in gauges.items()})
        for name, values in self._part("observations").items():
            out[f"{name}[count]"] = len(values)
        return out

    def is_empty(self) -> bool:
        return not (self._part("counters") or self._part("gauges") or self._part("rank_gauges")
                    or self._part("observations"))


class SparkcachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, dict[str, Any]]] = {}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, (doc, extra, keys) in COUNTERS.items():
            labels = list(labelnames) + ([extra] if extra else [])
            metric = self._counter_cls(name=P + name, documentation=doc, labelnames=labels)
            per_engine = {}
            for idx, values in per_engine_labelvalues.items():
                per_engine[idx] = {key: metric.labels(*values, *([lv] if extra else []))
                                   for key, lv in keys.items()}
            self._counters[name] = per_engine
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, (doc, buckets) in HISTOGRAMS.items():
            metric = self._histogram_cls(name=P + name, documentation=doc,
                                         labelnames=list(labelnames), buckets=list(buckets))
            self._histograms[name] = {idx: metric.labels(*values)
                                      for idx, values in per_engine_labelvalues.items()}
        self._rank_gauges: dict[str, Any] = {}
        self._engine_values = per_engine_labelvalues
        for name, (doc, key, per_rank) in GAUGES.items():
            metric = self._gauge_cls(name=P + name, documentation=doc,
                                     labelnames=list(labelnames) + (["rank"] if per_rank else []))
            if per_rank:
                self._rank_gauges[key] = metric  # children made per rank as ranks report
            else:
                self._gauges[key] = {idx: metric.labels(*values)
                                     for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters = transfer_stats_data.get("counters") or {}
        for per_engine in self._counters.values():
            for key, child in per_engine.get(engine_idx, {}).items():
                if counters.get(key):
                    child.inc(counters[key])
        for key, value in (transfer_stats_data.get("gauges") or {}).items():
            child = self._gauges.get(key, {}).get(engine_idx)
            if child is not None:
                child.set(value)
        for name, samples in (transfer_stats_data.get("observations") or {}).items():
            child = self._histograms.get(name, {}).get(engine_idx)
            if child is not None:
                for value in samples:
                    child.observe(value)
        values = self._engine_values.get(engine_idx)
        for rank, gauges in (transfer_stats_data.get("rank_gauges") or {}).items():
            for key, value in gauges.items():
                metric = self._rank_gauges.get(key)
                if metric is not None and values is not None:
                    metric.labels(*values, str(rank)).set(value)
