"""Replay A with the real connector's scheduler side: ``sparkcache.connector`` + an emulated worker.

vLLM loads the real ``SparkcacheConnector`` (scheduler role); its ``SchedulerSide`` makes every
decision: offers, load plans, capture plans, delayed frees and the settle bookkeeping. The
worker is emulated on the replay's simulated clock, through the real ``PageStore`` the
connector opened:

- a load plan is read from the store (real, verified read of the planned keys) and reported
  ``finished_recving`` (``failed_recving`` when the read fails) after the modelled restore time;
- a capture plan is published after the modelled capture time of its new pages (pages the
  plan reuses go in as ``None``, copy-on-write growth), then reported ``finished_sending`` and
  settled (``SparkcacheWorkerMetadata``), as the real worker reports it.

Page bytes are small stand-ins derived from the keys; the modelled byte size is tracked apart.

One deviation, named where it is made (``attach``): the real scheduler side plans no capture on
a layout with recurrent groups (``SchedulerSide.attention_only`` is False: its worker cannot copy
recurrent state yet). The emulated worker "captures" the state with its blocks, so the replay
lifts that one gate; everything else runs unchanged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.replay_a_connector import STANDIN_BYTES_PER_BLOCK, ReplayContext, _resident_snapshot


def connector_config(ctx: ReplayContext, extra: dict, store_root: Path) -> dict:
    """``kv_transfer_config`` arguments that load the real connector on the replay's store."""
    settings = {"root": str(store_root), "access_mode": ctx.mode, "page_blocks": ctx.store.page_blocks,
                "min_span_tokens": 0,  # a replay token stands for 32 real ones: no real-token floor
                "weights_fingerprint": "replay:config-only"}  # the replay's model has no weights
    return {"kv_connector": "SparkcacheConnector", "kv_connector_module_path": "sparkcache.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**extra, **settings}}


@dataclass
class WorkerContext(ReplayContext):
    """``ReplayContext`` whose due captures are capture plans, published as the worker would."""

    settled: list[str] = field(default_factory=list)
    failed_recv: set[str] = field(default_factory=set)

    def connector_output(self, sending: set[str], recving: set[str]) -> dict:
        failed = self.failed_recv & recving
        self.failed_recv -= failed
        return {**super().connector_output(sending, recving), "failed_recving": failed or None,
                "kv_connector_worker_meta": self.worker_meta()}

    def due(self) -> tuple[set[str], set[str]]:
        sending = {r for r, (t, _) in self.pending_send.items() if t <= self.now}
        recving = {r for r, t in self.pending_recv.items() if t <= self.now}
        for rid in sorted(sending):
            _, plan = self.pending_send.pop(rid)
            self.publish_plan(plan)
            self.settled.append(rid)
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
        if not self.store.publish(self.identity, plan.keys, pages).ok:
            self.publish_failures += 1


def attach(scheduler: Any, ctx: WorkerContext) -> None:
    """Wire the real connector vLLM built into ``scheduler`` to the emulated worker ``ctx``."""
    connector = scheduler.connector
    side = connector._sched
    if side is None:
        raise RuntimeError("the replay needs SparkcacheConnector in the scheduler role")
    if side.store is not None:  # restore-only opens no store where nothing was ever published
        ctx.store, ctx.identity = side.store, side.identity
    # The deviation (module docstring): plan captures on this hybrid layout.
    side.attention_only = True
    ask, build = connector.get_num_new_matched_tokens, connector.build_connector_meta

    def get_num_new_matched_tokens(request, num_computed_tokens):
        ctx.residency[request.request_id] = _resident_snapshot(scheduler, request, ctx.block_size)
        return ask(request, num_computed_tokens)

    def build_connector_meta(scheduler_output):
        meta = build(scheduler_output)
        for plan in meta.loads:
            start_loading(ctx, plan)
        for plan in meta.captures:
            new_blocks = len(plan.keys) - plan.reuse_pages * ctx.store.page_blocks
            ctx.pending_send[plan.req_id] = (ctx.now + new_blocks * ctx.kv_bytes_per_block / ctx.capture_bps, plan)
            ctx.captures += 1
            ctx.captured_bytes += new_blocks * ctx.kv_bytes_per_block
        return meta

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.build_connector_meta = build_connector_meta


def start_loading(ctx: WorkerContext, plan: Any) -> None:
    n_blocks = len(plan.keys) - plan.start_block
    found = ctx.store.lookup(ctx.identity, plan.keys)
    read_ok = bool(found.hit and found.hit_blocks >= len(plan.keys)
                   and ctx.store.read(found.handle, len(plan.keys)).ok)
    seconds = n_blocks * ctx.kv_bytes_per_block / ctx.restore_bps
    ctx.pending_recv[plan.req_id] = ctx.now + seconds
    ctx.loads[plan.req_id] = {"tokens": n_blocks * ctx.block_size, "seconds": seconds, "read_ok": read_ok}
    if not read_ok:
        ctx.failed_recv.add(plan.req_id)  # reported failed_recving, as the real worker does
