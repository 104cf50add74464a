"""Replay A with the real connector's scheduler side: ``sparkcache.connector`` + an emulated worker.

vLLM loads the real ``SparkcacheConnector`` (scheduler role); its ``SchedulerSide`` makes every
decision on the replay's hybrid layout (full attention + Mamba "align": ``SchedulerSide.hybrid``):
offers (entries with a recurrent state at exactly their depth), load plans, capture plans from
vLLM's boundary-state offers, and the settle bookkeeping. The worker is emulated on the
replay's simulated clock, through the real ``PageStore`` the connector opened:

- a load plan is read from the store (real, verified read of the planned pages and of the
  entry's recurrent state object, which must end exactly at the plan's end block and hold the
  stand-in state published for those keys) and reported ``finished_recving``
  (``failed_recving`` when the read fails) after the modelled restore time;
- a capture plan carrying ``state_block_ids`` (planned in the step whose forward writes the
  boundary state, not at request finish: vLLM holds no block for it, so no
  ``finished_sending``) is published with its pages (pages the plan reuses go in as
  ``None``, copy-on-write growth) and a stand-in state after the modelled capture time of its
  new pages, then settled (``SparkcacheWorkerMetadata.settled``), as the real worker reports
  it. A plan without a state (a finished request's capture) is also reported
  ``finished_sending``, which releases the blocks vLLM held for it.

Page and state bytes are small stand-ins derived from the keys; the modelled byte size of the
pages is tracked apart (the recurrent state, a fixed size per request, is left out of the time
model: megabytes against the pages' gigabytes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.replay_a_connector import STANDIN_BYTES_PER_BLOCK, ReplayContext
from testing.vllm_scheduler import sparkcache_connector


def connector_config(ctx: ReplayContext, extra: dict, store_root: Path) -> dict:
    """``kv_transfer_config`` arguments that load the real connector on the replay's store."""
    settings = {"root": str(store_root), "access_mode": ctx.mode, "page_blocks": ctx.store.page_blocks,
                "min_span_tokens": 0,  # a replay token stands for 32 real ones: no real-token floor
                "weights_fingerprint": "replay:config-only"}  # the replay's model has no weights
    return sparkcache_connector({**extra, **settings})


STANDIN_STATE_BYTES = 64


def standin_state(keys: list) -> bytes:
    """The stand-in recurrent state after the last of ``keys`` (what a capture publishes and a
    load must read back)."""
    return hashlib.sha256(("state:" + "".join(map(str, keys))).encode()).digest() * (STANDIN_STATE_BYTES // 32)


@dataclass
class WorkerContext(ReplayContext):
    """``ReplayContext`` whose due captures are capture plans, published as the worker would."""

    settled: list[str] = field(default_factory=list)
    failed_recv: set[str] = field(default_factory=set)
    state_captures: list[tuple[float, Any]] = field(default_factory=list)  # (published at, plan)

    def next_event(self) -> float | None:
        times = [t for t, _ in self.state_captures] + [t for t in [super().next_event()] if t is not None]
        return min(times, default=None)

    def connector_output(self, sending: set[str], recving: set[str]) -> dict | None:
        failed = self.failed_recv & recving
        self.failed_recv -= failed
        meta = self.worker_meta()
        if not (sending or recving or meta):
            return None
        return {"finished_sending": sending or None, "finished_recving": recving or None,
                "failed_recving": failed or None, "kv_connector_worker_meta": meta}

    def due(self) -> tuple[set[str], set[str]]:
        sending = {r for r, (t, _) in self.pending_send.items() if t <= self.now}
        recving = {r for r, t in self.pending_recv.items() if t <= self.now}
        plans = [self.pending_send.pop(rid)[1] for rid in sorted(sending)]
        plans += [plan for t, plan in self.state_captures if t <= self.now]
        self.state_captures = [(t, plan) for t, plan in self.state_captures if t > self.now]
        for plan in plans:
            self.publish_plan(plan)
            self.settled.append(plan.req_id)  # one report per plan (one worker)
        for rid in recving:
            self.pending_recv.pop(rid)
        return sending, recving

    def worker_meta(self) -> Any:
        from sparkcache.connector.connector import SparkcacheWorkerMetadata

        settled, self.settled = self.settled, []
        return SparkcacheWorkerMetadata(settled) if settled else None

    def publish_plan(self, plan: Any) -> None:
        bpp = self.store.page_blocks
        pages = []
        for i in range(-(-len(plan.keys) // bpp)):
            chunk = plan.keys[i * bpp:(i + 1) * bpp]
            digest = hashlib.sha256("".join(map(str, chunk)).encode()).digest()
            pages.append(None if i < plan.reuse_pages else digest * (STANDIN_BYTES_PER_BLOCK * len(chunk) // 32))
        state = standin_state(plan.keys) if plan.state_block_ids is not None else None
        if not self.store.publish(self.identity, plan.keys, pages, blocks_per_page=bpp, state=state).ok:
            self.publish_failures += 1


def attach(scheduler: Any, ctx: WorkerContext) -> None:
    """Wire the real connector vLLM built into ``scheduler`` to the emulated worker ``ctx``."""
    connector = scheduler.connector
    side = connector._sched
    if side is None:
        raise RuntimeError("the replay needs SparkcacheConnector in the scheduler role")
    if not side.hybrid:
        raise RuntimeError(f"the replay's KV layout (full attention + Mamba align) should be hybrid for "
                           f"sparkcache.connector, got {side.layout.kind.name}: {side.layout.unsupported or '-'}")
    if side.store is not None:  # restore-only opens no store where nothing was ever published
        ctx.store, ctx.identity = side.store, side.identity
    ask, build = connector.get_num_new_matched_tokens, connector.build_connector_meta

    def get_num_new_matched_tokens(request, num_computed_tokens):
        ctx.note_residency(scheduler, request)
        return ask(request, num_computed_tokens)

    def build_connector_meta(scheduler_output):
        meta = build(scheduler_output)
        for plan in meta.loads:
            start_loading(ctx, plan)
        for plan in meta.captures:
            new_blocks = len(plan.keys) - plan.reuse_pages * ctx.store.page_blocks
            done = ctx.now + new_blocks * ctx.kv_bytes_per_block / ctx.capture_bps
            if plan.state_block_ids is None:  # a finished request's: vLLM holds its blocks until finished_sending
                ctx.pending_send[plan.req_id] = (done, plan)
            else:  # copied after this step's forward; published and settled later, no block held
                ctx.state_captures.append((done, plan))
            ctx.captures += 1
            ctx.captured_bytes += new_blocks * ctx.kv_bytes_per_block
        return meta

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.build_connector_meta = build_connector_meta


def start_loading(ctx: WorkerContext, plan: Any) -> None:
    n_blocks = len(plan.keys) - plan.start_block
    seconds = n_blocks * ctx.kv_bytes_per_block / ctx.restore_bps
    read_ok = read_plan(ctx, plan)
    ctx.pending_recv[plan.req_id] = ctx.now + seconds
    ctx.loads[plan.req_id] = {"tokens": n_blocks * ctx.block_size, "seconds": seconds, "read_ok": read_ok}
    if not read_ok:
        ctx.failed_recv.add(plan.req_id)  # reported failed_recving, as the real worker does


def read_plan(ctx: WorkerContext, plan: Any) -> bool:
    """The verified read the real worker makes: the pages of the entry the scheduler's lookup
    found (looked up again, with its state, when the plan carries none) and the recurrent state
    after exactly the plan's end block."""
    from sparkcache.connector.scheduler_side import StoredPages
    from sparkcache.store.objects import ObjectError

    end = len(plan.keys)
    stored = plan.stored
    if stored is None:
        found = ctx.store.lookup(ctx.identity, plan.keys, with_state=True)
        if not (found.hit and found.hit_blocks == end):
            return False
        stored = StoredPages.of(found.handle, plan.start_block, end)
    if stored.state is None or stored.block_count != end:
        return False  # a hybrid load resumes only where a state was taken
    try:
        *_, state = ctx.store.objects.read_many_verified([*stored.pages, stored.state])
    except ObjectError:
        return False
    return bytes(state) == standin_state(plan.keys)
