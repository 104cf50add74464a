"""Every ``vllm:sparkcache_*`` metric, declared once, and what renders them without vLLM.

The connector's halves emit numbers by *data key* (``restores_ok``, ``used_bytes``,
``restore_seconds``, ...) into ``SparkcacheStats`` (``sparkcache/connector/stats.py``), which
vLLM ships to its frontend; there ``SparkcachePromMetrics`` turns them into the metrics
declared here, on vLLM's own registry and ``/metrics``. A data key not declared here is
refused where it is emitted (``require_counter`` / ``require_gauge`` / ``require_histogram``).
The CLI (``sparkcache status``) renders the gauges it can read from an opened store from the
same declarations (``render_store_gauges``), with the same names and a ``rank`` label.

No vLLM, no torch: the CLI imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence, TypeVar

from .connector.attribution import InputKind
from .store.reasons import LOOKUP_MISSES, PUBLISH_FAILURES
from .store.remote_counts import (CORRUPT_REMOVED, DEADLINE_EXCEEDED, FETCH_HITS, FETCHED_BYTES, MISS_KEYS, SKIP_KEYS,
                                  UPLOAD_BYTES, UPLOAD_FAILURES, UPLOADS_DONE)

if TYPE_CHECKING:  # for readers and type checkers; prometheus_client is imported where it is used
    from prometheus_client import Gauge

    from .store import CapacitySnapshot, PageStore

_Metric = TypeVar("_Metric")  # what make_metric's ``cls`` makes: a Counter, Gauge or Histogram (or a stand-in)

PREFIX = "vllm:sparkcache_"

# Why a request is neither offered nor captured (``skipped_requests{reason}``); the scheduler
# half emits ``skipped_<reason>``.
SKIP_REASONS = ("lora_unreadable", "lora_changed", "unencodable_input", "after_reset")
# What finished requests' prompts were made of.
INPUT_KINDS = tuple(kind.value for kind in InputKind)


@dataclass(frozen=True)
class CounterMetric:
    """``PREFIX + name`` (``_total`` on export); each data key adds to the child whose
    ``label`` has that key's value (no label: one child)."""
    name: str
    help: str
    label: str | None
    keys: tuple[tuple[str, str], ...]  # (data key, label value); "" when there is no label

    @property
    def labels(self) -> tuple[str, ...]:
        return (self.label,) if self.label else ()

    @property
    def data_keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.keys)


@dataclass(frozen=True)
class GaugeMetric:
    """``per_rank``: a worker's gauge, one value per tensor-parallel rank (``rank`` label);
    otherwise the scheduler's, one per engine."""
    name: str
    help: str
    key: str
    per_rank: bool = True

    @property
    def labels(self) -> tuple[str, ...]:
        return ("rank",) if self.per_rank else ()

    @property
    def data_keys(self) -> tuple[str, ...]:
        return (self.key,)


@dataclass(frozen=True)
class HistogramMetric:
    """Samples are shipped as lists per stats interval under the histogram's own name."""
    name: str
    help: str
    buckets: tuple[float, ...]

    @property
    def key(self) -> str:
        return self.name

    @property
    def labels(self) -> tuple[str, ...]:
        return ()

    @property
    def data_keys(self) -> tuple[str, ...]:
        return (self.name,)


def _counter(name: str, doc: str, label: str | None, keys: Mapping[str, str]) -> CounterMetric:
    return CounterMetric(name, doc, label, tuple(keys.items()))


COUNTERS: tuple[CounterMetric, ...] = (
    _counter("attributed_tokens", "Prompt tokens of finished requests by source.", "source",
             {"attr_local_hit_tokens": "local_hit", "attr_external_tokens": "external",
              "attr_recomputed_tokens": "recomputed"}),
    _counter("attributed_external_tokens", "Prompt tokens of finished requests restored by sparkcache, "
             "by what the prompt was made of: text, multimodal (images) or prompt_embeds.", "input",
             {"attr_external_tokens_" + k: k for k in INPUT_KINDS}),
    _counter("attributed_requests", "Finished requests with an attribution record.", "complete",
             {"attr_requests_complete": "true", "attr_requests_incomplete": "false"}),
    _counter("restores", "Restores by outcome, once per request however many ranks placed their "
             "shards (refused: any rank refused, vLLM recomputes on all).", "outcome",
             {"restores_ok": "ok", "restores_failed": "refused"}),
    _counter("restored_tokens", "Prompt tokens restored by verified restores, once per request "
             "(not per rank).", None, {"restored_tokens": ""}),
    _counter("restored_bytes", "Bytes placed into the KV cache by verified restores, by kind: "
             "attention pages, or the recurrent (Mamba / linear-attention) state of a hybrid "
             "model; summed over ranks (each places its own shard).", "kind",
             {"restored_page_bytes": "page", "restored_state_bytes": "state"}),
    _counter("state_restores", "Restores of a hybrid model (attention pages plus the recurrent "
             "state at their depth, placed together or not at all), by outcome.", "outcome",
             {"state_restores_ok": "ok", "state_restores_failed": "refused"}),
    _counter("captured_bytes", "Bytes copied out of the KV cache for publication, by kind (page "
             "or recurrent state), summed over ranks.", "kind",
             {"captured_page_bytes": "page", "captured_state_bytes": "state"}),
    _counter("load_failures", "Restores refused (corrupt, absent or unreadable); the request "
             "recomputes.", None, {"restores_failed": ""}),
    _counter("skipped_requests", "Requests neither offered a restore nor captured (they "
             "recompute), by why: an adapter it cannot tell apart, an input it cannot key, or a "
             "cache reset.", "reason", {"skipped_" + r: r for r in SKIP_REASONS}),
    _counter("quarantined_objects", "Page objects found corrupt on a restore and removed by a "
             "writing worker, so the next capture of their prefix writes them again.", None,
             {"objects_quarantined": ""}),
    _counter("quarantined_entries", "Entries removed by a writing worker because a restore found "
             "an object's bytes matching its name but not the XXH3-128 their manifest records (the "
             "manifest is what is wrong); the next capture of their prefix publishes them again.",
             None, {"entries_quarantined": ""}),
    _counter("offered_tokens", "Tokens offered to the scheduler beyond the local hit.", None,
             {"offered_tokens": ""}),
    _counter("captures", "Captures by outcome, one per rank's shard (skipped_too_large: a hybrid "
             "boundary capture larger than one capture slot; a finished request's streams through "
             "its slot).", "outcome",
             {"captures_queued": "queued", "captures_published": "published",
              "captures_publish_failed": "publish_failed",
              "captures_skipped_slots_full": "skipped_slots_full",
              "captures_skipped_too_large": "skipped_too_large"}),
    _counter("publish_failures", "Publications refused, by reason (over_capacity, "
             "low_free_space, source_failed, no_space, read_only_fs, io_error, lock_timeout, ...), one per "
             "rank's shard.", "reason", {"publish_failed_" + r: r for r in PUBLISH_FAILURES}),
    _counter("lookup_misses", "Store lookups and page reads that missed, by reason: not_found "
             "(nothing stored under the keys), corrupt or absent (an entry or page that fails "
             "verification or lost a file), or the filesystem's (no_space, read_only_fs, "
             "io_error, lock_timeout, unsafe_path). One per lookup: the scheduler's of a request "
             "(looked up again at each step it waits), a worker's page reads of a restore.",
             "reason", {"lookup_miss_" + r: r for r in LOOKUP_MISSES}),
    _counter("lone_shards_removed", "Shards of entries that some tensor-parallel ranks hold and "
             "another does not (its publication refused, or evicted from its own root), removed "
             "so the next capture publishes every rank's.", None, {"lone_shards_removed": ""}),
    _counter("evictions", "Entries evicted or expired by maintenance.", None,
             {"evicted_entries": ""}),
    _counter("bytes_reclaimed", "Bytes reclaimed by maintenance from evicted entries.", None,
             {"bytes_reclaimed": ""}),
    _counter("maintenance_passes", "Maintenance passes run by the workers.", None,
             {"maintenance_passes": ""}),
    _counter("maintenance_passes_overrun", "Maintenance passes longer than their time budget "
             "(SPARKCACHE_MAINTENANCE_MAX_MS) plus 20%, the bound a pass keeps: a slow disk, or "
             "the worker's cores taken.", None, {"maintenance_overrun": ""}),
    _counter("maintenance_passes_stopped", "Maintenance passes that gave up: the store's lock "
             "stayed held past the wait bound (lock), the filesystem failed (error), or a listing or "
             "read of the store failed, so nothing was evicted or deleted (unknown).", "reason",
             {"maintenance_stopped_lock": "lock", "maintenance_stopped_error": "error",
              "maintenance_stopped_unknown": "unknown"}),
    _counter("lock_timeouts", "A writing worker's waits for its store's cross-process lock "
             "(locks/gc.lock) that gave up at their bound, by the lock wanted: exclusive (a "
             "maintenance pass, which waits 20% of its budget: ordinary contention with another "
             "process's publications), shared (a publication, 10 s, or a leased lookup, 2 s: a "
             "holder that slow may be stopped or hung; the log says so at most once a minute).",
             "lock", {"lock_timeouts_shared": "shared", "lock_timeouts_exclusive": "exclusive"}),
    # The shared tier (sparkcache/store/remote_*.py): its counts, drained by the workers (uploads)
    # and the scheduler (fetches), and what the scheduler counts of the requests it fetched for.
    _counter("remote_request_fetches", "Requests the scheduler held back (vLLM skips them a step "
             "or more) to fetch every rank's shard of their prompt from the shared tier after a local "
             "miss, by outcome: hit (every rank's shard now local) or miss (they recompute what is "
             "not local).", "outcome", {"remote_request_fetch_hit": "hit", "remote_request_fetch_miss": "miss"}),
    _counter("attributed_remote_tokens", "Prompt tokens of finished requests restored from an entry "
             "fetched from the shared tier for them (part of attributed_tokens{source=external}).",
             None, {"attr_remote_tokens": ""}),
    _counter("remote_uploads", "Entries uploaded whole to the shared tier (objects, then the "
             "manifest, then the pointers).", None, {UPLOADS_DONE: ""}),
    _counter("remote_upload_bytes", "Object bytes PUT to the shared tier (objects already there "
             "not counted).", None, {UPLOAD_BYTES: ""}),
    _counter("remote_upload_failures", "Upload tries that failed (the remote store down, slow or "
             "refusing); each is tried again with backoff.", None, {UPLOAD_FAILURES: ""}),
    _counter("remote_uploads_skipped", "Entries never uploaded, by why: the queue's bytes at "
             "SPARKCACHE_REMOTE_UPLOAD_QUEUE_BYTES (queue_full), evicted locally first (evicted), a "
             "longer entry of the same prompt queued behind it (superseded), its local bytes failing "
             "verification (unreadable), an object larger than one PUT carries (refused).", "reason", {k: r.value for r, k in SKIP_KEYS.items()}),
    _counter("remote_fetch_hits", "Fetches from the shared tier that wrote a verified entry into "
             "the local store (or found it there).", None, {FETCH_HITS: ""}),
    _counter("remote_fetch_misses", "Fetches from the shared tier that missed, by reason: nothing "
             "there (not_found), a pointer without its manifest (manifest_absent), a manifest of "
             "another identity (wrong_identity) or of other blocks (diverged), wrong bytes (corrupt), "
             "an object missing (absent), the remote store failing (io_error), the deadline "
             "(deadline), the local store refusing the entry (local_refused).", "reason",
             {k: r.value for r, k in MISS_KEYS.items()}),
    _counter("remote_fetched_bytes", "Object bytes fetched from the shared tier into the local "
             "store.", None, {FETCHED_BYTES: ""}),
    _counter("remote_deadline_exceeded", "Fetches still running at "
             "SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS, abandoned (each is also a miss, deadline).",
             None, {DEADLINE_EXCEEDED: ""}),
    _counter("remote_corrupt_removed", "Remote objects and manifests found with wrong bytes on a "
             "fetch and removed from the bucket, so the next upload of their entry puts them back.",
             None, {CORRUPT_REMOVED: ""}),
)

# A worker's gauge carries a ``rank`` label: each tensor-parallel rank has its own slots,
# and with ROOT holding {rank} its own store.
GAUGES: tuple[GaugeMetric, ...] = (
    GaugeMetric("publication_pending_slots", "Capture slots waiting for or under publication.",
                "pending_slots"),
    GaugeMetric("publication_pending_bytes", "Bytes held by capture slots.", "pending_bytes"),
    GaugeMetric("publication_oldest_pending_age_seconds", "Age of the oldest pending publication.",
                "oldest_pending_age"),
    GaugeMetric("capture_slots_total", "Capture slots per rank.", "slots_total"),
    GaugeMetric("capacity_used_bytes", "Allocated bytes in the store.", "used_bytes"),
    GaugeMetric("capacity_limit_bytes", "Store max_bytes.", "max_bytes"),
    GaugeMetric("filesystem_free_bytes", "Free bytes of the filesystem under the root (whatever "
                "fills it); publications stop at SPARKCACHE_MIN_FREE_BYTES.", "free_bytes"),
    GaugeMetric("filesystem_floor_bytes", "SPARKCACHE_MIN_FREE_BYTES: the free space maintenance "
                "keeps (0: no floor).", "floor_bytes"),
    GaugeMetric("entries", "Published entries in the store.", "entries"),
    GaugeMetric("unreadable_paths", "Manifests and store directories that the last attempt could "
                "not list or read (EIO, EACCES): retried every refresh; while any is unreadable "
                "nothing is evicted or deleted.", "unreadable_paths"),
    GaugeMetric("captures_unsettled", "Planned captures whose outcome the workers have not "
                "reported yet.", "unsettled_captures", per_rank=False),
    GaugeMetric("maintenance_last_pass_duration_seconds", "Wall time of the last maintenance pass.",
                "maintenance_last_pass_duration_seconds"),
    GaugeMetric("maintenance_remaining_entries", "Entries the last pass left over its budget.",
                "maintenance_remaining_entries"),
    GaugeMetric("maintenance_healthy", "1 while the writer's maintenance thread runs, 0 after it "
                "failed.", "maintenance_healthy"),
    GaugeMetric("pending_block_frees", "Finished requests whose blocks wait for a capture copy or "
                "a restore.", "pending_block_frees", per_rank=False),
)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            120.0)
_STEP_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BYTES = tuple(float(1 << b) for b in range(16, 38, 2))  # 64 KiB .. 64 GiB, x4 apart

HISTOGRAMS: tuple[HistogramMetric, ...] = (
    HistogramMetric("restore_seconds", "Wall time of one rank's restore of its shard (read, "
                    "verify, place), placed or refused.", _SECONDS),
    HistogramMetric("restore_bytes", "Bytes one rank placed by a verified restore (pages and "
                    "state).", _BYTES),
    HistogramMetric("publication_seconds", "Wall time of one rank's publication of its shard, "
                    "published or refused.", _SECONDS),
    HistogramMetric("publication_bytes", "Bytes one published shard wrote (objects it did not "
                    "reuse).", _BYTES),
    HistogramMetric("capture_wait_seconds", "From a request's last planned capture to every "
                    "rank's report that it settled (published, refused or skipped).", _SECONDS),
    HistogramMetric("remote_fetch_wait_seconds", "From a request's local miss to the end of its "
                    "fetch of every rank's shard from the shared tier (hit or miss; bounded by "
                    "SPARKCACHE_REMOTE_FETCH_DEADLINE_SECONDS): how long the request waited.", _SECONDS),
    HistogramMetric("maintenance_pass_seconds", "Wall time of one maintenance pass, lock wait "
                    "included.", _SECONDS),
    HistogramMetric("scheduler_step_seconds", "Time one engine step spent in the connector's "
                    "scheduler hooks on vLLM's scheduler thread: lookups of waiting requests, load "
                    "and capture plans, reports, stats.", _STEP_SECONDS),
    HistogramMetric("worker_step_seconds", "Time one engine step spent in the connector's worker "
                    "hooks on the model's thread, restores aside (they are restore_seconds): "
                    "arming the prefill hold, capture copies into slots, results and stats.", _STEP_SECONDS),
)

COUNTER_KEYS = frozenset(k for c in COUNTERS for k in c.data_keys)
RANK_GAUGE_KEYS = frozenset(g.key for g in GAUGES if g.per_rank)
ENGINE_GAUGE_KEYS = frozenset(g.key for g in GAUGES if not g.per_rank)
HISTOGRAM_KEYS = frozenset(h.key for h in HISTOGRAMS)
_WHERE = "sparkcache/metrics.py"


class UndeclaredMetric(ValueError):
    """A data key emitted that no declaration in ``sparkcache/metrics.py`` names."""


def _refuse(kind: str, key: object, table: str, also: str = "") -> UndeclaredMetric:
    return UndeclaredMetric(f"sparkcache metrics: {kind} data key {key!r} is not declared{also}; "
                            f"declare it in the {table} table of {_WHERE} (name, help, labels, "
                            "data keys) before emitting it")


def require_counter(key: str) -> str:
    if key not in COUNTER_KEYS:
        raise _refuse("counter", key, "COUNTERS")
    return key


def require_gauge(key: str, *, per_rank: bool) -> str:
    if key not in (RANK_GAUGE_KEYS if per_rank else ENGINE_GAUGE_KEYS):
        other = key in (ENGINE_GAUGE_KEYS if per_rank else RANK_GAUGE_KEYS)
        also = (f" as a {'per-rank' if per_rank else 'per-engine'} gauge (it is declared "
                f"per_rank={not per_rank})") if other else ""
        raise _refuse("per-rank gauge" if per_rank else "gauge", key, "GAUGES", also)
    return key


def require_histogram(key: str) -> str:
    if key not in HISTOGRAM_KEYS:
        raise _refuse("histogram", key, "HISTOGRAMS")
    return key


def _check_tables() -> None:
    """Refuse, at import, a table that would export one name twice, give one gauge key two
    metrics, or a counter labels it does not have."""
    names = [m.name for m in (*COUNTERS, *GAUGES, *HISTOGRAMS)]
    if len(names) != len(set(names)):
        raise ValueError(f"{_WHERE}: a metric name declared twice: {sorted(names)}")
    keys = [g.key for g in GAUGES]
    if len(keys) != len(set(keys)):
        raise ValueError(f"{_WHERE}: a gauge data key declared twice: {sorted(keys)}")
    for c in COUNTERS:
        if len(set(c.data_keys)) != len(c.keys) or (c.label is None) != all(v == "" for _, v in c.keys):
            raise ValueError(f"{_WHERE}: counter {c.name}: a data key twice, or label values "
                             f"that do not match its label {c.label!r}")


_check_tables()


def make_metric(metric: CounterMetric | GaugeMetric | HistogramMetric, cls: Callable[..., _Metric],
                labelnames: Sequence[str] = ()) -> _Metric:
    """The Prometheus metric of a declaration: ``cls`` is a prometheus_client class (or
    vLLM's stand-in for it, as ``build_prom_metrics`` hands them), ``labelnames`` the
    exporter's own labels, before the declaration's."""
    kwargs: dict[str, list[float]] = {}
    if isinstance(metric, HistogramMetric):
        kwargs["buckets"] = list(metric.buckets)
    return cls(name=PREFIX + metric.name, documentation=metric.help,
               labelnames=[*labelnames, *metric.labels], **kwargs)


# ---------------------------------------------------------------------- the store's own gauges


def store_gauges(store: PageStore) -> dict[str, float]:
    """The per-rank gauges an opened store tells by itself (capacity, entries, and the
    filesystem's free bytes and floor when it can be read): what a worker ships with its
    stats and what ``sparkcache status`` prints."""
    gauges: dict[str, float] = {}
    cap = store.capacity()
    gauges.update(used_bytes=cap.used_bytes, max_bytes=cap.max_bytes, entries=cap.entries,
                  unreadable_paths=cap.unreadable)
    try:
        gauges.update(free_bytes=store.free_bytes(), floor_bytes=store.min_free_bytes)
    except OSError:
        pass  # a failing filesystem: the publications' own failures say so
    return gauges


def render_store_gauges(per_rank: Iterable[Mapping[str, float]]) -> str:
    """Prometheus text of the per-rank gauges given by data key (one mapping per rank, in
    rank order), from the declarations: the names vLLM's ``/metrics`` has, with a ``rank``
    label (and none of vLLM's engine labels)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    made: dict[str, Gauge] = {}
    for rank, gauges in enumerate(per_rank):
        for key, value in gauges.items():
            require_gauge(key, per_rank=True)
            if key not in made:
                decl = next(g for g in GAUGES if g.key == key)
                made[key] = make_metric(decl, lambda **kw: Gauge(registry=registry, **kw))
            made[key].labels(str(rank)).set(value)
    return generate_latest(registry).decode()


def render_capacity_line(snapshots: Sequence[CapacitySnapshot]) -> str:
    """``sparkcache: capacity ranks=R entries=N used=X.X/Y.YGiB healthy=yes|no``.

    Sums over ranks; healthy means every rank is at or under its max bytes and has no
    manifest that failed verification or could not be read.
    """
    entries = sum(s.entries for s in snapshots)
    used = sum(s.used_bytes for s in snapshots) / (1 << 30)
    limit = sum(s.max_bytes for s in snapshots) / (1 << 30)
    healthy = bool(snapshots) and all(s.used_bytes <= s.max_bytes and not s.bad_manifests
                                      and not s.unreadable for s in snapshots)
    return (f"sparkcache: capacity ranks={len(snapshots)} entries={entries} "
            f"used={used:.1f}/{limit:.1f}GiB healthy={'yes' if healthy else 'no'}")


# ---------------------------------------------------------------------- the remote sweeper's gauges

# What ``sparkcache remote-gc --metrics-file`` writes for a textfile collector (node_exporter's):
# the sweeper runs from one place per namespace, not in an engine, so vLLM's /metrics never has
# these; a ``namespace`` label tells the namespaces apart. Data keys: ``SweepReport``'s fields.
REMOTE_GC_GAUGES: tuple[GaugeMetric, ...] = (
    GaugeMetric("remote_gc_last_pass_ok", "1 when the last remote-gc pass ran (stopped_by done or "
                "budget), 0 when it could not list or read the namespace or a request failed.", "ok", False),
    GaugeMetric("remote_gc_last_pass_timestamp_seconds", "When the last remote-gc pass ended.", "ended_at", False),
    GaugeMetric("remote_gc_used_bytes", "The namespace's remote objects' bytes after the last pass.",
                "used_bytes_after", False),
    GaugeMetric("remote_gc_limit_bytes", "SPARKCACHE_REMOTE_MAX_BYTES (0: no bound).", "max_bytes", False),
    GaugeMetric("remote_gc_entries", "Remote entries after the last pass.", "entries_after", False),
    GaugeMetric("remote_gc_evicted_entries", "Entries the last pass evicted.", "entries_evicted", False),
    GaugeMetric("remote_gc_incomplete_entries", "Entries the last pass found with a missing object "
                "(and evicted).", "incomplete_entries", False),
    GaugeMetric("remote_gc_freed_bytes", "Bytes of objects the last pass deleted.", "bytes_freed", False),
    GaugeMetric("remote_gc_young_unreferenced_bytes", "Bytes of objects no manifest references, younger "
                "than the grace (uploads in progress, or cut short recently).", "young_unreferenced_bytes", False),
    GaugeMetric("remote_gc_oldest_access_timestamp_seconds", "The oldest last access of a remote entry "
                "left (0: none).", "oldest_access", False),
    GaugeMetric("remote_gc_requests_left", "Requests the last pass planned and did not make (its "
                "budget or a failure): more than 0 calls for another pass.", "requests_left", False),
)

if {g.name for g in REMOTE_GC_GAUGES} & {m.name for m in (*COUNTERS, *GAUGES, *HISTOGRAMS)}:
    raise ValueError(f"{_WHERE}: a REMOTE_GC_GAUGES name is declared in another table too")


def render_remote_gc_gauges(values: Mapping[str, float], namespace: str) -> str:
    """Prometheus text of ``REMOTE_GC_GAUGES`` from ``values`` by data key (each key declared),
    labelled with ``namespace``."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    declared = {g.key: g for g in REMOTE_GC_GAUGES}
    registry = CollectorRegistry()
    for key, value in values.items():
        if key not in declared:
            raise _refuse("gauge", key, "REMOTE_GC_GAUGES")
        gauge = make_metric(declared[key], lambda **kw: Gauge(registry=registry, **kw), labelnames=["namespace"])
        gauge.labels(namespace).set(value)
    return generate_latest(registry).decode()
