"""Worker half: verified restores into vLLM's blocks, captures into bounded slots.

Page format (one store object per page of ``page_blocks`` blocks): for every attention
layer, in KV-group order and the group's layer order, that layer's blocks of the page,
block after block, each as the logical ``[heads, tokens, content]`` array of the manager
block, whatever the physical stride order and however vLLM splits blocks into kernel blocks
(``kv_copy``, which does every tensor operation here). A page whose size does not match this
layout is refused like a corrupt one.

Restores read the pages the scheduler's lookup found (``LoadPlan.stored``; no second
lookup), with system calls (so a failing disk or a file truncated under the reader is a
refused restore, never a signal), and verify each against the XXH3-128 its manifest records.
Where the KV cache is in host memory and each block's bytes are one run in page order (vLLM's
CPU backend), a page is read straight into its destination blocks and verified there, so the
read is the placement (the local object backend's ``LocalBackend.read_verified_into``), every
page object checked present first; elsewhere (an accelerator; blocks vLLM splits into kernel blocks) each object goes
through a ring of host buffers (``restore_ring``: read and verified into a slot, then placed,
at most the ring's slots in host memory at once; on CUDA page-locked and copied on a load
stream, a synchronous load ordering the forward after it, an asynchronous one read on a loader
thread and reported once its copies are done), the objects checked present first. A refused
restore (corrupt, absent, unreadable) reports all of its destination blocks: an asynchronous
load's request in ``finished_recving`` and ``failed_recving``, a
synchronous one's (``plan.sync``: placed before this step's forward) blocks as invalid
(``get_block_ids_with_load_errors``) and the request in the worker meta (``sync_failed``);
with ``kv_load_failure_policy="recompute"`` vLLM recomputes every one of those blocks, so what
a refused read left in them is never used, and no byte outside them is written. Hybrid
models (``kv_layout.LayoutKind.HYBRID``): a restore reads the pages and the recurrent state
of the entry ending exactly at the load's depth, verifies all of them, then places the
boundary object (never before every page verified): the state in each recurrent group's
block of the last column, each window group's window in the columns before the depth that
the request does not hold from its local prefix cache; a capture copies both after the
forward that wrote the state (``wait_for_save``).
Other layouts: restores are refused and captures skipped.

A writing worker (read-write, store-only) also runs the store's maintenance
(``worker_maintenance``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from sparkcache.metrics import store_gauges
from sparkcache.store import cpus
from sparkcache.store import ObjectError
from sparkcache.store.layout import done_now, submit
from sparkcache.store.manifests import pages_needed
from sparkcache.store.reasons import Reason
from sparkcache.store.remote_tier import RemoteTier
from sparkcache.store.streams import PageSourceError, PageStream

from . import kv_copy, restore_ring
from .capture_plans import NULL_BLOCK_ID, CapturePlan
from .capture_slots import CaptureSlots, CaptureSlotStats
from .kv_layout import KVLayout, LayoutKind
from .prefill_hold import PrefillHold
from .samples import Samples, add_count
from .scheduler_side import LoadPlan, StoredPages
from .worker_maintenance import WorkerMaintenance

if TYPE_CHECKING:  # for readers and type checkers; never imported at run time here
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from sparkcache.settings import Settings
    from sparkcache.store import Identity, PageStore, PublishResult

logger = logging.getLogger("sparkcache.connector")

# How long a thread that wants the GIL waits at most for one running Python code to hand it
# over, while a writing worker's background threads (publisher, maintenance) run in vLLM's
# worker process. At Python's default the model's thread, which takes the GIL back after
# every torch op of a forward, waited behind them op after op (Report B's first-token
# latency; docs/RESULTS.md, "Report B on the engine: the model's thread waited for the GIL").
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class _PublishJob:
    """One capture's publication. A streamed job's pages are copied ``chunk_blocks`` blocks at
    a time (the first chunk when the plan arrives: by the copier thread on an accelerator, by
    the model's thread on the CPU; the rest by the publisher) from the blocks vLLM holds for
    it until ``finished_sending``; another's were copied into its slot before it was queued."""

    req_id: str
    keys: list[str]
    reuse_pages: int  # leading pages a stored entry holds (published as None)
    layers: list[tuple[kv_copy.BlockView, list[int]]]  # the page layers and their source ids
    chunk_blocks: int
    queued_at: float  # time.monotonic() when the plan arrived
    marker: object | None = None  # streamed, on an accelerator: the event its copies wait for
    first: Future | None = None  # streamed: the copy of its first chunk
    pages: list[memoryview] | None = None  # copied already: the new pages; None: streamed
    state: memoryview | None = None
    released: bool = False  # streamed: reported in finished_sending (exactly once)


class WorkerSide:
    def __init__(self, settings: Settings, identity: Identity, store: PageStore | None,
                 kv_cache_config: KVCacheConfig, layout: KVLayout) -> None:
        self.settings = settings
        self.identity = identity
        self.identity_digest = identity.digest()  # compared with every load plan's
        self.store = store
        self.bpp = settings.page_blocks
        self.layout = layout
        self.group_layers = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        self.num_blocks = int(kv_cache_config.num_blocks)  # manager blocks per layer
        self.after_forward: list[CapturePlan] = []  # hybrid capture plans, copied in wait_for_save
        self.views: dict[str, kv_copy.BlockView] = {}  # the stored layers, by manager block
        self.read_in_parallel = True  # see register_kv_caches
        self._memory: dict[str, memoryview | None] = {}  # page layers' block memory (register_kv_caches)
        self._into_blocks = False  # restores read pages straight into the blocks
        self._ring: restore_ring.RestoreRing | None = None  # restores that cannot (register_kv_caches)
        self._loader: ThreadPoolExecutor | None = None  # asynchronous loads on an accelerator
        self._loading: list[tuple[LoadPlan, float, Future]] = []  # theirs: plan, start, outcome
        self.finished_sending: set[str] = set()
        self._released: set[str] = set()  # streamed captures copied (publisher thread, under the lock)
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid_block_ids: set[int] = set()   # synchronous loads that failed, this step
        self.sync_loaded: list[str] = []
        self.sync_failed: list[str] = []
        self.counters: dict[str, float] = {}
        self._counters_lock = threading.Lock()  # the publication thread counts too
        self.samples = Samples()  # restore and publication times and sizes
        self._settled: list[str] = []       # capture plans with a final outcome, not yet taken
        self._settled_reported: list[str] = []  # taken with the last stats, for the worker meta
        self._gauges_at = float("-inf")
        self.slots: CaptureSlots[_PublishJob, str] | None = None  # tagged by request id
        self._slot_stats_taken = CaptureSlotStats()  # the slots' counts at the last take_stats
        self.maintenance: WorkerMaintenance | None = None
        self.hold = PrefillHold()  # publication and maintenance hold still while a step prefills
        self.remote: RemoteTier | None = None  # the shared tier this rank uploads to (writing workers)
        if store is not None and settings.access_mode in ("read-write", "store-only"):
            # before the publisher and maintenance threads start: they move off these CPUs
            model_cpus = cpus.note_model_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
            logger.info("sparkcache: the model's CPUs (this worker's pin, every rank's listed in "
                        "VLLM_CPU_OMP_THREADS_BIND) %s; publication and "
                        "maintenance run on the other allowed ones, if any", sorted(model_cpus))
            self.slots = CaptureSlots(settings.capture_slots, settings.capture_slot_bytes,
                                      self._publish, self._host_buffer)
            # copies a streamed capture's first chunk out of an accelerator as soon as its plan
            # arrives, off the model's CPUs and at the publisher's priority (those cores run
            # vLLM's engine core)
            self._copier = ThreadPoolExecutor(1, "sparkcache-copy", initializer=cpus.run_as_publisher)
            self._copier.submit(int)  # its thread starts now, not in the first capture's step
            self.maintenance = WorkerMaintenance(store, settings, self.hold.wait)  # keeps the store under max_bytes
            # the shared tier (SPARKCACHE_REMOTE_BUCKET set): what this rank publishes is
            # uploaded by the tier's thread, placed as the publisher is (off the model's CPUs)
            self.remote = RemoteTier.from_settings(settings, store)
            # for the process's life (a worker lives as long as vLLM's worker process)
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        if store is not None:
            spinning = cpus.note_spinning_cpus(os.environ)
            if spinning:
                logger.info("sparkcache: vLLM bound the model's OpenMP threads to CPUs %s; restores "
                            "read on the model's thread and on the other allowed CPUs", sorted(spinning))
            store.start_readers()  # after the model's CPUs are noted: the io pool is placed by them

    def take_observations(self) -> dict[str, list[float]]:
        """Histogram samples since the last call (restores, publications, maintenance passes)."""
        out = self.samples.take()
        if self.maintenance is not None:
            out.update(self.maintenance.samples.take())
        return out

    def _add(self, name: str, n: float = 1) -> None:
        """A counter's delta by data key, shipped with the next stats (declared in
        ``sparkcache/metrics.py``: an undeclared key raises here)."""
        with self._counters_lock:
            add_count(self.counters, name, n)

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The layers whose bytes are stored, by manager block (``kv_copy.block_view``: kernel
        blocks regrouped); a tensor that cannot be regrouped refuses the start
        (``kv_copy.KVCopyError`` names it and the fix)."""
        self.views = {}
        stored = () if self.layout.kind is LayoutKind.UNSUPPORTED else (
            *self.layout.page_groups, *self.layout.state_groups, *self.layout.window_groups)
        for g in stored:
            for name in self.group_layers[g]:
                t = kv_caches.get(name)
                if t is not None:
                    self.views[name] = kv_copy.block_view(name, t, self.num_blocks)
        ratios = sorted({v.ratio for v in self.views.values()})
        if ratios != [1] and ratios:
            logger.info("sparkcache: vLLM splits each KV cache block into %s kernel blocks; "
                        "pages are stored by manager block", "/".join(map(str, ratios)))
        # A KV cache in host memory means vLLM's CPU backend: the forward's OpenMP threads
        # hold the worker's cores (spinning between parallel regions), so a restore's pages
        # are read and hashed on this thread; on a pool they queue behind those threads
        # (docs/RESULTS.md, "Measurements behind the code").
        self.read_in_parallel = not any(v.device.type == "cpu" for v in self.views.values())
        if self.slots is not None and self._usable():
            self.slots.allocate_all()  # now, not in a capture's step (pinned on CUDA: seconds)
        # Blocks in host memory, each a run in page order: restores read pages into them.
        self._memory = {name: kv_copy.block_memory(self.views[name]) for _, name in self._page_layers()}
        self._into_blocks = bool(self._memory) and None not in self._memory.values()
        pages = [self.views[name] for _, name in self._page_layers()]
        if self.store is not None and self._usable() and self.views and not self._into_blocks:
            device = next(iter(self.views.values())).device  # a layout of windows alone has no pages
            self._ring = restore_ring.RestoreRing(self.bpp * sum(v.block_bytes for v in pages), device)
            if device.type != "cpu" and self._loader is None:
                self._loader = ThreadPoolExecutor(1, "sparkcache-load",
                                                  initializer=cpus.run_on_every_allowed_cpu)

    @property
    def kv(self) -> dict[str, torch.Tensor]:
        """Each stored layer's bytes by manager block (uint8, dim 0 the block id)."""
        return {name: view.blocks for name, view in self.views.items()}

    def _layers(self, group: int) -> list[str]:
        return [n for n in self.group_layers[group] if n in self.views]

    def _page_layers(self) -> list[tuple[int, str]]:
        """(group, layer) of every layer whose blocks make a page, in page byte order."""
        return [(g, n) for g in self.layout.page_groups for n in self._layers(g)]

    def _state_layers(self) -> list[tuple[int, str]]:
        """(index in ``state_groups``, layer) of every recurrent layer, in state byte order."""
        return [(k, n) for k, g in enumerate(self.layout.state_groups) for n in self._layers(g)]

    def _boundary_parts(self, n: int) -> list[tuple[list[str], int]]:
        """The boundary object of an entry of ``n`` blocks, part by part: (layers, blocks of
        each): every recurrent layer's state, then each window group's window."""
        parts = [([name for _, name in self._state_layers()], 1)] if self.layout.state_groups else []
        return parts + [(self._layers(g), k)
                        for g, k in zip(self.layout.window_groups, self.layout.windows_at(n))]

    def _boundary_bytes(self, n: int) -> int:
        return sum(k * sum(self._block_bytes(name) for name in layers)
                   for layers, k in self._boundary_parts(n))

    def _boundary_destinations(self, plan: LoadPlan) -> list | None:
        """Where a load's boundary object goes (``kv_copy.place_parts``): the state into
        column end - 1 of each recurrent group; a window into its columns before the end
        that the load allocated (those before ``start_block`` are the request's own, from
        vLLM's prefix cache). None: a destination is vLLM's null block (refused)."""
        end, start = len(plan.keys), plan.start_block
        parts = []
        if self.layout.state_groups:
            ids = [plan.block_ids[g][-1] for g in self.layout.state_groups]
            parts.append(([(self.views[name], [ids[k]]) for k, name in self._state_layers()], 1, 0))
        for g, k in zip(self.layout.window_groups, self.layout.windows_at(end)):
            first = max(end - k, start)
            ids = plan.block_ids[g][first - start:end - start]
            if NULL_BLOCK_ID in ids or len(ids) != end - first:
                return None
            parts.append(([(self.views[name], ids) for name in self._layers(g)], k, first - (end - k)))
        return parts

    def _block_bytes(self, name: str) -> int:
        return self.views[name].block_bytes

    def _host_buffer(self, nbytes: int) -> memoryview:
        """A capture slot's buffer: pinned when the KV cache is on a CUDA device."""
        return kv_copy.host_buffer(nbytes, pinned=any(v.device.type == "cuda" for v in self.views.values()))

    def _usable(self) -> bool:
        return (self.store is not None and bool(self.views)
                and self.layout.kind is not LayoutKind.UNSUPPORTED)

    # ------------------------------------------------------------------ restore

    def load(self, plan: LoadPlan) -> None:
        started = time.monotonic()
        if not plan.sync and self._loader is not None:
            # on an accelerator an asynchronous load leaves the model's thread: read and
            # verified on the loader thread, copied on the ring's stream after the forwards
            # queued so far, reported by ``take_results`` once its copies are done
            after = kv_copy.copy_marker([(view, ()) for view in self.views.values()])
            self._loading.append((plan, started, self._loader.submit(self._load, plan, after)))
            return
        placed = None
        try:
            placed = self._load(plan)
        except Exception:
            logger.exception("sparkcache: restore of %s failed", plan.req_id)
        self._finish_load(plan, started, placed)

    def _poll_loads(self) -> None:
        """Report the asynchronous loads whose reads and copies are done."""
        pending = []
        for plan, started, outcome in self._loading:
            placed = None
            if outcome.done():
                try:
                    placed = outcome.result()
                except Exception:
                    logger.exception("sparkcache: restore of %s failed", plan.req_id)
            if not outcome.done() or (placed is not None and not restore_ring.copied(placed[2])):
                pending.append((plan, started, outcome))
            else:
                self._finish_load(plan, started, placed)
        self._loading = pending

    def _finish_load(self, plan: LoadPlan, started: float, placed: tuple[int, int, object] | None) -> None:
        ok = placed is not None
        self.samples.add("restore_seconds", time.monotonic() - started)
        if plan.sync:
            (self.sync_loaded if ok else self.sync_failed).append(plan.req_id)
            if not ok:
                for ids in plan.block_ids[:1]:  # sync plans exist for one KV group only
                    self.invalid_block_ids.update(ids)
        else:
            self.finished_recving.add(plan.req_id)
            if not ok:
                self.failed_recving.add(plan.req_id)
        if ok:  # how many requests restored is the scheduler's count (once, not per rank)
            self._add("restored_page_bytes", placed[0])
            self._add("restored_state_bytes", placed[1])
            self.samples.add("restore_bytes", placed[0] + placed[1])

    def _load(self, plan: LoadPlan, after: object | None = None) -> tuple[int, int, object] | None:
        """Read, verify and place; returns the (page, state) bytes placed and the event after
        the copies on an accelerator (None: done), or None when the restore is refused
        (``load`` then reports every destination block to vLLM; a state is only placed once
        every page is verified). ``after``: the event those copies wait for (None: the
        calling thread's stream, now)."""
        if not self._usable():
            return None
        stored = self._stored_pages(plan)
        if stored is None:
            return None
        spans = self._page_spans(plan, stored)
        boundary = self._boundary_destinations(plan) if self.layout.has_state else []
        if spans is None or boundary is None:
            if boundary is None:
                logger.warning("sparkcache: restore of %s refused: vLLM allocated no block for a "
                               "column of its window", plan.req_id)
            return None
        try:
            if not self._into_blocks:
                return self._read_through_ring(plan, stored, spans, boundary, after)
            state = self.store.read_pages([stored.state], parallel=False)[0] if self.layout.has_state else None
            placed = self._read_into_blocks(plan, stored, spans)
        except ObjectError as exc:
            logger.warning("sparkcache: restore of %s refused, its blocks recomputed: %s", plan.req_id, exc)
            self._add("lookup_miss_" + exc.reason)
            self._quarantine(exc, stored)
            return None
        if state is not None:
            kv_copy.place_parts(boundary, state)
        return placed, len(state) if state is not None else 0, None

    def _read_through_ring(self, plan: LoadPlan, stored: StoredPages, spans: list[tuple[int, int]],
                           boundary: list, after: object | None) -> tuple[int, int, object]:
        """Every page, then the boundary object, through the ring (``restore_ring``), every
        object checked present first (an entry evicted before the restore places nothing).
        A synchronous load orders the model's stream after the copies."""
        assert self._ring is not None
        refs = [*stored.pages, stored.state] if self.layout.has_state else list(stored.pages)
        self.store.check_pages_present(refs)
        state_bytes = 0

        def place(k: int, obj: torch.Tensor) -> int:
            nonlocal state_bytes
            if k < len(spans):
                return self._place_page(plan, obj, spans[k])
            kv_copy.place_parts(boundary, obj)  # the last: every page verified
            state_bytes = obj.numel()
            return 0

        placed, copied = self._ring.restore([ref.size for ref in refs],
                                            lambda k, buffer: self.store.read_page_into(refs[k], buffer),
                                            place, submit if self.read_in_parallel else done_now, after)
        if plan.sync:
            restore_ring.order_current_stream_after(copied, self._ring.device)
        return placed, state_bytes, copied

    def _page_spans(self, plan: LoadPlan, stored: StoredPages) -> list[tuple[int, int]] | None:
        """``(first block, blocks)`` of each stored page, once every page's recorded size
        (and the state's) matches the layout: a manifest that records a huge page is refused
        without mapping or hashing it, before any byte is placed. None: refused."""
        end = len(plan.keys)
        per_block = sum(self._block_bytes(n) for _, n in self._page_layers())
        state_bytes = self._boundary_bytes(end)
        if self.layout.has_state and (stored.state is None or stored.block_count != end
                                      or stored.state.size != state_bytes):
            logger.warning("sparkcache: restore of %s refused: the entry holds no boundary "
                           "object (state, windows) of %d bytes after block %d (it ends at "
                           "block %d)", plan.req_id, state_bytes, end, stored.block_count)
            return None
        spans = []
        bpp = stored.blocks_per_page  # the entry's, whatever page_blocks is set to now
        for k, ref in enumerate(stored.pages):
            p = stored.first_page + k
            page_first = p * bpp
            nblk = min((p + 1) * bpp, stored.block_count) - page_first
            if ref.size != nblk * per_block:
                logger.warning("sparkcache: restore of %s refused: page %d holds %d bytes, layout "
                               "expects %d", plan.req_id, p, ref.size, nblk * per_block)
                return None
            spans.append((page_first, nblk))
        return spans

    def _read_into_blocks(self, plan: LoadPlan, stored: StoredPages, spans: list[tuple[int, int]]) -> int:
        """Read each page straight into its destination blocks and verify it there (KV caches
        in host memory whose blocks are runs in page order: ``kv_copy.block_memory``): the
        read is the placement, no copy between. A block of a page that the restore does not
        place (before ``start_block``) is read aside, to be verified with the rest. Returns
        the bytes placed; an ``ObjectError`` leaves unverified bytes in blocks that ``load``
        then reports to vLLM as not loaded."""
        start, end = plan.start_block, len(plan.keys)
        layers = [(g, self.views[name], self._memory[name]) for g, name in self._page_layers()]
        for g, view, _ in layers:
            ids = plan.block_ids[g]
            if len(ids) != end - start:
                raise kv_copy.KVCopyError(f"sparkcache: the load plan names {len(ids)} block ids "
                                          f"for blocks {start}..{end - 1} of layer {view.layer!r}")
            kv_copy.check_ids(ids, view)

        runs = [(view.block_bytes, view.blocks.stride(0), plan.block_ids[g], memory) for g, view, memory in layers]

        def views_of(k: int) -> list[memoryview]:
            """Page k's bytes, layer after layer, block after block; blocks adjacent in memory
            (consecutive ids of a layer whose blocks are packed) as one view, so each read
            and its hashing cover as much as they can."""
            first, nblk = spans[k]
            views: list[memoryview] = []
            for size, step, ids, memory in runs:
                lo = hi = -1  # the run of adjacent destination bytes not yet in ``views``
                for b in range(first, first + nblk):
                    at = ids[b - start] * step if start <= b < end else -1
                    if at >= 0 and at == hi:
                        hi += size
                        continue
                    if hi > lo:
                        views.append(memory[lo:hi])
                    if at < 0:  # a block this restore does not place: read aside, verified with the rest
                        views.append(memoryview(bytearray(size)))
                        lo = hi = -1
                    else:
                        lo, hi = at, at + size
                if hi > lo:
                    views.append(memory[lo:hi])
            return views

        self.store.read_pages_into(stored.pages, views_of)
        per_block = sum(size for size, _, _, _ in runs)
        return sum(max(0, min(end, first + nblk) - max(start, first)) for first, nblk in spans) * per_block

    def _place_page(self, plan: LoadPlan, page: kv_copy.PageBuffer | torch.Tensor,
                    span: tuple[int, int]) -> int:
        """Copy a verified page (``span``: its first block and blocks) into the plan's
        destination blocks [start_block, end), one ``index_copy_`` per layer; the bytes placed."""
        start, end = plan.start_block, len(plan.keys)
        page_first, nblk = span
        lo, hi = max(start, page_first), min(end, page_first + nblk)
        if lo >= hi:
            return 0
        ids = {g: plan.block_ids[g][lo - start:hi - start] for g in self.layout.page_groups}
        return kv_copy.place([(self.views[name], ids[g]) for g, name in self._page_layers()],
                             page, nblk, skip=lo - page_first)

    def _quarantine(self, exc: ObjectError, stored: StoredPages) -> None:
        """A writing worker removes what a restore found corrupt (an object whose bytes are
        not its name's, or an entry whose manifest records another checksum), so the next
        capture of that prefix writes it anew and the restore after it succeeds (a corrupt
        object whose name is taken, or a wrong manifest, would otherwise be refused on every
        later restore). restore-only writes nothing."""
        if exc.reason != Reason.CORRUPT or self.slots is None:
            return
        ref = next((p for p in (*stored.pages, stored.state) if p is not None and p.digest == exc.digest), None)
        removed = self.store.quarantine(stored.entry_id, ref) if ref is not None else ""
        if removed:
            logger.warning("sparkcache: removed the corrupt %s (%s of entry %s); the next capture of "
                           "its prefix writes it again", removed, exc.digest, stored.entry_id)
            self._add("objects_quarantined" if removed == "object" else "entries_quarantined")

    def _stored_pages(self, plan: LoadPlan) -> StoredPages | None:
        """The pages to read: those the scheduler's lookup found, when it looked under this
        worker's identity (another tensor-parallel rank has its own entry: it looks it up)."""
        if plan.stored is not None and plan.stored.identity_digest == self.identity_digest:
            return plan.stored
        end = len(plan.keys)
        found = self.store.lookup(self.identity, plan.keys, with_state=self.layout.has_state)
        if not found.hit or found.hit_blocks < end:
            # Written moments ago by another process (the scheduler's fetch from the shared tier
            # adopts every rank's shard): a lookup reads only the journal records that fit its
            # budget, so read them all (``entries``) and look again before refusing.
            try:
                self.store.entries()
            except OSError:
                pass  # the lookup below says what fails
            found = self.store.lookup(self.identity, plan.keys, with_state=self.layout.has_state)
        if not found.hit:
            self._add("lookup_miss_" + found.reason)
        if not found.hit or found.hit_blocks < end:
            logger.warning("sparkcache: restore of %s refused: %s %s", plan.req_id,
                           found.reason, found.detail)
            return None
        return StoredPages.of(found.handle, plan.start_block, end)

    # ------------------------------------------------------------------ capture

    def capture(self, plan: CapturePlan) -> None:
        """A capture plan of this step. A finished request's (no boundary object) streams:
        its pages are copied a slot's worth at a time (the first at once: by the copier thread
        from an accelerator, here from the CPU; the rest by the publisher as the store writes
        the ones before) and it reports the request in ``finished_sending`` once the last is
        copied (vLLM holds its blocks until then). A hybrid plan (one with a boundary object)
        waits for this step's forward, which writes its state, and is copied whole right after
        it (``capture_after_forward``): vLLM may hand those blocks to another request at the
        next step."""
        if plan.state_block_ids is not None:
            self.after_forward.append(plan)
            return
        job = self._job(plan, streamed=True)
        if job is None:
            self.finished_sending.add(plan.req_id)

    def capture_after_forward(self) -> None:
        plans, self.after_forward = self.after_forward, []
        for plan in plans:
            self._job(plan, streamed=False)

    def _job(self, plan: CapturePlan, streamed: bool) -> _PublishJob | None:
        """Queue the publication of ``plan`` (a streamed one copies on the publisher thread,
        another is copied into its slot here); None (settled) when it is skipped or fails."""
        if self.slots is None or not self._usable():
            self._settled.append(plan.req_id)
            return None
        n = len(plan.keys)
        first = plan.reuse_pages * self.bpp
        layers = [(self.views[name], plan.block_ids[g]) for g, name in self._page_layers()]
        per_block = kv_copy.page_bytes(layers, 1)
        if streamed and not per_block:
            self._settled.append(plan.req_id)  # no page layer: nothing to store
            return None
        if streamed:  # a slot's worth of whole pages at a time (a page larger than a slot: skipped)
            chunk_blocks = max(1, self.slots.slot_bytes // (per_block * self.bpp)) * self.bpp
            nbytes = min(n - first, chunk_blocks) * per_block
        else:
            chunk_blocks = n - first
            nbytes = (n - first) * per_block + self._boundary_bytes(n)
        ticket = self.slots.try_acquire(nbytes)
        if ticket is None:
            self._settled.append(plan.req_id)  # skipped and counted by the slots
            return None
        job = _PublishJob(plan.req_id, list(plan.keys), plan.reuse_pages, layers, chunk_blocks,
                          time.monotonic())
        try:
            counts = [len(plan.block_ids[g]) for g in self.layout.page_groups]
            if any(c != n - first for c in counts):
                raise kv_copy.KVCopyError(f"the capture plan names {counts} block ids per group "
                                          f"for the {n - first} blocks {first}..{n - 1}")
            if streamed:
                job.marker = kv_copy.copy_marker(layers)
                # copied at once (its blocks released when it is the last), not behind the
                # writing of the captures queued before it: on an accelerator on the copier
                # thread (a side stream); on the CPU here, on the model's thread, between its
                # forwards (the same copy on another thread slowed the decode of every request
                # running meanwhile: docs/RESULTS.md, "Report B on the engine")
                copy = lambda: self._copy_chunk(job, 0, self.slots.buffer(ticket))  # noqa: E731
                job.first = self._copier.submit(copy) if job.marker is not None else done_now(copy)
            else:
                buffer = self.slots.buffer(ticket)
                job.pages = (self._gather_pages(layers, buffer) if layers else  # windows only: no pages
                             [memoryview(b"")] * (pages_needed(n, self.bpp) - plan.reuse_pages))
                job.state = kv_copy.gather_parts(self._boundary_sources(plan), buffer[(n - first) * per_block:])
                self._add("captured_state_bytes", len(job.state))
        except Exception:
            self.slots.cancel(ticket)
            self._settled.append(plan.req_id)
            logger.exception("sparkcache: capture of %s failed", plan.req_id)
            return None
        self.slots.submit(ticket, job, tag=plan.req_id)
        return job

    def _gather_pages(self, layers: list[tuple[kv_copy.BlockView, list[int]]], buffer: memoryview,
                      marker: object | None = None) -> list[memoryview]:
        """The pages of ``layers``' blocks, copied into ``buffer``; counted as captured."""
        pages = kv_copy.gather(layers, self.bpp, buffer, after=marker)
        self._add("captured_page_bytes", sum(len(p) for p in pages))
        return pages

    def _stream(self, job: _PublishJob, buffer: memoryview) -> PageStream:
        """A streamed job's pages, a chunk at a time as the store asks for them: the first
        copied when the plan arrived, each next one into the same buffer once the store wrote
        the one before."""
        n_new = len(job.layers[0][1])
        per_block = kv_copy.page_bytes(job.layers, 1)
        sizes = [None] * job.reuse_pages + [per_block * min(self.bpp, n_new - k) for k in range(0, n_new, self.bpp)]

        def chunks() -> Iterator[list[memoryview]]:
            try:
                first = job.first.result()  # raises what the copy raised
            except PageSourceError:
                raise
            except Exception as exc:  # its slot buffer could not be had
                raise PageSourceError(f"the copy of {job.req_id}'s blocks failed: {exc!r}") from exc
            yield first
            for lo in range(job.chunk_blocks, n_new, job.chunk_blocks):
                yield self._copy_chunk(job, lo, buffer)

        return PageStream(tuple(sizes), chunks)

    def _copy_chunk(self, job: _PublishJob, lo: int, buffer: memoryview) -> list[memoryview]:
        """Copy blocks ``lo ..`` (a chunk) of a streamed job into its slot's ``buffer``; the
        blocks are released to vLLM once the last chunk is copied."""
        n_new = len(job.layers[0][1])
        hi = min(n_new, lo + job.chunk_blocks)
        part = {id(ids): ids[lo:hi] for _, ids in job.layers}  # one index per group
        try:
            pages = self._gather_pages([(v, part[id(ids)]) for v, ids in job.layers], buffer, job.marker)
        except Exception as exc:
            raise PageSourceError(f"the copy of {job.req_id}'s blocks failed: {exc!r}") from exc
        self._check_lease(job)
        if hi == n_new:
            self._release_blocks(job)
        return pages

    def _check_lease(self, job: _PublishJob) -> None:
        """With the GPU lease, vLLM frees a finished request's blocks at its deadline, copied or
        not: a copy that ends past half the lease (a margin for the time the plan took to get
        here) may hold another request's bytes, and is never published."""
        lease = self.settings.gpu_lease_seconds
        took = time.monotonic() - job.queued_at
        if lease is not None and took >= lease / 2:
            raise PageSourceError(
                f"the copy of {job.req_id}'s blocks took {took:.2f} s, past half the GPU lease "
                f"(sparkcache_gpu_lease_seconds={lease}): vLLM may have given them to another "
                "request, so nothing is published. Fix: raise the lease, or "
                "SPARKCACHE_CAPTURE_SLOT_BYTES so that an entry is copied whole before it is written")

    def _release_blocks(self, job: _PublishJob) -> None:
        with self._counters_lock:
            if not job.released:
                job.released = True
                self._released.add(job.req_id)

    def _boundary_sources(self, plan: CapturePlan) -> list[list[tuple[kv_copy.BlockView, list[int]]]]:
        """The blocks a capture's boundary object is copied from (``kv_copy.gather_parts``),
        in ``_boundary_parts`` order."""
        parts = []
        if self.layout.state_groups:
            parts.append([(self.views[name], [plan.state_block_ids[k]]) for k, name in self._state_layers()])
        windows = plan.window_block_ids or [[] for _ in self.layout.window_groups]
        for g, ids, k in zip(self.layout.window_groups, windows, self.layout.windows_at(len(plan.keys))):
            if len(ids) != k:
                raise kv_copy.KVCopyError(f"the capture plan names {len(ids)} window blocks of group "
                                          f"{g}; an entry of {len(plan.keys)} blocks holds {k}")
            parts.append([(self.views[name], ids) for name in self._layers(g)])
        return parts

    def _publish(self, job: _PublishJob, buffer_of: Callable[[], memoryview]) -> PublishResult:
        try:
            pages = (self._stream(job, buffer_of()) if job.pages is None
                     else [None] * job.reuse_pages + job.pages)
            result = self.store.publish(self.identity, job.keys, pages, blocks_per_page=self.bpp,
                                        state=job.state, pace=self.hold.wait)
        finally:
            if job.pages is None:
                # A publication refused before it read its pages: the copier may still be
                # writing the first chunk into this slot; the slot and the blocks are given
                # back only once it is done (or never started).
                if not job.first.cancel():
                    wait([job.first])
                self._release_blocks(job)  # refused before or during the copy: vLLM frees them
        self.samples.add("publication_seconds", result.duration_s)
        if result.ok:
            self.samples.add("publication_bytes", result.bytes_written)
            if self.remote is not None:
                self.remote.published(result)  # queued; uploaded by the tier's thread
        else:
            self._add("publish_failed_" + result.reason)
            if result.reason != Reason.LOCK_TIMEOUT:  # counted; the store logs long waits, rarely
                logger.warning("sparkcache: publication refused (%s): %s", result.reason, result.detail)
        if self.maintenance is not None:
            self.maintenance.trigger()
        return result

    # ------------------------------------------------------------------ results

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        self._poll_loads()
        with self._counters_lock:
            self.finished_sending |= self._released
            self._released = set()
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def take_invalid_block_ids(self) -> set[int]:
        out, self.invalid_block_ids = self.invalid_block_ids, set()
        return out

    def take_sync_outcomes(self) -> tuple[list[str], list[str]]:
        out = (self.sync_loaded, self.sync_failed)
        self.sync_loaded, self.sync_failed = [], []
        return out

    def take_stats(self, now: float, gauge_interval_s: float = 1.0) -> tuple[dict, dict]:
        """Counter deltas and gauges since the last call, and the captures settled meanwhile.

        Order matters: the settled captures are taken *first*, then the counters and the
        gauges, so the numbers shipped with a settlement already include its outcome (the
        scheduler stops stepping an idle engine once every capture it planned is settled).
        Store capacity gauges are read when something moved or every ``gauge_interval_s``.
        """
        settled, self._settled = self._settled, []
        if self.slots is not None:
            settled += self.slots.take_settled()
        self._settled_reported += settled
        with self._counters_lock:
            counters, self.counters = self.counters, {}
        pass_counters, gauges = self.maintenance.take() if self.maintenance is not None else ({}, {})
        for key, n in pass_counters.items():
            counters[key] = counters.get(key, 0) + n
        if self.remote is not None:  # the uploads' counts (vllm:sparkcache_remote_*)
            for key, n in self.remote.counts.drain().items():
                add_count(counters, key, n)
        if self.slots is not None:
            s = dataclasses.replace(self.slots.stats)  # each count read once
            last, self._slot_stats_taken = self._slot_stats_taken, s
            add_count(counters, "captures_queued", s.queued - last.queued)
            add_count(counters, "captures_published", s.published - last.published)
            add_count(counters, "captures_publish_failed", s.publish_failed - last.publish_failed)
            add_count(counters, "captures_skipped_slots_full", s.skipped_slots_full - last.skipped_slots_full)
            add_count(counters, "captures_skipped_too_large", s.skipped_too_large - last.skipped_too_large)
            gauges.update(pending_slots=self.slots.in_use(), pending_bytes=self.slots.pending_bytes(),
                          oldest_pending_age=self.slots.oldest_age(), slots_total=self.slots.n_slots)
        if self.store is not None and (settled or counters or now - self._gauges_at >= gauge_interval_s):
            gauges.update(store_gauges(self.store))
            self._gauges_at = now
        return counters, gauges

    def take_settled(self) -> list[str]:
        """Captures settled up to the last ``take_stats`` (sent back in the worker meta)."""
        out, self._settled_reported = self._settled_reported, []
        return out

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._ring is not None:
            self._ring.close()
        if self.slots is not None:
            self.slots.close()
            self._copier.shutdown(wait=True)
        if self.maintenance is not None:
            self.maintenance.stop()
        if self.remote is not None:
            self._drain_uploads(self.remote)

    def _drain_uploads(self, tier: RemoteTier) -> None:
        """Give the pending uploads ``SPARKCACHE_REMOTE_DRAIN_SECONDS`` to finish (after the
        publications the slots drained), then stop the tier: never longer, whatever the remote
        store does (what is left is not uploaded; docs/REMOTE.md, "The connector and the tier")."""
        started = time.monotonic()
        bound = self.settings.remote_drain_seconds
        if not tier.uploads.wait_idle(bound):
            logger.warning("sparkcache: %d bytes of entries not uploaded to the shared tier within "
                           "SPARKCACHE_REMOTE_DRAIN_SECONDS=%g at shutdown; left local only (%s)",
                           tier.uploads.pending_bytes, bound, tier.uploads.last_error or "no error")
        tier.close(timeout_s=max(0.0, bound - (time.monotonic() - started)))
