"""One rank's worker half on CPU tensors of exactly the specs vLLM builds for a model
(``testing.field_layouts``), driven the way vLLM's model runner drives a KV connector, beside
vLLM's real ``Scheduler`` (``testing.vllm_scheduler``).

The tensors are vLLM's own: ``allocate_kv_cache`` views the worker's ``KVCacheConfig`` per
layer, as the GPU model runner does. Only the forward is synthetic: for every scheduled chunk it
writes, into each stored layer's blocks, bytes that depend on the tokens before that block's end
and the layer (``expected_block``), and into each recurrent group's running column the state
after the chunk (``expected_state``). A draft layers' group (EAGLE / MTP, ``is_eagle_group``)
also depends on the tokens after each position, as a drafter's KV does (its input at p is the
token at p + 1; in a chain of MTP modules, module j's is the token at p + j). So after a
restore every placed byte can be compared with what the model would have written, and a block
that was not placed, or placed from another prompt, differs.

Import only inside a process that may import vLLM.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from sparkcache.connector.capture_plans import NULL_BLOCK_ID


def _seed(tokens: list[int], layer: str, what: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{layer}\0{what}\0".encode())
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def _module_reach(layer: str, target_layers: int) -> int:
    """How far past a position the input of a layer in the draft group reaches: the first MTP
    module (numbered on from the target's layers, ``model.layers.{num_hidden_layers + j}``)
    reads the next token, the second two tokens on, and so on; a target layer sharing the group
    none; a layer named otherwise, or any with ``target_layers`` unknown (0), one."""
    found = re.search(r"layers\.(\d+)\.", layer)
    return max(0, int(found.group(1)) - target_layers + 1) if found and target_layers > 0 else 1


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@dataclass
class Placed:
    """A load the worker placed (or refused) in one step, with its plan."""
    req_id: str
    plan: object
    ok: bool


@dataclass
class FieldWorker:
    worker: object                   # sparkcache's WorkerSide, its views registered
    scheduler: object                # vLLM's Scheduler (for block tables and tokens)
    block_size: int
    placed: list[Placed] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # the worker's, summed over steps
    before_load: Callable[[object, object], None] | None = None  # (worker, plan) before it is placed
    after_load: Callable[[object, object], None] | None = None   # (worker, plan) right after, before the forward
    # layers of a draft (EAGLE / MTP) group -> how many tokens past a position its input reaches
    draft_reach: dict[str, int] = field(default_factory=dict)
    # speculative decoding: the model's tokens (a list: accepted drafts and the next one) and the
    # drafter's proposals (``testing.vllm_scheduler.step``)
    sample: Callable[[object], int | list[int]] | None = None
    drafts: Callable[[object], list[int]] | None = None

    @classmethod
    def start(cls, scheduler, worker_cfg, settings, *, seed: int = 0, target_layers: int = 0) -> "FieldWorker":
        """A ``WorkerSide`` for ``worker_cfg`` under the identity the scheduler's connector
        computed, on fresh tensors filled with random bytes (``seed``). ``target_layers``: the
        model's ``num_hidden_layers`` (the draft group's layers numbered from there on are
        MTP modules)."""
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        from sparkcache.connector.connector import _open_store
        from sparkcache.connector.identity import make_identity
        from sparkcache.connector.worker_side import WorkerSide

        identity, layout = make_identity(scheduler.vllm_config, worker_cfg, 0,
                                         declared_weights=settings.weights_fingerprint)
        worker = WorkerSide(settings, identity, _open_store(settings), worker_cfg, layout)
        kernel = [g.kv_cache_spec.block_size for g in worker_cfg.kv_cache_groups]
        caches = allocate_kv_cache(worker_cfg, torch.device("cpu"), KVCacheLayout[worker_cfg.kv_cache_layout],
                                   kernel)
        gen = torch.Generator().manual_seed(seed)
        for t in {id(t): t for t in caches.values()}.values():
            raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        worker.register_kv_caches(caches)
        reach = {n: _module_reach(n, target_layers) for g in worker_cfg.kv_cache_groups if g.is_eagle_group
                 for n in g.layer_names}
        return cls(worker, scheduler, int(scheduler.block_size), draft_reach=reach)

    # ------------------------------------------------------------------ the model

    def expected_block(self, tokens: list[int], layer: str, block: int, upto: int) -> torch.Tensor:
        """What the forward writes into ``layer``'s block ``block`` once ``upto`` tokens are
        computed (a draft layer's: and the tokens after them it reads)."""
        end = min((block + 1) * self.block_size, upto) + self.draft_reach.get(layer, 0)
        return _bytes(self.worker.views[layer].block_bytes, _seed(tokens[:end], layer, "page"))

    def expected_state(self, tokens: list[int], layer: str, upto: int) -> torch.Tensor:
        return _bytes(self.worker.views[layer].block_bytes, _seed(tokens[:upto], layer, "state"))

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """Manager block ``block_id`` of ``layer``, as flat bytes (a copy)."""
        return self.worker.views[layer].blocks[block_id].reshape(-1).clone()

    def write(self, layer: str, block_id: int, data: torch.Tensor) -> None:
        dest = self.worker.views[layer].blocks[block_id]
        dest.copy_(data.view(dest.shape))

    def _prefill_checkpoint(self, group: int, start: int, end: int) -> tuple[int, int] | None:
        """Where the backend also exports the state at a prefill checkpoint inside this chunk
        (``num_prefill_checkpoint_blocks``): (tokens, column), by vLLM's own rule."""
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        spec = self.scheduler.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        if not spec.num_prefill_checkpoint_blocks:
            return None
        config = self.scheduler.kv_cache_config
        offsets, cols = compute_mamba_prefill_checkpoints(
            [end], [end - start], config.hash_block_size, spec.block_size, spec.prefill_checkpoint_alignment,
            False, getattr(config, "cache_hit_alignment_tokens", None) or config.hash_block_size)
        return (start + offsets[0], cols[0]) if cols[0] >= 0 else None

    def _forward(self, out) -> None:
        layout = self.worker.layout
        bs = self.block_size
        before = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            # a step with draft tokens computes them too: its bytes are the drafts' until a later
            # step recomputes the rejected positions
            tokens = list(req.all_token_ids) + list(out.scheduled_spec_decode_tokens.get(rid, ()))
            start, end = before[rid], before[rid] + n
            table = self.scheduler.kv_cache_manager.get_block_ids(rid)
            for g in layout.page_groups + layout.window_groups:
                for layer in self.worker._layers(g):
                    for j in range(start // bs, -(-end // bs)):
                        if table[g][j] != NULL_BLOCK_ID:  # behind a window: never written
                            self.write(layer, table[g][j], self.expected_block(tokens, layer, j, end))
            for g in layout.state_groups:
                columns = {-(-end // bs) - 1: end}  # the running state
                checkpoint = self._prefill_checkpoint(g, start, end)
                if checkpoint is not None:
                    columns[checkpoint[1]] = checkpoint[0]
                for column, upto in columns.items():
                    if table[g][column] == 0:  # vLLM's null block: never written
                        continue
                    for layer in self.worker._layers(g):
                        self.write(layer, table[g][column], self.expected_state(tokens, layer, upto))

    # ------------------------------------------------------------------ the runner's calls

    def on_scheduled(self, out) -> dict:
        """vLLM's model runner for one step: the connector's loads and captures
        (``start_load_kv``), the forward, ``wait_for_save``, then the workers' report."""
        from sparkcache.connector.connector import SparkcacheWorkerMetadata

        meta = out.kv_connector_metadata
        if meta is not None:
            for plan in meta.captures:
                self.worker.capture(plan)
            for plan in meta.loads:
                if self.before_load is not None:
                    self.before_load(self.worker, plan)
                self.worker.load(plan)
                if self.after_load is not None:
                    self.after_load(self.worker, plan)
        self._forward(out)
        self.worker.capture_after_forward()
        sending, recving, failed = self.worker.take_results()
        loaded, sync_failed = self.worker.take_sync_outcomes()
        if meta is not None:
            self.placed += [Placed(p.req_id, p, p.req_id in loaded if p.sync else
                                   p.req_id in recving and p.req_id not in failed) for p in meta.loads]
        for k, v in self.worker.take_stats(0.0)[0].items():  # as shipped each step
            self.counters[k] = self.counters.get(k, 0) + v
        settled = self.worker.take_settled()
        worker_meta = (SparkcacheWorkerMetadata(settled, loaded, sync_failed)
                       if settled or loaded or sync_failed else None)
        return {"finished_sending": sending, "finished_recving": recving, "failed_recving": failed,
                "invalid_block_ids": self.worker.take_invalid_block_ids(),
                "kv_connector_worker_meta": worker_meta}

    def run(self, request, max_steps: int = 2000, quiet_s: float = 30.0) -> None:
        """Add ``request``, step until it finished and every capture it planned settled."""
        import time

        from vllm.v1.request import RequestStatus

        from testing.vllm_scheduler import step

        self.scheduler.add_request(request)
        connector = self.scheduler.connector
        deadline = None
        for _ in range(max_steps):
            step(self.scheduler, on_scheduled=self.on_scheduled, sample=self.sample, drafts=self.drafts)
            if RequestStatus.is_finished(request.status):
                if not connector.has_pending_push_work():
                    return
                deadline = deadline or time.monotonic() + quiet_s
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{request.request_id}: captures unsettled after {quiet_s} s")
                time.sleep(0.02)
        raise RuntimeError(f"{request.request_id} did not finish in {max_steps} steps")

    def close(self) -> None:
        self.worker.close()
