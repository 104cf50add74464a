"""The field's layouts stored and restored byte for byte, on vLLM 0.32.0's real ``Scheduler``
with sparkcache's connector and its worker half on CPU tensors of exactly the specs vLLM builds
for each model (``testing.field_layouts``: GLM-5.3 / Glm5Next with and without MTP, DeepSeek-V3's
MLA, NemotronH with ngram speculative decoding). vLLM cannot run these forwards on a CPU; the forward here writes
bytes determined by the tokens (``testing.field_worker``), so every placed byte is checked.

Each model: a prompt is computed and its entry published (every group it stores: KDA states,
the MLA latent with its indexer key cache, ...); a new scheduler and worker on the same root
(a restart) offer it and place it, and every placed block and state equals what the forward
wrote for those tokens. A missing object of any kind refuses the restore: nothing is placed, and
vLLM recomputes. With MTP the draft layers' KV at a block's last position depends on the token
after it: an entry is offered only where that token is the same. At 403da3e GLM-5.3 (with and
without MTP) and DeepSeek-V3 were refused (nothing stored).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

import pytest

from testing.field_layouts import field_layout

from .conftest import flip_byte

pytestmark = [pytest.mark.slow]

PROMPT_BLOCKS = 3  # whole blocks before the prompt's tail


def _setup(name: str, root, seed: int, retention_interval: int | None = 0):
    """vLLM's Scheduler with sparkcache's connector for ``name``'s layout, and its worker half
    (vLLM's recurrent-state retention: 0, production's, or None, dense)."""
    from sparkcache.settings import load_settings
    from testing.field_worker import FieldWorker
    from testing.vllm_scheduler import make_scheduler, sparkcache_connector

    got = field_layout(name)
    extra = {"root": str(root), "min_span_tokens": got.block_size,
             "weights_fingerprint": f"field:{name}"}
    hybrid = got.facts.get("mamba_cache_mode") == "align"
    method = got.facts["speculative_method"]  # the model's own drafter, as its engine ran it
    speculative = {"model": got.facts["model"], "method": method,
                   "num_speculative_tokens": got.facts["num_speculative_tokens"]} if method else None
    scheduler = make_scheduler(sparkcache_connector(extra), hybrid=hybrid, kv_cache_config=got.scheduler,
                               max_model_len=4096, max_num_batched_tokens=8192, speculative=speculative,
                               retention_interval=retention_interval)
    settings = load_settings(env={}, extra_config=extra)
    target_layers = json.loads((Path(got.model_dir) / "config.json").read_text()).get("num_hidden_layers", 0)
    return FieldWorker.start(scheduler, got.worker, settings, seed=seed, target_layers=target_layers)


def _publish_first(name: str, root) -> tuple[list[int], dict, int]:
    """A prompt computed and published by a first scheduler and worker on ``root``: (its
    tokens, the worker's counters, the bytes of one state object)."""
    from testing.vllm_scheduler import make_request

    fw = _setup(name, root, seed=0)
    tokens = _prompt(fw.block_size)
    try:
        fw.run(make_request("first", tokens, max_tokens=2, block_size=fw.block_size))
        state_bytes = sum(fw.worker.views[layer].block_bytes for _, layer in fw.worker._state_layers())
    finally:
        fw.close()
    return tokens, fw.counters, state_bytes


def _prompt(block_size: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_BLOCKS * block_size + block_size // 3 + 1)]


def _check_placed(fw, tokens: list[int], plan) -> list[str]:
    """Every block and state the request's block table holds for the plan's span (vLLM's own
    table, not the plan's ids), compared with what the forward wrote."""
    bs, wrong = fw.block_size, []
    layout = fw.worker.layout
    table = fw.scheduler.kv_cache_manager.get_block_ids(plan.req_id)
    start, end = plan.start_block, len(plan.keys)
    for g in layout.page_groups:
        for layer in fw.worker._layers(g):
            for j in range(start, end):
                if not fw.block(layer, table[g][j]).equal(fw.expected_block(tokens, layer, j, end * bs)):
                    wrong.append(f"{layer} block {j}")
    for g in layout.state_groups:
        for layer in fw.worker._layers(g):
            if not fw.block(layer, table[g][end - 1]).equal(fw.expected_state(tokens, layer, end * bs)):
                wrong.append(f"{layer} state")
    for g, k in zip(layout.window_groups, layout.windows_at(end)):
        for layer in fw.worker._layers(g):
            for j in range(max(start, end - k), end):
                if not fw.block(layer, table[g][j]).equal(fw.expected_block(tokens, layer, j, end * bs)):
                    wrong.append(f"{layer} window block {j}")
    return wrong


def _restore_after_restart(name: str, root, tokens: list[int]):
    """A restart (a new scheduler and worker, other tensors with other random bytes, the same
    root) runs ``tokens``: the worker, and what ``_check_placed`` found just before and just
    after its load."""
    from testing.vllm_scheduler import make_request

    fw = _setup(name, root, seed=1)
    seen: dict = {}
    fw.before_load = lambda worker, plan: seen.setdefault("before", _check_placed(fw, tokens, plan))
    fw.after_load = lambda worker, plan: seen.setdefault("after", _check_placed(fw, tokens, plan))
    try:
        fw.run(make_request("again", tokens, max_tokens=2, block_size=fw.block_size))
    finally:
        fw.close()
    return fw, seen


def _depth(fw) -> int:
    """The blocks an entry of ``PROMPT_BLOCKS`` + a tail holds: with a drafter one less (the
    deepest state vLLM keeps then is a block lower: ``replay_boundaries``)."""
    return PROMPT_BLOCKS - (fw.worker.layout.lookahead > 0 and fw.worker.layout.has_state)


@pytest.mark.parametrize("name", ["glm5next", "glm5next-mtp", "deepseek-v3", "nemotronh-ngram", "gemma3",
                                  "gpt-oss", "mistral"])
def test_an_entry_of_every_group_is_placed_byte_for_byte_after_a_restart(name, tmp_path):
    root = tmp_path / "store"
    tokens, counters, _ = _publish_first(name, root)
    assert counters.get("captures_published", 0) >= 1, counters

    fw, seen = _restore_after_restart(name, root, tokens)
    (placed,) = fw.placed
    assert placed.ok, "the restore was refused"
    depth = _depth(fw)
    assert placed.plan.start_block == 0 and len(placed.plan.keys) == depth
    # before the load the destination held other bytes (so the comparison can fail) ...
    layout = fw.worker.layout
    assert len(seen["before"]) == sum(len(fw.worker._layers(g)) for g in layout.page_groups) * depth \
        + len(fw.worker._state_layers()) \
        + sum(len(fw.worker._layers(g)) * k for g, k in zip(layout.window_groups, layout.windows_at(depth)))
    # ... and after it every block of every stored layer and every state is the forward's
    assert seen["after"] == []


@pytest.mark.parametrize("how", ["removed", "flipped"])
@pytest.mark.parametrize("kind", ["page", "state"])
def test_a_missing_or_damaged_object_of_any_group_is_never_placed(kind, how, tmp_path):
    """GLM-5.3: one object of the entry (a page: MLA latent + indexer key cache; or the state:
    the KDA states) removed or with one byte flipped. A removed object is not offered; a damaged
    one is offered, refused by its checksum, and no state is placed: vLLM recomputes the
    request. A damaged page may have been read into the request's own page blocks before its
    checksum failed (pages are read straight into the blocks on CPU): never used, as the
    request recomputes; a damaged state is found before any page is read."""
    from testing.vllm_scheduler import make_request

    root = tmp_path / "store"
    tokens, _, state_bytes = _publish_first("glm5next", root)
    objects = sorted(p for p in (root / "default" / "objects").rglob("*") if p.is_file())
    states = [p for p in objects if p.stat().st_size == state_bytes]
    assert len(states) == 1 and len(objects) > 1, [p.stat().st_size for p in objects]
    victim = states[0] if kind == "state" else next(p for p in objects if p not in states)
    if how == "removed":
        victim.unlink()
    else:
        flip_byte(victim)

    fw = _setup("glm5next", root, seed=1)
    untouched: dict = {}
    changed: list = []

    state_layers: set = set()

    def snapshot(worker, plan):
        layout = worker.layout
        state_layers.update(layer for g in layout.state_groups for layer in worker._layers(g))
        untouched.update({(layer, b): fw.block(layer, b)
                          for g in layout.page_groups + layout.state_groups
                          for layer in worker._layers(g) for b in plan.block_ids[g]})

    def compare(worker, plan):
        changed.extend(k for k, before in untouched.items() if not fw.block(*k).equal(before))

    fw.before_load, fw.after_load = snapshot, compare
    request = make_request("again", tokens, max_tokens=2, block_size=fw.block_size)
    try:
        fw.run(request)
    finally:
        fw.close()
    assert not any(p.ok for p in fw.placed)
    if how == "removed":  # an entry missing an object is not offered
        assert fw.placed == []
    else:  # offered, verified, refused: no state placed (nor, for a damaged state, any page)
        assert fw.placed and untouched and state_layers
        assert [k for k in changed if k[0] in state_layers] == []
        assert kind == "page" or changed == []
    assert request.num_computed_tokens >= len(tokens)  # recomputed to the end
    assert fw.counters.get("captures_published", 0) >= 1  # recomputed, and stored again


@pytest.mark.parametrize("name", ["glm5next-mtp", "glm5next-mtp2", "glm5next"])
def test_with_mtp_an_entry_is_offered_only_where_the_tokens_after_it_are_the_same(name, tmp_path):
    """The same prompt with the farthest token after the entry's last block that the drafter
    reads changed: the next one for one MTP module, the second for a chain of two (whose second
    module reads two tokens on). That MTP layer's KV in that block was computed with the old
    token, so placing it would serve wrong bytes to the drafter: not offered, recomputed.
    Without a drafter nothing stored depends on that token: restored as before."""
    from testing.vllm_scheduler import make_request

    root = tmp_path / "store"
    tokens, counters, _ = _publish_first(name, root)
    assert counters.get("captures_published", 0) >= 1, counters
    fw = _setup(name, root, seed=1)
    depth, bs = _depth(fw), fw.block_size
    reach = max(fw.draft_reach.values(), default=1)
    assert reach == {"glm5next-mtp2": 2}.get(name, 1)
    changed = list(tokens)
    changed[depth * bs + reach - 1] += 1
    if fw.draft_reach:  # the comparison could fail: that block's draft KV differs
        layer = max(sorted(fw.draft_reach), key=fw.draft_reach.get)
        assert not fw.expected_block(tokens, layer, depth - 1, depth * bs).equal(
            fw.expected_block(changed, layer, depth - 1, depth * bs))
    seen: dict = {}
    fw.after_load = lambda worker, plan: seen.setdefault("after", _check_placed(fw, changed, plan))
    request = make_request("changed", changed, max_tokens=2, block_size=bs)
    try:
        fw.run(request)
    finally:
        fw.close()
    if fw.draft_reach:
        assert fw.placed == [] and "after" not in seen
        assert request.num_computed_tokens >= len(tokens)  # recomputed to the end
    else:
        (placed,) = fw.placed
        assert placed.ok and len(placed.plan.keys) == depth and seen["after"] == []


def test_a_window_restored_after_a_local_hit_leaves_the_requests_own_blocks_alone(tmp_path):
    """Gemma 3 after a restart: a shorter prompt first puts the entry's first two blocks into
    vLLM's own prefix cache; the full prompt then hits them locally and restores only its last
    block from the store. Its window (two blocks) spans a local column and a loaded one: only
    the loaded column is placed (a local block is vLLM's, maybe shared), and the request's
    table then holds the forward's bytes in both."""
    from testing.vllm_scheduler import make_request

    root = tmp_path / "store"
    tokens, _, _ = _publish_first("gemma3", root)
    fw = _setup("gemma3", root, seed=1)
    bs, layout = fw.block_size, fw.worker.layout
    (window_group,), (k,) = layout.window_groups, layout.window_blocks
    assert k == 2
    marked: dict = {}

    def mark(worker, plan):  # the local window column gets bytes no forward writes
        column = plan.start_block - 1
        block = fw.scheduler.kv_cache_manager.get_block_ids(plan.req_id)[window_group][column]
        for layer in worker._layers(window_group):
            marked[layer] = (block, torch.full_like(fw.block(layer, block), 7))
            fw.write(layer, block, marked[layer][1])

    def check(worker, plan):
        marked["untouched"] = all(fw.block(layer, b).equal(v) for layer, (b, v) in list(marked.items()))
        marked["wrong"] = _check_placed(fw, tokens, plan)

    try:
        fw.run(make_request("shorter", tokens[:2 * bs + 10], max_tokens=2, block_size=bs))
        fw.placed.clear()
        fw.before_load, fw.after_load = mark, check
        fw.run(make_request("again", tokens, max_tokens=2, block_size=bs))
    finally:
        fw.close()
    (placed,) = fw.placed
    assert placed.ok and placed.plan.start_block == 2 and len(placed.plan.keys) == PROMPT_BLOCKS
    assert marked["untouched"], "a column the request held from vLLM's prefix cache was overwritten"
    assert marked["wrong"] == []  # what the load placed (column 2) is the forward's


@pytest.mark.parametrize("retention", [0, None], ids=["retention-0", "dense"])
@pytest.mark.parametrize("name", ["glm5next-mtp", "nemotronh-ngram"])
def test_with_draft_tokens_scheduled_and_rejected_only_accepted_state_is_stored(name, retention, tmp_path):
    """Speculative decoding for real on vLLM's scheduler: every decode step schedules the
    drafter's proposals, and the model accepts them on one step and rejects them on the next, so
    the forward writes draft bytes into the KV and the recurrent columns (``FieldWorker``: a
    step computes its drafts too). The next turn repeats the conversation (prompt and every
    accepted token) and adds to it; its entry is published; after a restart it is placed, and
    every placed block and state equals what the forward writes for the accepted tokens. No
    capture is planned in a step that scheduled drafts for its request, under production's
    retention and under dense retention, so no draft state can be stored. (The forward writes a
    drafting step's state after all its drafts into the running column, where vLLM keeps one per
    position; no capture reads a drafting step's columns, so the difference is not exercised.)"""
    from testing.vllm_scheduler import make_request

    root = tmp_path / "store"
    fw = _setup(name, root, seed=0, retention_interval=retention)
    bs, k = fw.block_size, fw.scheduler.vllm_config.speculative_config.num_speculative_tokens
    proposals, step_out = {"n": 0}, {}
    drafted: dict[str, int] = {"scheduled": 0, "rejected": 0}
    captured_with_drafts: list[str] = []

    def drafts(request):
        proposals["n"] += 1
        return [(request.num_tokens * 7 + i) % 400 + 3 for i in range(k)]

    def sample(request):
        """Accept every draft on even steps (the drafts and one more), none on odd ones."""
        spec = list(step_out["out"].scheduled_spec_decode_tokens.get(request.request_id, ()))
        drafted["scheduled"] += len(spec)
        if spec and proposals["n"] % 2 == 0:
            return spec + [(request.num_tokens * 11) % 400 + 3]
        drafted["rejected"] += len(spec)
        return (request.num_tokens * 13) % 400 + 3

    on_scheduled = fw.on_scheduled

    def watch(out):
        step_out["out"] = out
        meta = out.kv_connector_metadata
        captured_with_drafts.extend(p.req_id for p in (meta.captures if meta else ())
                                    if out.scheduled_spec_decode_tokens.get(p.req_id))
        return on_scheduled(out)

    fw.on_scheduled, fw.sample, fw.drafts = watch, sample, drafts
    first = make_request("first", _prompt(bs), max_tokens=3 * bs, block_size=bs)
    try:
        fw.run(first)
        conversation = list(first.all_token_ids)
        second_tokens = conversation + _prompt(bs, seed=2)[: bs + 5]
        fw.run(make_request("second", second_tokens, max_tokens=4, block_size=bs))
    finally:
        fw.close()
    assert drafted["scheduled"] > 0 and 0 < drafted["rejected"] < drafted["scheduled"], drafted
    assert captured_with_drafts == []
    assert fw.counters.get("captures_published", 0) >= 2, fw.counters

    fw, seen = _restore_after_restart(name, root, second_tokens)
    (placed,) = fw.placed
    assert placed.ok and len(placed.plan.keys) * bs > len(conversation) - 2 * bs, placed.plan
    assert seen["after"] == []
