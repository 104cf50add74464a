"""A growing conversation on vLLM's real Scheduler: all three transforms together.

Hybrid full attention + Mamba "align", production retention (0), block 16.
Each turn's prompt is the previous turn's whole sequence (prompt + reply) plus
new tokens. Each finished turn is captured asynchronously (the ProbeConnector
delays its free until finished_sending). After the capture, eviction pressure
takes, by a real allocation from the free queue's head, every free block queued
ahead of the conversation's resident attention blocks: the attention pages all
survive, as in Report A (KV usage low, lease not expired).

The reusable prefix a turn leaves behind is the deepest block boundary its
computed tokens reached: floor((prompt + reply - 1) / 16) * 16. With every
transform on, each continuation turn's local hit must equal it; on the pristine
tree the recurrent state there is either never kept (no decode checkpoint) or
evicted ahead of its attention partners, and the hit falls short.
"""

from __future__ import annotations

from testing import vllm_scheduler as h

TURNS = 6
START_TOKENS = 100
NEW_TOKENS_PER_TURN = 40
REPLY_TOKENS = 30
NUM_BLOCKS = 200

ALL_OPTIONS = {
    "sparkcache_gpu_lease_seconds": 300.0,
    "sparkcache_prefer_local_prefix": True,
    "sparkcache_retain_decode_checkpoint": True,
    "sparkcache_drop_superseded_checkpoint": True,
}


def _free_queue_positions(block_pool) -> dict[int, int]:
    queue = block_pool.free_block_queue
    positions, block, i = {}, queue.fake_free_list_head.next_free_block, 0
    while block is not queue.fake_free_list_tail:
        positions[block.block_id] = i
        block, i = block.next_free_block, i + 1
    return positions


def _pressure_sparing_attention(scheduler, request) -> int:
    """Allocate (and hand back unhashed) every free block queued ahead of request's attention blocks."""
    block_pool = scheduler.kv_cache_manager.block_pool
    positions = _free_queue_positions(block_pool)
    attention_ids = []
    for block_hash in request.block_hashes:
        cached = block_pool.get_cached_block(block_hash, [0])
        if cached:
            attention_ids.append(cached[0].block_id)
    ahead = min((positions[b] for b in attention_ids if b in positions), default=0)
    block_pool.free_blocks(block_pool.get_new_blocks(ahead))
    return ahead


def run(options_on: bool) -> dict:
    extra = {"probe_delay_free": True, **(ALL_OPTIONS if options_on else {})}
    scheduler = h.make_scheduler(h.probe_connector(extra), num_blocks=NUM_BLOCKS)
    conversation = list(range(1000, 1000 + START_TOKENS))
    turns = []
    reusable = 0
    for turn in range(TURNS):
        request = h.make_request(f"turn{turn}", conversation, REPLY_TOKENS)
        hit = h.first_schedule_hit(scheduler, request, token_id=10 + turn)
        h.run_to_completion(scheduler, request, token_id=10 + turn)
        # The capture finishes; its lease ends and the blocks go back to the pool.
        h.step(scheduler, finished_sending={request.request_id})
        evicted = _pressure_sparing_attention(scheduler, request)
        turns.append(
            {
                "turn": turn,
                "prompt_tokens": request.num_prompt_tokens,
                "local_hit": hit["local"],
                "external": hit["external"],
                "previous_reusable_prefix": reusable,
                "pressure_evicted_blocks": evicted,
            }
        )
        total = len(request.all_token_ids)
        reusable = (total - 1) // h.BLOCK_SIZE * h.BLOCK_SIZE
        new = list(range(5000 + 100 * turn, 5000 + 100 * turn + NEW_TOKENS_PER_TURN))
        conversation = list(request.all_token_ids) + new
    continuation = turns[1:]
    return {
        "options_on": options_on,
        "turns": turns,
        "continuation_turns": len(continuation),
        "continuation_turns_full_local_hit": sum(t["local_hit"] == t["previous_reusable_prefix"] for t in continuation),
        "local_hit_tokens": sum(t["local_hit"] for t in continuation),
        "reusable_prefix_tokens": sum(t["previous_reusable_prefix"] for t in continuation),
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(options_on="--on" in sys.argv), indent=2))
