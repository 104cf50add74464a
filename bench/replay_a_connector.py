"""Replay A's scheduler-side connector: a real vLLM KV connector backed by the real PageStore.

The real ``sparkcache/connector`` plans no capture on hybrid layouts (its worker cannot copy
recurrent state yet), so by default Replay A drives vLLM's real Scheduler with this small
adapter (a ``KVConnectorBase_V1`` + ``SupportsHMA`` plugin loaded by vLLM through
``kv_connector_module_path``; ``--connector sparkcache`` uses the real scheduler side instead,
see ``bench.replay_a_worker``). It does what the design gives the real connector's scheduler
side, on a simulated clock:

- ``get_num_new_matched_tokens``: look up the longest stored prefix of the prompt (block
  hashes, never the whole prompt: the last token is recomputed) in the real
  ``sparkcache.store.PageStore``; offer only the tokens past ``num_computed_tokens``, as an
  asynchronous load.
- ``update_state_after_alloc``: the load vLLM accepted is read from the store (real,
  verified read of the pages) and reported ``finished_recving`` after the modelled restore
  time (KV bytes / restore bytes per second).
- ``request_finished*``: in read-write mode the request is captured: its blocks are held
  (delayed free) until ``finished_sending``, reported after the modelled capture time of the
  pages the store does not hold yet (copy-on-write growth); then the whole computed prefix
  is published to the store. Restore-only never captures.

Any block-aligned depth the store matches is treated as restorable with its recurrent state
(the design's connector captures the recurrent checkpoints the request hashed, and restores
the recurrent state at the end of any load).

Page bytes are small deterministic stand-ins derived from the block hashes (so identical
pages dedupe in the content-addressed store); the modelled byte size is tracked separately.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from testing.vllm_scheduler import lazy_attribute

STANDIN_BYTES_PER_BLOCK = 64


@dataclass
class ReplayContext:
    """Shared between the replay loop and the connector vLLM instantiates (module global)."""

    store: Any
    identity: Any
    mode: str  # "read-write" | "restore-only"
    block_size: int
    kv_bytes_per_block: float  # modelled bytes of one replay block (all of its real tokens)
    restore_bps: float
    capture_bps: float
    now: float = 0.0
    scheduler: Any = None
    pending_recv: dict[str, float] = field(default_factory=dict)  # req id -> done at
    pending_send: dict[str, tuple[float, list]] = field(default_factory=dict)  # req id -> (done at, hashes)
    residency: dict[str, dict] = field(default_factory=dict)  # req id -> snapshot at its admitting ask
    loads: dict[str, dict] = field(default_factory=dict)  # req id -> accepted load
    captures: int = 0
    captured_bytes: float = 0.0
    publish_failures: int = 0
    evicted_cached_blocks: int = 0  # hashed blocks the block pool evicted (diagnostic)
    preemptions: int = 0  # running requests vLLM preempted for blocks (diagnostic)
    groups: tuple[list[int], list[int]] | None = None  # (attention, state) groups, found once

    def note_residency(self, scheduler, request) -> None:
        """On vLLM's ask for ``request``: which of its prompt blocks vLLM's block pool holds right
        now, per group. Only asks before its first admission count: the turn's local and external
        tokens are that admission's (a preempted request is asked again when it resumes, after it
        computed blocks itself)."""
        if request.num_preemptions:
            return
        if self.groups is None:
            from sparkcache.connector.kv_layout import describe_kv_layout

            layout = describe_kv_layout(scheduler.kv_cache_config)  # which groups are attention, which state
            self.groups = list(layout.page_groups), list(layout.state_groups)
        self.residency[request.request_id] = _resident_snapshot(
            scheduler.kv_cache_manager.block_pool, request, self.block_size, *self.groups)

    def next_event(self) -> float | None:
        times = list(self.pending_recv.values()) + [t for t, _ in self.pending_send.values()]
        return min(times) if times else None

    def connector_output(self, sending: set[str], recving: set[str]) -> dict | None:
        """``KVConnectorOutput`` fields of one step's reports; None when there is none."""
        if not (sending or recving):
            return None
        return {"finished_sending": sending or None, "finished_recving": recving or None}

    def due(self) -> tuple[set[str], set[str]]:
        """finished_sending, finished_recving due at ``now`` (captures are published here)."""
        sending = {r for r, (t, _) in self.pending_send.items() if t <= self.now}
        recving = {r for r, t in self.pending_recv.items() if t <= self.now}
        for rid in sorted(sending):
            _, hashes = self.pending_send.pop(rid)
            self.publish(hashes)
        for rid in recving:
            self.pending_recv.pop(rid)
        return sending, recving

    # ------------------------------------------------------------------ store I/O
    def stored_blocks(self, hashes: list) -> tuple[int, Any]:
        if not hashes:
            return 0, None
        result = self.store.lookup(self.identity, hashes)
        return (result.hit_blocks, result.handle) if result.hit else (0, None)

    def publish(self, hashes: list) -> None:
        bpp = self.store.page_blocks
        pages = []
        for i in range(0, len(hashes), bpp):
            chunk = b"".join(bytes(h) for h in hashes[i:i + bpp])
            digest = hashlib.sha256(chunk).digest()
            pages.append(digest * (STANDIN_BYTES_PER_BLOCK * len(hashes[i:i + bpp]) // 32))
        result = self.store.publish(self.identity, hashes, pages)
        if not result.ok:
            self.publish_failures += 1


def _resident_snapshot(pool, request, block_size: int, attention: list[int], state: list[int]) -> dict:
    n = (request.num_prompt_tokens - 1) // block_size
    hashes = request.block_hashes[:n]
    attn_depth = 0
    for h in hashes:
        if not pool.get_cached_block(h, attention):
            break
        attn_depth += 1
    # a local hit at a boundary needs every recurrent group's state there
    mamba_at = {i + 1 for i, h in enumerate(hashes) if pool.get_cached_block(h, state)}
    return {"attn_tokens": attn_depth * block_size, "mamba_blocks": mamba_at}


CONTEXT: ReplayContext | None = None


__getattr__ = lazy_attribute(globals(), "ReplayConnector", lambda: _build())


def _build():
    from testing.vllm_scheduler import scheduler_side_connector

    class ReplayConnector(scheduler_side_connector()):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            if CONTEXT is None:
                raise RuntimeError("bench.replay_a_connector.CONTEXT is not set")
            self.ctx = CONTEXT

        # -------------------------------------------------------- scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ctx = self.ctx
            if ctx.scheduler is not None:
                ctx.note_residency(ctx.scheduler, request)
            n = (request.num_prompt_tokens - 1) // ctx.block_size
            depth, _ = ctx.stored_blocks(request.block_hashes[:n])
            ext = max(0, depth * ctx.block_size - num_computed_tokens)
            return ext, ext > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            if num_external_tokens <= 0:
                return
            ctx = self.ctx
            end_block = (request.num_computed_tokens + num_external_tokens) // ctx.block_size
            depth, handle = ctx.stored_blocks(request.block_hashes[:end_block])
            read_ok = False
            if handle is not None and depth >= end_block:
                read_ok = ctx.store.read(handle, end_block).ok
            seconds = num_external_tokens / ctx.block_size * ctx.kv_bytes_per_block / ctx.restore_bps
            ctx.pending_recv[request.request_id] = ctx.now + seconds
            ctx.loads[request.request_id] = {"tokens": num_external_tokens, "seconds": seconds, "read_ok": read_ok}

        def _finished(self, request):
            ctx = self.ctx
            if ctx.mode != "read-write":
                return False, None
            n = request.num_computed_tokens // ctx.block_size
            hashes = list(request.block_hashes[:n])
            if not hashes:
                return False, None
            stored, _ = ctx.stored_blocks(hashes)
            bpp = ctx.store.page_blocks
            new_blocks = n - (stored - stored % bpp)  # a changed page tail is rewritten (copy-on-write)
            seconds = new_blocks * ctx.kv_bytes_per_block / ctx.capture_bps
            ctx.pending_send[request.request_id] = (ctx.now + seconds, hashes)
            ctx.captures += 1
            ctx.captured_bytes += new_blocks * ctx.kv_bytes_per_block
            return True, None

        def request_finished(self, request, block_ids):
            return self._finished(request)

        def request_finished_all_groups(self, request, block_ids):
            return self._finished(request)

    return ReplayConnector
