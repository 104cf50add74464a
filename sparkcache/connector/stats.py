"""sparkcache numbers on vLLM's own stats path and ``/metrics``.

Both connector halves return a ``SparkcacheStats`` from ``get_kv_connector_stats``:
``{"counters": {name: delta}, "gauges": {name: value}, "rank_gauges": {rank: {name: value}},
"observations": {histogram: [samples]}}``. vLLM aggregates worker and
scheduler stats, ships them to the frontend, and calls our ``build_prom_metrics`` object's
``observe``, which increments ``vllm:sparkcache_*`` counters and sets gauges on vLLM's own
registry. No request id is ever a label.

Every metric and the data keys behind it are declared once, in ``sparkcache/metrics.py``;
``SparkcacheStats`` refuses a key that is not declared there (``UndeclaredMetric``), so a
name emitted and exported nowhere fails where it is emitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

if TYPE_CHECKING:  # for readers and type checkers
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

from sparkcache.metrics import (COUNTERS, GAUGES, HISTOGRAMS, make_metric, require_counter,
                               require_gauge, require_histogram)

from .samples import MAX_SAMPLES


class SparkcacheStats(KVConnectorStats):
    """``data = {"counters": {...}, "gauges": {...}}`` (plain dicts: it crosses processes)."""

    def _part(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "rank_gauges": {}, "observations": {}}

    def add(self, name: str, n: float = 1) -> None:
        """A counter's delta, by data key (``COUNTERS``)."""
        require_counter(name)
        if n:
            c = self._part("counters")
            c[name] = c.get(name, 0) + n

    def set_gauge(self, name: str, value: float) -> None:
        """A gauge of the engine (the scheduler's; ``GAUGES`` with ``per_rank=False``)."""
        require_gauge(name, per_rank=False)
        self._part("gauges")[name] = value

    def observe(self, name: str, values: list[float]) -> None:
        """Histogram samples (``HISTOGRAMS``) to ship with these stats."""
        require_histogram(name)
        if values:
            samples = self._part("observations").setdefault(name, [])
            samples.extend(values[:max(0, MAX_SAMPLES - len(samples))])

    def set_rank_gauge(self, rank: int, name: str, value: float) -> None:
        """A worker's gauge: one value per tensor-parallel rank, never one rank's over another's."""
        require_gauge(name, per_rank=True)
        self._part("rank_gauges").setdefault(str(rank), {})[name] = value

    def aggregate(self, other: KVConnectorStats) -> "SparkcacheStats":
        for k, v in (other.data.get("counters") or {}).items():
            self.add(k, v)
        for k, v in (other.data.get("gauges") or {}).items():
            self.set_gauge(k, v)
        for rank, gauges in (other.data.get("rank_gauges") or {}).items():
            for k, v in gauges.items():
                self.set_rank_gauge(rank, k, v)
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
    """The ``vllm:sparkcache_*`` metrics on vLLM's registry (``build_prom_metrics``), made by the
    classes vLLM hands in ``metric_types``: prometheus_client's, or stand-ins with their methods
    (Ray's), so the children are annotated as prometheus_client's."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, dict[str, Counter]]] = {}
        for decl in COUNTERS:
            metric = make_metric(decl, self._counter_cls, labelnames)
            self._counters[decl.name] = {
                idx: {key: metric.labels(*values, *([lv] if decl.label else [])) for key, lv in decl.keys}
                for idx, values in per_engine_labelvalues.items()}
        self._histograms: dict[str, dict[int, Histogram]] = {}
        for decl in HISTOGRAMS:
            metric = make_metric(decl, self._histogram_cls, labelnames)
            self._histograms[decl.key] = {idx: metric.labels(*values)
                                          for idx, values in per_engine_labelvalues.items()}
        self._engine_gauges: dict[str, dict[int, Gauge]] = {}
        self._rank_gauges: dict[str, Gauge] = {}
        self._engine_values = per_engine_labelvalues
        for decl in GAUGES:
            metric = make_metric(decl, self._gauge_cls, labelnames)
            if decl.per_rank:
                self._rank_gauges[decl.key] = metric  # children made per rank as ranks report
            else:
                self._engine_gauges[decl.key] = {idx: metric.labels(*values)
                                                 for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # typed as in vLLM's signature: ``SparkcacheStats.data``, plain dicts across processes
        counters = transfer_stats_data.get("counters") or {}
        for per_engine in self._counters.values():
            for key, child in per_engine.get(engine_idx, {}).items():
                if counters.get(key):
                    child.inc(counters[key])
        for key, value in (transfer_stats_data.get("gauges") or {}).items():
            child = self._engine_gauges.get(key, {}).get(engine_idx)
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
