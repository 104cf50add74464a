"""``SparkcacheConnector``: the class vLLM 0.32.0 loads (``KVConnectorBase_V1`` + ``SupportsHMA``).

Settings come from ``kv_connector_extra_config`` (lower-case setting names) over the
``SPARKCACHE_*`` environment (see ``sparkcache/settings.py``); the scheduler transforms'
keys (``sparkcache_gpu_lease_seconds``, ...) are rows of the same table, through which the
transformed scheduler reads them too (``sparkcache.settings.transform_option``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sparkcache.settings import Settings, SettingsError, load_settings
from sparkcache.store import Identity, PageStore
from sparkcache.store.remote_tier import RemoteTier

from .capture_plans import CapturePlan
from .identity import make_identity, shard_identities
from .kv_layout import KVLayout, LayoutKind
from .prefill_hold import prefill_tokens
from .remote_fetches import RemoteFetches
from .scheduler_side import LoadPlan, SchedulerSide
from .stats import SparkcachePromMetrics, SparkcacheStats
from .worker_side import WorkerSide

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("sparkcache.connector")


@dataclass
class SparkcacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    captures: list[CapturePlan] = field(default_factory=list)
    prefill_tokens: int = 0  # the step's tokens beyond decoding: publication holds still meanwhile


@dataclass
class SparkcacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: request ids whose capture settled (one entry per worker),
    and the outcome of this step's synchronous loads (a request fails if any worker failed)."""
    settled: list[str] = field(default_factory=list)
    sync_loaded: list[str] = field(default_factory=list)
    sync_failed: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "SparkcacheWorkerMetadata":
        failed = list(dict.fromkeys(self.sync_failed + list(getattr(other, "sync_failed", ()))))
        loaded = [r for r in dict.fromkeys(self.sync_loaded + list(getattr(other, "sync_loaded", ())))
                  if r not in failed]
        return SparkcacheWorkerMetadata(self.settled + list(getattr(other, "settled", ())), loaded, failed)


def _settings_from(vllm_config: VllmConfig) -> Settings:
    """The settings, and the scheduler transforms' options, parsed by the one table; a
    kv_load_failure_policy that fails requests on a refused restore needs an explicit yes."""
    kvt = vllm_config.kv_transfer_config
    try:
        settings = load_settings(extra_config=dict(kvt.kv_connector_extra_config or {}))
    except SettingsError as exc:
        raise SettingsError(f"sparkcache connector (kv_transfer_config.kv_connector_extra_config): {exc}") from None
    policy = getattr(kvt, "kv_load_failure_policy", "recompute")
    if settings.enabled and policy != "recompute" and not settings.allow_failing_loads:
        raise SettingsError(
            f"sparkcache connector: kv_transfer_config.kv_load_failure_policy={policy!r} fails "
            "every request whose restore is refused (a corrupt or missing page). Fix: set "
            "kv_load_failure_policy=\"recompute\" (the restore is then recomputed), or opt in "
            "to failing requests with SPARKCACHE_ALLOW_FAILING_LOADS=1")
    return settings


def _refuse_unsupported_parallel(vllm_config: VllmConfig, settings: Settings) -> None:
    """Tensor parallelism: every rank stores its own shard of an entry (its heads) under its
    own identity, and the scheduler offers an entry only when every rank's shard is there.
    Refused at startup rather than stored wrong: pipeline parallelism (the scheduler sees
    stage 0's KV layout, so it could not look up another stage's shard: nothing would ever
    be restored) and context parallelism (decode or prefill: it spreads one block's tokens
    over ranks, and sparkcache stores whole blocks per rank); and one engine spanning
    nodes (the scheduler reads every rank's root, so they must be on its node)."""
    if not settings.enabled or settings.access_mode == "disabled":
        return
    pc = vllm_config.parallel_config
    for name, why in (("pipeline_parallel_size", "the scheduler sees only the first stage's KV "
                       "layout, so it cannot find another stage's shard"),
                      ("decode_context_parallel_size", "context parallelism spreads one block's "
                       "tokens over ranks, and sparkcache stores whole blocks per rank"),
                      ("prefill_context_parallel_size", "context parallelism spreads one block's "
                       "tokens over ranks, and sparkcache stores whole blocks per rank")):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise SettingsError(
                f"sparkcache connector: parallel_config.{name}={size} is not supported: {why}. "
                f"Fix: run with {name}=1 (tensor parallelism is supported), or switch the store "
                "off with SPARKCACHE_ENABLED=0")
    nodes = int(getattr(pc, "nnodes_within_dp", 1) or 1)
    if nodes > 1:
        raise SettingsError(
            f"sparkcache connector: one engine spans {nodes} nodes (parallel_config.nnodes="
            f"{pc.nnodes}): its scheduler decides offers by reading every rank's root, and "
            "would not see the roots of ranks on another node (it would never offer, and "
            "remove their siblings' shards as lone). Fix: keep each engine's tensor-parallel "
            "ranks on one node (data parallel across nodes is fine), or switch the store off "
            "with SPARKCACHE_ENABLED=0")


def _open_store(settings: Settings) -> PageStore | None:
    mode = settings.access_mode if settings.enabled else "disabled"
    if mode == "disabled":
        return None  # no file I/O at all
    if mode == "restore-only":
        base = os.path.join(settings.root, settings.namespace)
        if not os.path.isdir(os.path.join(base, "manifests")):
            logger.warning("sparkcache: restore-only and %s holds no store; nothing to restore "
                           "(restore-only never creates it)", base)
            return None
        # Writes nothing under the root (no recovery, no access times, no pins): works on a
        # read-only mount, and never removes another writer's leftovers.
        return PageStore.from_settings(settings, read_only=True)
    return PageStore.from_settings(settings)


def _rank_stores(settings: Settings, ranks: int) -> tuple[PageStore, ...] | None:
    """The store of every tensor-parallel rank's shards, as the scheduler reads them: one
    object for all when they share a root; None when a rank's cannot be read (restore-only
    and it holds no store yet), since an entry is offered only when every rank's shard is."""
    if not settings.per_rank_root:
        store = _open_store(settings)
        return None if store is None else (store,) * ranks
    stores = tuple(_open_store(settings.for_rank(r)) for r in range(ranks))
    return None if any(s is None for s in stores) else stores


def _remote_fetches(settings: Settings, identities: tuple[Identity, ...],
                    stores: tuple[PageStore, ...] | None) -> RemoteFetches | None:
    """The scheduler's fetches from the shared tier: with ``SPARKCACHE_REMOTE_BUCKET`` set and a
    store it may write (read-write: a fetched entry is written into it), one tier per store."""
    if not settings.remote_bucket or not stores or settings.access_mode != "read-write":
        return None
    tiers = {id(store): RemoteTier.from_settings(settings, store) for store in stores}
    return RemoteFetches(tuple(tiers[id(store)] for store in stores), identities,
                         settings.remote_fetch_deadline_seconds)


def _worker_ranks() -> tuple[int, dict[str, int]]:
    """This worker's tensor-parallel rank, and its pipeline and prefill-context-parallel
    ranks (which layers and tokens its pages hold). vLLM initialises every group before it
    builds a worker's connector; an uninitialised one raises rather than pose as rank 0."""
    from vllm.distributed import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), {"pp_rank": ps.get_pp_group().rank_in_group,
                                                 "pcp_rank": ps.get_pcp_group().rank_in_group}


def _report_layout(layout: KVLayout) -> None:
    if layout.kind is LayoutKind.UNSUPPORTED:
        logger.warning("sparkcache: this model's KV cache layout is not stored, nothing will be "
                       "restored or captured: %s", layout.unsupported)


def _ensure_log_handler() -> None:
    """Make ``sparkcache.*`` INFO lines (the attribution record) visible in vLLM's processes.

    vLLM configures only its own ``vllm`` logger; in its engine-core process our loggers
    would fall through to Python's last-resort handler (WARNING and above), dropping the
    ``sparkcache-attribution`` lines. Only when nobody configured logging (no handler on
    ``sparkcache`` nor on the root logger) do we attach one stderr handler at INFO.
    """
    base = logging.getLogger("sparkcache")
    if base.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    base.addHandler(handler)
    if base.level == logging.NOTSET:
        base.setLevel(logging.INFO)


class SparkcacheConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _ensure_log_handler()
        self.settings = _settings_from(vllm_config)
        _refuse_unsupported_parallel(vllm_config, self.settings)
        self.mode = self.settings.access_mode if self.settings.enabled else "disabled"
        self.block_size = int(vllm_config.cache_config.block_size)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._step_s = 0.0  # this engine step's time in our hooks (``_in_step``), restores aside
        declared = self.settings.weights_fingerprint
        if role == KVConnectorRole.SCHEDULER:
            identity, layout = make_identity(vllm_config, kv_cache_config, 0,
                                             declared_weights=declared)
            _report_layout(layout)
            identities = shard_identities(vllm_config, identity)
            stores = _rank_stores(self.settings, len(identities))
            remote = (_remote_fetches(self.settings, identities, stores)
                      if self.mode != "disabled" and layout.kind is not LayoutKind.UNSUPPORTED else None)
            self._sched = SchedulerSide(self.settings, identities, stores, self.block_size, layout,
                                        len(kv_cache_config.kv_cache_groups), remote)
            self._sched.num_workers = max(1, int(getattr(vllm_config.parallel_config, "world_size", 1)))
            if int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) > 1:
                # data-parallel engines step in lockstep (an idle one runs a dummy batch each
                # step): one waiting for its fetch would hold every other's step
                self._sched.idle_fetch_wait_s = 0.0
        else:
            rank, ranks = _worker_ranks()
            self.rank = rank
            self.settings = self.settings.for_rank(rank)
            identity, layout = make_identity(vllm_config, kv_cache_config, rank,
                                             ranks=ranks, declared_weights=declared)
            self._worker = WorkerSide(self.settings, identity, _open_store(self.settings),
                                      kv_cache_config, layout)
        logger.info("sparkcache connector: role=%s mode=%s root=%s", role.name, self.mode,
                    self.settings.root or "-")

    # best-effort cache: a dropped capture is a future miss, never a correctness issue
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ============================================================ scheduler side

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """Count the time of a hook that runs on vLLM's scheduler or model thread into this
        engine step's (``scheduler_step_seconds`` / ``worker_step_seconds``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._step_s += time.perf_counter() - started

    def _take_step_s(self) -> float:
        """This engine step's time in our hooks so far; the next step starts at 0."""
        out, self._step_s = self._step_s, 0.0
        return out

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        with self._in_step():
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        with self._in_step():
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        with self._in_step():
            loads, captures = self._sched.build_meta(scheduler_output)
        # the last scheduler hook of schedule(): a step is from one call to the next
        self._sched.samples.add("scheduler_step_seconds", self._take_step_s())
        self._sched.wait_for_fetches_when_idle(scheduler_output)  # not the hooks' time: a wait
        return SparkcacheConnectorMetadata(loads, captures, prefill_tokens(
            scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens))

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.state(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            with self._in_step():
                self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        assert self._sched is not None
        with self._in_step():
            return self._sched.request_finished(request, (list(block_ids),))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        assert self._sched is not None
        with self._in_step():
            return self._sched.request_finished(request, tuple(list(b) for b in block_ids))

    def reset_cache(self) -> bool:
        """vLLM resets the connector's cache after updating weights in place: from then on
        this process neither offers nor captures (``SchedulerSide.stop_after_reset``)."""
        if self._sched is not None:
            self._sched.stop_after_reset()
        return True

    def has_pending_block_frees(self) -> bool:
        return self._sched is not None and self._sched.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        # Keeps an idle engine stepping until our last numbers reached vLLM's stats.
        return self._sched is not None and self._sched.has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return ()  # sparkcache emits no KV cache events (stored entries are not GPU blocks)

    @property
    def attribution_records(self) -> list:
        return self._sched.records if self._sched is not None else []

    # ============================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds each step's metadata before its forward (start_load_kv may come after it)
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, SparkcacheConnectorMetadata):
            with self._in_step():
                self._worker.hold.step(connector_metadata.prefill_tokens)

    # **kwargs of the two hooks below, typed as in vLLM's signatures: whatever vLLM passes, unused
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SparkcacheConnectorMetadata)
        with self._in_step():
            for plan in meta.captures:
                self._worker.capture(plan)
        for plan in meta.loads:  # timed on their own (restore_seconds)
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # captures happen once per finished request, from the blocks vLLM holds for us

    def wait_for_save(self) -> None:
        # After the forward: a hybrid capture copies the state this step wrote.
        if self._worker is not None:
            with self._in_step():
                self._worker.hold.step_done()
                self._worker.capture_after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        self._worker.hold.step_done()  # the forward is done (vLLM may skip wait_for_save)
        with self._in_step():
            sending, recving, failed = self._worker.take_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Asynchronous loads report failures per request (failed_recving): safe for hybrid
        # layouts; synchronous ones (single KV group only) as their destination blocks.
        return self._worker.take_invalid_block_ids() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> SparkcacheStats | None:
        with self._in_step():
            return self._take_stats()

    def _take_stats(self) -> SparkcacheStats | None:
        stats = SparkcacheStats()
        if self._sched is not None:
            for k, v in self._sched.take_counters().items():
                stats.add(k, v)
            stats.set_gauge("pending_block_frees", len(self._sched.awaiting_send) +
                            len(self._sched.awaiting_recv_free))
            stats.set_gauge("unsettled_captures", len(self._sched.unsettled))
            for name, values in self._sched.samples.take().items():
                stats.observe(name, values)
        if self._worker is not None:
            counters, gauges = self._worker.take_stats(time.monotonic())
            for k, v in counters.items():
                stats.add(k, v)
            for k, v in gauges.items():
                stats.set_rank_gauge(self.rank, k, v)
            for name, values in self._worker.take_observations().items():
                stats.observe(name, values)
        return None if stats.is_empty() else stats

    def build_connector_worker_meta(self) -> SparkcacheWorkerMetadata | None:
        # Called after get_kv_connector_stats in the same step: the settled captures it
        # names are already counted in the stats shipped with this step.
        if self._worker is None:
            return None
        settled = self._worker.take_settled()
        loaded, failed = self._worker.take_sync_outcomes()
        self._worker.samples.add("worker_step_seconds", self._take_step_s())  # a step's last worker hook
        return SparkcacheWorkerMetadata(settled, loaded, failed) if settled or loaded or failed else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SparkcacheStats:
        # ``data`` typed as in vLLM's signature: ``SparkcacheStats.data``, plain dicts across processes
        return SparkcacheStats(data=dict(data)) if data else SparkcacheStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> SparkcachePromMetrics:
        return SparkcachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()  # its pending uploads get SPARKCACHE_REMOTE_DRAIN_SECONDS
        if self._sched is not None and self._sched.remote is not None:
            self._sched.remote.close()  # running fetches are abandoned (they end by their deadline)
