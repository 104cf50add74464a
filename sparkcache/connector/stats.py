"""sparkcache numbers on vLLM's own stats path and ``/metrics``.

Both connector halves return a ``SparkcacheStats`` from ``get_kv_connector_stats``:
``{"counters": {name: delta}, "gauges": {name: value}}``. vLLM aggregates worker and
scheduler stats, ships them to the frontend, and calls our ``build_prom_metrics`` object's
``observe``, which increments ``vllm:sparkcache_*`` counters and sets gauges on vLLM's own
registry. No request id is ever a label.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

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
    "evictions": ("Entries evicted or expired by maintenance.", None, {"evicted_entries": ""}),
    "bytes_reclaimed": ("Bytes reclaimed by maintenance from evicted entries.", None,
                        {"bytes_reclaimed": ""}),
    "maintenance_passes": ("Maintenance passes run by the workers.", None, {"maintenance_passes": ""}),
    "maintenance_passes_stopped": ("Maintenance passes that gave up: the store's lock stayed "
                                   "held past the wait bound (lock) or the filesystem failed "
                                   "(error).", "reason",
                                   {"maintenance_stopped_lock": "lock",
                                    "maintenance_stopped_error": "error"}),
}
GAUGES: dict[str, tuple[str, str]] = {
    "publication_pending_slots": ("Capture slots waiting for or under publication.", "pending_slots"),
    "publication_pending_bytes": ("Bytes held by capture slots.", "pending_bytes"),
    "publication_oldest_pending_age_seconds": ("Age of the oldest pending publication.", "oldest_pending_age"),
    "capture_slots_total": ("Capture slots per rank.", "slots_total"),
    "capacity_used_bytes": ("Allocated bytes in the store.", "used_bytes"),
    "capacity_limit_bytes": ("Store max_bytes.", "max_bytes"),
    "entries": ("Published entries in the store.", "entries"),
    "captures_unsettled": ("Planned captures whose outcome the workers have not reported yet.",
                           "unsettled_captures"),
    "maintenance_last_pass_duration_seconds": ("Wall time of the last maintenance pass.",
                                               "maintenance_last_pass_duration_seconds"),
    "maintenance_remaining_entries": ("Entries the last pass left over its budget.",
                                      "maintenance_remaining_entries"),
    "maintenance_healthy": ("1 while the writer's maintenance thread runs, 0 after it failed.",
                            "maintenance_healthy"),
    "pending_block_frees": ("Finished requests whose blocks wait for a capture copy or a restore.", "pending_block_frees"),
}


class SparkcacheStats(KVConnectorStats):
    """``data = {"counters": {...}, "gauges": {...}}`` (plain dicts: it crosses processes)."""

    def _part(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def add(self, name: str, n: float = 1) -> None:
        if n:
            c = self._part("counters")
            c[name] = c.get(name, 0) + n

    def set_gauge(self, name: str, value: float) -> None:
        self._part("gauges")[name] = value

    def aggregate(self, other: KVConnectorStats) -> "SparkcacheStats":
        for k, v in (other.data.get("counters") or {}).items():
            self.add(k, v)
        self._part("gauges").update(other.data.get("gauges") or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        out = dict(self._part("counters"))
        out.update(self._part("gauges"))
        return out

    def is_empty(self) -> bool:
        return not self._part("counters") and not self._part("gauges")


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
        for name, (doc, key) in GAUGES.items():
            metric = self._gauge_cls(name=P + name, documentation=doc, labelnames=list(labelnames))
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
