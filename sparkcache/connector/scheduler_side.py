"""Scheduler half: offers, load plans, capture decisions, delayed frees and attribution
(the units of several ranks' shards are ``shard_units.ShardUnits``'s).

Per request it keeps one ``_ReqState``. The flow:

- ``get_num_new_matched_tokens(request, n_local)``: the longest stored prefix for the
  request's identity, in whole blocks, never the last prompt token; only what lies beyond
  ``n_local`` is offered (with the prefer-local transform the scheduler passes the local
  attention depth, so resident pages are never offered). Spans shorter than
  ``min_span_tokens`` are not offered. With ``sync_loads`` (attention-only, one KV group)
  the load is synchronous: the request is scheduled in this step and the worker reads,
  verifies and places the pages before the forward; a failure is reported as invalid
  blocks (vLLM recomputes every one of them, whatever a refused read left in them) and in
  the worker meta. Otherwise
  loads are asynchronous, so a failure can be reported per request (``failed_recving``),
  which also works for hybrid models, at the price of one more engine step.
  With a shared tier (``SPARKCACHE_REMOTE_BUCKET``), when the local store offers fewer blocks
  than the prompt could use, every rank's shard is fetched from it off this thread
  (``remote_fetches``) while vLLM is answered None (it skips the request this step and asks
  again); once the fetch ended (by its deadline at the latest) the local lookup is done again.
  vLLM steps again at once after a skip (a millisecond's sleep), so a step that scheduled
  nothing, with no load in flight, waits for a running fetch up to ``idle_fetch_wait_s``
  at its end (``wait_for_fetches_when_idle``): otherwise every step of an engine with nothing
  else to do would be an empty forward on every worker, back to back, taking the CPUs the
  fetch itself needs.
- ``update_state_after_alloc``: a load plan (keys, first block, destination blocks).
- ``build_connector_meta``: hands load and capture plans to the workers and records each
  admission for attribution.
- ``request_finished``: emits the attribution record; decides capture by access mode and
  minimum span; delays the free (a lease with the lease transform) until the workers
  copied the pages out (``finished_sending``), or until an in-flight load
  is reported (``finished_recving``).
- Hybrid layouts (``kv_layout.LayoutKind.HYBRID``): an entry is pages plus a boundary object
  at its last block (the recurrent state, the sliding windows), which exists only for a
  while. vLLM offers a boundary state (``kv_connector_block_state.boundary_state_offloads``)
  in the step whose forward writes it; by the time the request finishes that block is gone,
  and so are the blocks behind a window. So captures are planned in ``build_meta``: from
  those offers (the boundaries at or past the prompt's last full block: the prompt, and
  decode-time checkpoints where vLLM keeps them), or, for windows without recurrent state,
  at the prompt's last full block in the step that computes past it; the workers copy
  pages and boundary object after that step's forward (``wait_for_save``), while every
  block is still the request's. Offers look up entries with a boundary object at exactly
  their depth (``with_state``), and a load places pages to depth N and that object, or
  nothing.
- ``has_pending_push_work``: true while a planned capture is not yet settled by every
  worker (published, failed or skipped: reported in the worker meta), a lone shard found
  at a settlement awaits its removal (``shard_units``), or counters are waiting to be
  taken. vLLM then keeps stepping an otherwise idle engine, and each step
  carries our stats to ``/metrics``; without it the numbers of the last request (the
  publication finishing after its last step, or attribution counted on an abort outside
  a step) would stay in the processes until the next request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparkcache.store.manifests import PageRef, pages_needed

if TYPE_CHECKING:  # for readers and type checkers; never imported at run time here
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from sparkcache.settings import Settings
    from sparkcache.store import EntryHandle, Identity, PageStore

    from .remote_fetches import RemoteFetches, UnitFetch

from .attribution import AttributionRecord, InputKind, emit
from .capture_plans import CapturePlan, CapturePlanner
from .identity import AdapterFingerprints
from .keys import BlockKeys, request_extra_keys, request_window_keys
from .kv_layout import KVLayout, LayoutKind
from .samples import Samples, add_count
from .shard_units import ShardUnits

logger = logging.getLogger("sparkcache.connector")

RESTORING_MODES = ("read-write", "restore-only")
CAPTURING_MODES = ("read-write", "store-only")


@dataclass(frozen=True)
class StoredPages:
    """The stored pages a load reads: pages ``first_page ..`` of an entry of ``block_count``
    blocks in pages of ``blocks_per_page``, found by a lookup under ``identity_digest``. The
    scheduler's lookup hands them to the worker so a restore does not look the entry up
    again; the bytes are still verified (against the XXH3-128 the manifest records) when read,
    and an object gone since the lookup fails the load (recompute)."""
    entry_id: str
    identity_digest: str
    first_page: int
    block_count: int
    blocks_per_page: int
    pages: tuple[PageRef, ...]
    state: PageRef | None = None  # the recurrent state at end_block (hybrid entries ending there)

    @classmethod
    def of(cls, handle: EntryHandle, start_block: int, end_block: int) -> "StoredPages":
        """The pages of ``handle`` (an ``EntryHandle``) that hold blocks [start, end), and its
        state when the entry ends exactly at ``end_block``."""
        bpp = handle.blocks_per_page
        first = start_block // bpp
        state = handle.state if end_block == handle.block_count else None
        return cls(handle.entry_id, handle.identity_digest, first, handle.block_count, bpp,
                   tuple(handle.pages[first:pages_needed(end_block, bpp)]), state)


@dataclass
class LoadPlan:
    req_id: str
    keys: list[str]           # keys of blocks [0, end_block)
    start_block: int          # first block to place (blocks before it are local)
    block_ids: list[list[int]]  # per KV group: destination block ids of [start_block, end_block)
    sync: bool = False        # placed before this step's forward; failures as invalid blocks
    stored: StoredPages | None = None  # what the scheduler's lookup found (None: look it up)


@dataclass
class _ReqState:
    request: Request
    keys: BlockKeys
    record: AttributionRecord
    last_query: tuple[int, int] = (0, 0)   # (n_local asked with, tokens offered)
    last_found: EntryHandle | None = None  # behind the last offer
    load_plan: LoadPlan | None = None      # planned, not yet reported by the workers
    load_tokens: int = 0
    load_done_ok: int = 0                  # restored tokens reported ok, not yet consumed
    sync_load_tokens: int = 0              # synchronous load planned this step, not yet admitted
    sync_consumed: int = 0                 # external tokens of the synchronous load admitted
    restore_refused: bool = False
    remote_entry: str | None = None        # rank 0's entry fetched from the shared tier for it
    load_remote: bool = False              # its load reads that entry (attribution: remote_tokens)
    finished: bool = False
    unsupported: str | None = None         # why this request is neither offered nor captured


@dataclass
class SchedulerCounters:
    data: dict = field(default_factory=dict)

    def add(self, name: str, n: float = 1) -> None:
        add_count(self.data, name, n)


# How long a step that scheduled nothing waits for a running fetch (the module docstring): the
# bound on what a request arriving meanwhile waits more, and on the idle engine's step rate
# while a fetch runs.
IDLE_FETCH_WAIT_S = 0.02


class SchedulerSide:
    def __init__(self, settings: Settings, identities: tuple[Identity, ...], stores: tuple[PageStore, ...] | None,
                 block_size: int, layout: KVLayout, num_groups: int, remote: RemoteFetches | None = None) -> None:
        self.settings = settings
        self.remote = remote  # fetches from the shared tier on a local miss (None: no bucket)
        self.mode = settings.access_mode if settings.enabled else "disabled"
        self.identities = identities  # one per rank's shard (``shard_identities``); rank 0's first
        # the store holding each rank's shards (one object for all when they share a root);
        # None: no store to read (disabled, or restore-only with nothing stored)
        self.stores = stores
        self._capture_sent: dict[str, float] = {}  # req_id -> when its last capture was planned
        self.samples = Samples()                    # capture waits, for the histogram
        self.block_size = block_size
        self.layout = layout
        self.num_groups = num_groups
        self.bpp = settings.page_blocks
        # vLLM maps invalid block ids back to requests only for a single KV group.
        self.sync_loads = settings.sync_loads and self.attention_only and num_groups == 1
        self.reqs: dict[str, _ReqState] = {}
        self.loads_to_send: list[LoadPlan] = []
        self.captures_to_send: list[CapturePlan] = []
        self.awaiting_send: set[str] = set()      # delayed frees owed by finished_sending
        self.awaiting_recv_free: set[str] = set()  # finished while loading: owed by finished_recving
        # finished in the step whose forward placed their synchronous load: tokens, until the
        # workers report it (vLLM frees a request before it hands over the connector output)
        self.sync_unreported: dict[str, int] = {}
        self.counters = SchedulerCounters()
        # several ranks' shards per entry: kept whole (None: one rank, or nothing to write)
        self.units = (ShardUnits(identities, stores, self.counters)
                      if len(identities) > 1 and self.mode in CAPTURING_MODES and stores else None)
        self.records: list[AttributionRecord] = []  # finished records (bounded)
        self.num_workers = 1                      # worker reports expected per capture plan
        self.settle_timeout_s = 120.0
        self.unsettled: dict[str, tuple[int, float]] = {}  # req_id -> (reports owed, deadline)
        self.adapters = AdapterFingerprints()
        self.planner = CapturePlanner(layout, block_size, self.bpp, num_groups, settings.min_span_tokens,
                                      lambda keys, with_state: self._stored_depth(keys, with_state)[0])
        self.after_reset = False                  # vLLM reset the connector's cache: stop
        self.idle_fetch_wait_s = IDLE_FETCH_WAIT_S  # 0: never (data parallel: see the connector)

    @property
    def store(self) -> PageStore | None:
        """Rank 0's store (the only one unless ROOT holds ``{rank}``)."""
        return self.stores[0] if self.stores else None

    @property
    def identity(self) -> Identity:
        """Rank 0's identity (the one the scheduler itself is made with)."""
        return self.identities[0]

    @property
    def attention_only(self) -> bool:
        """Entries are pages only, captured when a request finishes."""
        return self.layout.kind is LayoutKind.ATTENTION

    @property
    def hybrid(self) -> bool:
        """Entries are pages plus the recurrent state at their end."""
        return self.layout.kind is LayoutKind.HYBRID

    # ------------------------------------------------------------------ requests

    def state(self, request: Request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request, BlockKeys(self.block_size, lookahead=self.layout.lookahead),
                           AttributionRecord(request.request_id, int(request.num_prompt_tokens)))
            self.reqs[request.request_id] = st
            if self.store is not None and self.mode != "disabled" and self._usable(st):
                fingerprint = None
                if request.lora_request:
                    fingerprint, reason = self.adapters.check(request.lora_request)
                    if reason:
                        self._skip(st, reason)
                st.keys = BlockKeys(self.block_size, request_extra_keys(request, fingerprint),
                                    self.layout.lookahead, request_window_keys(request))
        return st

    def _usable(self, st: _ReqState) -> bool:
        """Whether this request's KV may be offered or captured. Asked before every offer
        and capture: vLLM can reset the connector's cache (after a weight update)."""
        if st.unsupported is None and self.after_reset:
            self._skip(st, "after_reset")
        return st.unsupported is None

    def _skip(self, st: _ReqState, reason: str) -> None:
        """``reason``: one of ``sparkcache.metrics.SKIP_REASONS`` (the counter's labels)."""
        st.unsupported = reason
        self.counters.add("skipped_" + reason)

    def _keys(self, st: _ReqState, n_blocks: int) -> list[str] | None:
        """The keys of the first ``n_blocks`` blocks (fewer where the tokens a key looks ahead
        at are not known yet); None (and the request skipped) when an extra key has no
        encoding, so a bad input cannot stop the scheduler's loop."""
        try:
            return st.keys.upto(st.request.all_token_ids, n_blocks)
        except (TypeError, OverflowError) as exc:
            logger.warning("sparkcache: %s is not offered or captured: %s", st.request.request_id, exc)
            self._skip(st, "unencodable_input")
            return None

    def stop_after_reset(self) -> None:
        """vLLM reset the connector's cache, as it does after updating the weights in place:
        stored entries may no longer match the weights this process runs (and its KV would
        be stored under the old weights' identity), so nothing is offered or captured again
        until vLLM restarts."""
        if not self.after_reset:
            logger.warning("sparkcache: vLLM reset the connector cache (as after a weight "
                           "update); no restores or captures until vLLM restarts")
        self.after_reset = True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self.state(request)
        st.last_found = None
        st.last_query = (num_computed_tokens, 0)
        if (self.mode not in RESTORING_MODES or self.store is None or st.restore_refused
                or self.layout.kind is LayoutKind.UNSUPPORTED):
            return 0, False
        bs = self.block_size
        n_blocks = (request.num_tokens - 1) // bs  # never the last token
        if n_blocks * bs <= num_computed_tokens or not self._usable(st):
            return 0, False
        keys = self._keys(st, n_blocks)
        if keys is None:
            return 0, False
        # while its fetch runs the request is not looked up locally (the fetch writes there)
        fetching = self.remote is not None and self.remote.running(request.request_id)
        depth, handle = (0, None) if fetching else self._stored_depth(keys, with_state=self.hybrid)
        if fetching or self._worth_fetching(st, depth, n_blocks, num_computed_tokens):
            outcome = self.remote.poll(request.request_id, keys)
            if outcome is None:  # fetching: vLLM skips the request this step and asks again
                return None, False
            self._fetched(st, outcome)
            depth, handle = self._stored_depth(keys, with_state=self.hybrid)  # what is local now
        offered = depth * bs - num_computed_tokens
        if offered < max(1, self.settings.min_span_tokens):
            offered = 0
        st.last_query = (num_computed_tokens, offered)
        if offered:
            st.last_found = handle
        return offered, offered > 0 and not self.sync_loads

    def _worth_fetching(self, st: _ReqState, depth: int, n_blocks: int, num_computed: int) -> bool:
        """Whether to ask the shared tier: the local store offers fewer blocks than the prompt
        could use, by at least ``min_span_tokens``, and this request was not fetched for yet."""
        if self.remote is None or self.remote.is_done(st.request.request_id):
            return False
        gain = n_blocks * self.block_size - max(depth * self.block_size, num_computed)
        return gain >= max(1, self.settings.min_span_tokens)

    def _fetched(self, st: _ReqState, outcome: UnitFetch) -> None:
        self.samples.add("remote_fetch_wait_seconds", outcome.duration_s)
        self.counters.add("remote_request_fetch_hit" if outcome.hit else "remote_request_fetch_miss")
        st.remote_entry = outcome.entry_ids[0] if outcome.hit else None
        if not outcome.hit:
            logger.debug("sparkcache: %s not fetched from the shared tier: %s", st.request.request_id,
                         ", ".join(r.value for r in outcome.reasons))

    def _stored_depth(self, keys: list[str], with_state: bool = False) -> tuple[int, EntryHandle | None]:
        """How many leading blocks of ``keys`` every rank's shard holds (``with_state``: the
        deepest depth at which every rank's entry ends with its recurrent state), and rank
        0's entry handle there. One rank's shard missing or shallower lowers the depth for
        all: vLLM restores all ranks or none, so an offer another rank cannot honour would
        cost a read, a refusal and a recompute, and a capture that sees it missing publishes
        it again. Every lookup refreshes that rank's entry in LRU order, so ranks age alike."""
        depth, handle = len(keys), None
        while True:  # ends: a pass that does not settle lowers the depth, a miss returns
            settled = True
            for rank, identity in enumerate(self.identities):
                found = self.stores[rank].lookup(identity, keys[:depth], with_state=with_state)
                if not found.hit:
                    self.counters.add("lookup_miss_" + found.reason)
                    return 0, None
                if found.hit_blocks < depth:
                    depth, settled = found.hit_blocks, False
                elif rank == 0:
                    handle = found.handle
            if settled:
                return depth, handle

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self.state(request)
        local, offered = st.last_query
        if offered != num_external_tokens:  # the scheduler reconciled to another boundary
            logger.debug("sparkcache: %s allocated %d external tokens, last offer %d at %d",
                         request.request_id, num_external_tokens, offered, local)
        bs = self.block_size
        start = local // bs
        end = start + num_external_tokens // bs
        group_ids = blocks.get_block_ids()
        found = st.last_found
        stored = StoredPages.of(found, start, end) if found is not None and end <= found.block_count else None
        st.load_remote = found is not None and found.entry_id == st.remote_entry
        plan = LoadPlan(request.request_id, self._keys(st, end), start,
                        [list(ids[start:end]) for ids in group_ids], sync=self.sync_loads, stored=stored)
        if plan.sync:  # placed in this step, before the forward: nothing stays in flight
            st.sync_load_tokens = num_external_tokens
        else:
            st.load_plan, st.load_tokens = plan, num_external_tokens
        self.loads_to_send.append(plan)
        self.counters.add("offered_tokens", num_external_tokens)

    # ------------------------------------------------------------------ per step

    def build_meta(self, scheduler_output: SchedulerOutput) -> tuple[list[LoadPlan], list[CapturePlan]]:
        if self.units is not None:
            self.units.tick()
        if self.hybrid:
            self._plan_boundary_captures(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self._admitted(new.req_id, new.num_computed_tokens, scheduler_output, resumed=False)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            if req_id in resumed:
                self._admitted(req_id, cached.num_computed_tokens[i], scheduler_output, resumed=True)
            else:
                self._progress(st, cached.num_computed_tokens[i], scheduler_output)
        loads, captures = self.loads_to_send, self.captures_to_send
        self.loads_to_send, self.captures_to_send = [], []
        return loads, captures

    def wait_for_fetches_when_idle(self, scheduler_output: SchedulerOutput) -> None:
        """At the end of a step that scheduled nothing, with no load in flight (nothing that
        step could delay but requests arriving meanwhile): wait until a running fetch ends, at
        most ``idle_fetch_wait_s``, before vLLM sends the empty step to the workers and
        schedules again (the module docstring)."""
        if (self.remote is None or self.idle_fetch_wait_s <= 0 or scheduler_output.total_num_scheduled_tokens
                or not self.remote.pending() or any(st.load_plan is not None for st in self.reqs.values())):
            return
        self.remote.wait(self.idle_fetch_wait_s)

    def _plan_boundary_captures(self, out: SchedulerOutput) -> None:
        """Captures of entries ending in a boundary object, planned in the step whose forward
        writes it (module docstring; ``capture_plans``)."""
        block_state = getattr(out, "kv_connector_block_state", None)
        if self.mode not in CAPTURING_MODES or self.store is None or block_state is None:
            return
        if self.layout.state_groups:  # where vLLM offers every recurrent group's state
            wanted = {req_id: self.planner.offered_boundaries(st.record.prompt_tokens, offers)
                      for req_id, offers in block_state.boundary_state_offloads.items()
                      if (st := self.reqs.get(req_id)) is not None}
        else:  # windows alone: the prompt boundary, in the step computing past it
            before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
            cached = out.scheduled_cached_reqs
            before.update(zip(cached.req_ids, cached.num_computed_tokens))
            wanted = {}
            for req_id, scheduled in out.num_scheduled_tokens.items():
                st = self.reqs.get(req_id)
                n = None if st is None or req_id not in before else \
                    self.planner.crossed_prompt_boundary(st.record.prompt_tokens, before[req_id], scheduled)
                if n is not None:
                    wanted[req_id] = [(n, [])]
        for req_id, boundaries in wanted.items():
            st = self.reqs[req_id]
            table = block_state.get_block_ids(req_id)
            for n_blocks, state_ids in boundaries:
                if table is None or not self._usable(st):
                    break
                plan = self.planner.at_boundary(req_id, self._keys(st, n_blocks), table, n_blocks, state_ids)
                if plan is not None:
                    self._send_capture(plan)

    def _send_capture(self, plan: CapturePlan) -> None:
        self.captures_to_send.append(plan)
        owed, _ = self.unsettled.get(plan.req_id, (0, 0.0))
        self.unsettled[plan.req_id] = (owed + self.num_workers, time.monotonic() + self.settle_timeout_s)
        if self.units is not None:
            self.units.planned(plan.req_id, plan.keys[-1])
        self._capture_sent[plan.req_id] = time.monotonic()

    def _admitted(self, req_id: str, num_computed: int, out: SchedulerOutput, resumed: bool) -> None:
        st = self.reqs.get(req_id)
        if st is None:
            return
        consumed = 0
        if st.load_done_ok and num_computed >= st.load_done_ok:
            consumed = st.load_done_ok  # the restore is consumed by this admission
        elif st.sync_load_tokens and num_computed >= st.sync_load_tokens:
            consumed = st.sync_load_tokens  # placed before this step's forward (undone on failure)
        st.sync_consumed = consumed if st.sync_load_tokens else 0
        st.load_done_ok = st.sync_load_tokens = 0
        st.record.admit(num_computed, consumed, resumed=resumed, remote=st.load_remote)
        self._progress(st, num_computed, out)

    def _progress(self, st: _ReqState, num_computed: int, out: SchedulerOutput) -> None:
        scheduled = out.num_scheduled_tokens.get(st.request.request_id, 0)
        if scheduled and num_computed + scheduled >= st.record.prompt_tokens:
            st.record.mark_prefill_done()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        failed = set(output.failed_recving or ())
        for req_id in output.finished_recving or ():
            st = self.reqs.get(req_id)
            if req_id in self.awaiting_recv_free:
                self.awaiting_recv_free.discard(req_id)
                self.reqs.pop(req_id, None)
                if st is not None:
                    self._count_restore(req_id not in failed, st.load_tokens)
                continue
            if st is None or st.load_plan is None:
                continue  # late or unknown: ignore
            self._count_restore(req_id not in failed, st.load_tokens)
            if req_id in failed:
                st.restore_refused = True
                st.record.failed_restores += 1
            else:
                st.load_done_ok = st.load_tokens
            st.load_plan, st.load_tokens = None, 0
        for req_id in output.finished_sending or ():
            self.awaiting_send.discard(req_id)
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        for req_id in getattr(worker_meta, "sync_loaded", ()) or ():
            st = self.reqs.get(req_id)
            if st is not None:
                self._count_restore(True, st.sync_consumed)
                st.sync_consumed = 0
            elif req_id in self.sync_unreported:
                self._count_restore(True, self.sync_unreported.pop(req_id))
        for req_id in getattr(worker_meta, "sync_failed", ()) or ():
            # Nothing was placed; vLLM recomputes from the first invalid block (or fails the
            # request, with kv_load_failure_policy="fail").
            st = self.reqs.get(req_id)
            if st is None:
                if self.sync_unreported.pop(req_id, None) is not None:
                    self._count_restore(False, 0)
                continue
            st.restore_refused = True
            st.record.failed_restores += 1
            st.record.restore_undone(st.sync_consumed)
            st.sync_consumed = 0
            self._count_restore(False, 0)
        for req_id in getattr(worker_meta, "settled", ()) or ():
            owed, deadline = self.unsettled.get(req_id, (0, 0.0))
            if owed > 1:
                self.unsettled[req_id] = (owed - 1, deadline)
            else:
                self.unsettled.pop(req_id, None)
                if self.units is not None:
                    self.units.settled(req_id)
                sent = self._capture_sent.pop(req_id, None)
                if sent is not None:
                    self.samples.add("capture_wait_seconds", time.monotonic() - sent)

    def _count_restore(self, ok: bool, tokens: int) -> None:
        """One request's restore, counted once: vLLM reports it (the union of every rank's
        refusals) here, however many ranks placed their shards; bytes are the workers'."""
        self.counters.add("restores_ok" if ok else "restores_failed")
        if ok:
            self.counters.add("restored_tokens", tokens)
        if self.layout.has_state:
            self.counters.add("state_restores_ok" if ok else "state_restores_failed")

    # ------------------------------------------------------------------ finish

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        st = self.state(request)
        status = str(getattr(request.status, "name", request.status))
        record = st.record.finish(status, InputKind.of(request))
        emit(record)
        self.records.append(record)
        del self.records[:-1024]
        self.counters.add("attr_requests_complete" if record.complete else "attr_requests_incomplete")
        self.counters.add("attr_local_hit_tokens", record.local_hit_tokens)
        self.counters.add("attr_external_tokens", record.external_tokens)
        self.counters.add("attr_external_tokens_" + record.input.value, record.external_tokens)
        self.counters.add("attr_recomputed_tokens", record.recomputed_tokens)
        self.counters.add("attr_remote_tokens", record.remote_tokens)
        if self.remote is not None:
            self.remote.forget(request.request_id)
        params = {"sparkcache": record.public()}
        if st.load_plan is not None:
            # A load is in flight into these blocks: keep them until the workers report it.
            self.awaiting_recv_free.add(request.request_id)
            return True, params
        self.reqs.pop(request.request_id, None)
        if st.sync_consumed:  # its synchronous load is reported after this call
            self.sync_unreported[request.request_id] = st.sync_consumed
            while len(self.sync_unreported) > 1024:  # a report that never comes is not kept forever
                del self.sync_unreported[next(iter(self.sync_unreported))]
        plan = self._capture_plan(st, request, block_ids)
        if plan is None:
            return False, params
        self._send_capture(plan)
        self.awaiting_send.add(request.request_id)
        return True, params

    def _capture_plan(self, st: _ReqState, request: Request, block_ids: tuple[list[int], ...]) -> CapturePlan | None:
        if (self.mode not in CAPTURING_MODES or self.store is None or not self.attention_only
                or not self._usable(st)):
            return None
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        return self.planner.at_finish(request.request_id, lambda n: self._keys(st, n), computed, block_ids)

    def has_pending_block_frees(self) -> bool:
        return bool(self.awaiting_send or self.awaiting_recv_free)

    def has_pending_push_work(self, now: float | None = None) -> bool:
        """Keep vLLM stepping until every planned capture settled, every lone shard found at
        the settlement is removed (or its retries ended) and counters were taken."""
        now = time.monotonic() if now is None else now
        self._take_remote_counts()
        lone = self.units is not None and self.units.pending(now)
        if self.unsettled:
            for req_id, (_, deadline) in list(self.unsettled.items()):
                if now > deadline:  # a lost report must not keep the engine busy forever
                    logger.warning("sparkcache: no publication report for %s after %.0f s; "
                                   "not waiting for it", req_id, self.settle_timeout_s)
                    del self.unsettled[req_id]
                    if self.units is not None:
                        self.units.dropped(req_id)
                    self._capture_sent.pop(req_id, None)
        return bool(self.unsettled or self.counters.data or lone)

    def _take_remote_counts(self) -> None:
        """The shared tier's counts (its fetches, on its threads) into this half's counters."""
        if self.remote is not None:
            for key, n in self.remote.drain_counts().items():
                self.counters.add(key, n)

    def take_counters(self) -> dict:
        self._take_remote_counts()
        data, self.counters.data = self.counters.data, {}
        return data

