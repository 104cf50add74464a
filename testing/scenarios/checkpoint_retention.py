"""Scenario: no decode-time recurrent checkpoint (checkpoint_retention).

A hybrid (full attention + Mamba "align") request with a 40-token prompt
decodes 30 tokens; the next turn's prompt repeats that whole conversation
(prompt + the 30 output tokens) and adds new tokens. With production
retention (``prefix_cache_retention_interval`` 0) only the prompt's replay
boundary state (32) is hashed, so the next turn hits locally at 32 although
every attention block up to 64 is resident. With dense retention (None,
the reference) the decode boundaries 48 and 64 are hashed too and the next
turn hits 64. The checkpoint_retention transform, opted in through
``sparkcache_retain_decode_checkpoint``, keeps the newest block-aligned
decode state (64); with ``sparkcache_drop_superseded_checkpoint`` it drops
the decode state it supersedes (48), so retention 0 plus the option hashes
[32, 64] and the next turn hits 64.
"""

from __future__ import annotations

from testing import vllm_scheduler as h
from testing.scenarios import option_readings

PROMPT_TOKENS = 40
OUTPUT_TOKENS = 30
NEW_TOKENS = 20
ENDS_ON_BOUNDARY_OUTPUT_TOKENS = 25  # the last step computes token 63: state at 64
NUM_BLOCKS = 100
SAMPLED_TOKEN = 7
# Preemption mid-prefill: a pool of 21 blocks, 16-token chunks; request "long" (240 prompt tokens,
# replay boundary 224) is preempted at 208 computed tokens when "grower" (40 + 20) needs a block,
# and resumes once grower finishes, before anything evicts its blocks.
PREEMPT_NUM_BLOCKS = 21
PREEMPT_GROWER_OUTPUT = 20
PREEMPT_BATCHED_TOKENS = 17
PREEMPT_LONG_PROMPT = 240

RETAIN_KEY = "sparkcache_retain_decode_checkpoint"
DROP_KEY = "sparkcache_drop_superseded_checkpoint"


MAMBA_GROUP = 1


def _mamba_hashed_blocks(scheduler) -> list:
    from vllm.v1.core.kv_cache_utils import get_group_id

    pool = scheduler.kv_cache_manager.block_pool
    return [b for b in pool.blocks if b.block_hash is not None and get_group_id(b.block_hash) == MAMBA_GROUP]


def _mamba_state_positions(scheduler) -> list[int]:
    """Token positions of every hashed (cached) Mamba state block, sorted."""
    return sorted(int(b.block_hash_num_tokens) for b in _mamba_hashed_blocks(scheduler))


def _run_tracking_states(scheduler, request) -> dict[int, int]:
    """Run request to completion; block id -> token count of the running state
    the worker last wrote there (vllm/v1/worker/mamba_utils.py preprocess_mamba:
    a step's running state lives in block cdiv(computed + scheduled, block_size) - 1)."""
    from vllm.v1.request import RequestStatus

    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[MAMBA_GROUP]
    written: dict[int, int] = {}
    update_from_output = scheduler.update_from_output

    def record_then_update(out, runner_out):
        # Between schedule and update: the step's blocks, before a finish frees them.
        if out.num_scheduled_tokens.get(request.request_id, 0):
            end = request.num_computed_tokens  # advanced by this step's schedule
            blocks = manager.req_to_blocks.get(request.request_id) or []
            idx = -(-end // h.BLOCK_SIZE) - 1
            if 0 <= idx < len(blocks) and not blocks[idx].is_null:
                written[blocks[idx].block_id] = end
        return update_from_output(out, runner_out)

    scheduler.update_from_output = record_then_update
    scheduler.add_request(request)
    try:
        for _ in range(1000):
            h.step(scheduler, SAMPLED_TOKEN)
            if RequestStatus.is_finished(request.status):
                return written
    finally:
        del scheduler.update_from_output
    raise RuntimeError("request did not finish")


def _one_case(extra_config: dict | None, retention_interval: int | None, output_tokens: int = OUTPUT_TOKENS) -> dict:
    scheduler = h.make_scheduler(
        h.probe_connector(extra_config), num_blocks=NUM_BLOCKS, retention_interval=retention_interval
    )
    prompt = [100 + i for i in range(PROMPT_TOKENS)]
    first = h.make_request("turn-1", prompt, max_tokens=output_tokens)
    written = _run_tracking_states(scheduler, first)
    output = list(first.output_token_ids)
    states = _mamba_state_positions(scheduler)
    # Every hashed state past the prompt must sit in the block the worker last
    # wrote the running state into, at exactly its hashed position.
    invalid = [
        (block.block_id, block.block_hash_num_tokens, written.get(block.block_id))
        for block in _mamba_hashed_blocks(scheduler)
        if block.block_hash_num_tokens >= PROMPT_TOKENS
        and written.get(block.block_id) != block.block_hash_num_tokens
    ]
    next_prompt = prompt + output + [300 + i for i in range(NEW_TOKENS)]
    second = h.make_request("turn-2", next_prompt, max_tokens=1)
    per_group = h.per_group_hits(scheduler, second)
    hit = h.admit(scheduler, second)
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": len(output),
        "next_prompt_tokens": len(next_prompt),
        "mamba_state_positions": states,
        "decode_states_invalid": invalid,
        "per_group_hits": list(per_group),
        "next_turn_local_hit": hit["local"],
        "next_turn_external": hit["external"],
        "next_turn_num_computed_tokens": hit["num_computed_tokens"],
    }


def _preempted_mid_prefill(extra_config: dict | None) -> dict:
    """The pool preempts "long" mid-prefill; where it resumes, and whether the state hashed at its
    preemption point is the one the worker wrote there (the running-state rule above)."""
    from vllm.v1.request import RequestStatus

    scheduler = h.make_scheduler(
        h.probe_connector(extra_config),
        num_blocks=PREEMPT_NUM_BLOCKS,
        retention_interval=0,
        max_num_batched_tokens=PREEMPT_BATCHED_TOKENS,
    )
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[MAMBA_GROUP]
    grower = h.make_request("grower", [100 + i for i in range(PROMPT_TOKENS)], max_tokens=PREEMPT_GROWER_OUTPUT)
    long = h.make_request("long", [500 + i for i in range(PREEMPT_LONG_PROMPT)], max_tokens=5)
    written: dict[int, int] = {}  # block id -> tokens of the running state the worker last wrote there
    preemptions: list[dict] = []
    resumed_at: list[int] = []
    free = scheduler._free_request_blocks

    def watch_free(request):
        """At long's preemption: its running state's block, the position it is hashed at (if any)
        and the position of the state the worker wrote there."""
        blocks = list(manager.req_to_blocks.get(request.request_id) or [])
        free(request)
        if request is long and request.status == RequestStatus.RUNNING:
            idx = request.num_computed_tokens // h.BLOCK_SIZE - 1
            block = blocks[idx] if 0 <= idx < len(blocks) and not blocks[idx].is_null else None
            preemptions.append({
                "at": request.num_computed_tokens,
                "state_hashed_at": block.block_hash_num_tokens if block is not None else None,
                "state_written_at": written.get(block.block_id) if block is not None else None,
            })

    def record(out):
        for rid in out.num_scheduled_tokens:
            end = scheduler.requests[rid].num_computed_tokens  # advanced by this step's schedule
            blocks = manager.req_to_blocks.get(rid) or []
            idx = -(-end // h.BLOCK_SIZE) - 1
            if 0 <= idx < len(blocks) and not blocks[idx].is_null:
                written[blocks[idx].block_id] = end
        cached = out.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if rid == long.request_id and rid in cached.resumed_req_ids:
                resumed_at.append(computed)

    scheduler._free_request_blocks = watch_free
    scheduler.add_request(grower)
    scheduler.add_request(long)
    for _ in range(1000):
        h.step(scheduler, SAMPLED_TOKEN, on_scheduled=record)
        if all(RequestStatus.is_finished(r.status) for r in (grower, long)):
            break
    else:
        raise RuntimeError("the preemption scenario did not finish")
    return {"preemptions": preemptions, "resumed_at": resumed_at}


def _decode_checkpoint_options(scheduler) -> list:
    """(retain, drop) as the Mamba manager was configured by the transformed scheduler."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[MAMBA_GROUP]
    kept = getattr(manager, "sparkcache_decode_checkpoints", None)
    return [kept is not None, kept is not None and kept.drop_superseded]


def run(options_on: bool, config_values: list | None = None) -> dict:
    """retention_0: production retention, with both keys when options_on;
    dense_reference: dense retention (None), no keys (the reference);
    ends_on_boundary_delayed_free: 40 + 25 tokens, the run ends with the state at 64,
    the connector delays the free;
    retain_only (options_on only): retention 0 with the first key alone.
    config_values: how the scheduler reads each extra-config dict of the two keys instead."""
    if config_values is not None:
        return option_readings(config_values, _decode_checkpoint_options, num_blocks=NUM_BLOCKS)
    keys = {RETAIN_KEY: True, DROP_KEY: True} if options_on else {}
    result = {
        "options_on": options_on,
        "retention_0": _one_case(keys or None, retention_interval=0),
        "dense_reference": _one_case(None, retention_interval=None),
        # The last decode step ends exactly on 64 and the connector delays the
        # free: _connector_finished retires blocks first; the state at 64 must
        # survive in the block that holds it.
        "ends_on_boundary_delayed_free": _one_case(
            {"probe_delay_free": True, **keys}, retention_interval=0, output_tokens=ENDS_ON_BOUNDARY_OUTPUT_TOKENS
        ),
    }
    result["preempted_mid_prefill"] = _preempted_mid_prefill(keys or None)
    if options_on:
        result["retain_only"] = _one_case({RETAIN_KEY: True}, retention_interval=0)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps({"off": run(False), "on": run(True)}, indent=1))
