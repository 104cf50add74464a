"""Duplicate reload of resident attention pages ("served by restore"), with vLLM's real Scheduler.

Shape (block size 16, hybrid FA + Mamba align, retention 0): attention blocks
are resident to 64, the Mamba state only at 16. A 100-token continuation is
admitted while the connector's store holds its first 80 tokens (store past the
local attention depth) or its first 64 (a tie), through the default lookup and
through upstream's divergent-hit lookup (``probe_divergent``).

Second shape (``deepmamba_*``): attention resident to 48 only, the Mamba state
cached at 80 (the attention tail above 48 evicted), so no depth is common to
both groups; the store holds 96, 48 or 0 tokens.

For every case: vLLM's local / external counts, the resume point, and how many
of the 4 resident attention blocks the request's allocated attention blocks
reuse (block ids compared with the ids that held that prefix before), plus a
validity check: the resume point has a valid Mamba state (resident or loaded)
and every attention token below it is resident or loaded.
"""

from __future__ import annotations

from testing.scenarios import option_readings
from testing.vllm_scheduler import (
    BLOCK_SIZE,
    admit,
    make_request,
    make_scheduler,
    per_group_hits,
    probe_connector,
    run_to_completion,
)

PROMPT = [1000 + i for i in range(100)]
ATTN_DEPTH = 64
MAMBA_DEPTH = 16


def _seed(scheduler) -> list[int]:
    """Attention resident to 64, Mamba state cached only at 16; returns the resident attention block ids."""
    run_to_completion(scheduler, make_request("seed-short", PROMPT[: MAMBA_DEPTH + 1], max_tokens=1))
    run_to_completion(scheduler, make_request("seed-long", PROMPT[: ATTN_DEPTH + 1], max_tokens=1))
    probe = make_request("probe", PROMPT, max_tokens=1)
    coordinator = scheduler.kv_cache_manager.coordinator
    pool = scheduler.kv_cache_manager.block_pool
    mamba_gid = 1
    # Evict Mamba states deeper than 16 (the retention-0 prompt checkpoint at 64).
    for _ in range(8):
        blocks, hits = coordinator.find_longest_cache_hit_per_group(probe.block_hashes, probe.num_tokens - 1)
        if hits[mamba_gid] <= MAMBA_DEPTH:
            break
        pool.evict_blocks({blocks[mamba_gid][-1].block_id})
    blocks, hits = coordinator.find_longest_cache_hit_per_group(probe.block_hashes, probe.num_tokens - 1)
    assert tuple(hits) == (ATTN_DEPTH, MAMBA_DEPTH), hits
    return [b.block_id for b in blocks[0][: ATTN_DEPTH // BLOCK_SIZE]]


DEEP_MAMBA = 80
SHALLOW_ATTN = 48


def _seed_deep_mamba(scheduler) -> list[int]:
    """Attention resident to 48 only, the Mamba state cached at 80 (its attention tail evicted)."""
    run_to_completion(scheduler, make_request("seed-deep", PROMPT[: DEEP_MAMBA + 1], max_tokens=1))
    probe = make_request("probe", PROMPT, max_tokens=1)
    coordinator = scheduler.kv_cache_manager.coordinator
    pool = scheduler.kv_cache_manager.block_pool
    blocks, hits = coordinator.find_longest_cache_hit_per_group(probe.block_hashes, probe.num_tokens - 1)
    assert hits[1] == DEEP_MAMBA, hits
    pool.evict_blocks({b.block_id for b in blocks[0][SHALLOW_ATTN // BLOCK_SIZE :]})
    blocks, hits = coordinator.find_longest_cache_hit_per_group(probe.block_hashes, probe.num_tokens - 1)
    assert tuple(hits) == (SHALLOW_ATTN, DEEP_MAMBA), hits
    assert scheduler.kv_cache_manager.get_computed_blocks(probe)[1] == 0  # no common depth
    return [b.block_id for b in blocks[0][: SHALLOW_ATTN // BLOCK_SIZE]]


def _case(options_on: bool, divergent: bool, store_tokens: int, seed=_seed) -> dict:
    extra = {"probe_divergent": divergent}
    if options_on:
        extra["sparkcache_prefer_local_prefix"] = True
    scheduler = make_scheduler(probe_connector(extra), num_blocks=100)
    resident = seed(scheduler)
    request = make_request("turn", PROMPT, max_tokens=1)
    before_hits = per_group_hits(scheduler, request)
    scheduler.connector.store_prefix(PROMPT[:store_tokens])
    hit = admit(scheduler, request)  # vLLM's own admission, read before a model output consumes its stats
    attn_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    reused = sum(1 for a, b in zip(attn_ids, resident) if a == b)
    local, external = hit["local"], hit["external"]
    resume = local + external
    # Validity: the Mamba state at the resume point is resident (local hit reaches it) or loaded
    # (an external load ends there), and attention below it is resident (local) or loaded.
    mamba_ok = resume == 0 or external > 0 or before_hits[1] >= resume
    attn_ok = local <= before_hits[0]
    return {
        "local": local,
        "external": external,
        "num_computed_tokens": hit["num_computed_tokens"],
        "resume": resume,
        "reused_resident_attention_blocks": reused,
        "resident_attention_blocks": len(resident),
        "recomputed_tokens": len(PROMPT) - resume,
        "valid": bool(mamba_ok and attn_ok),
        "connector_queries": [list(q[1:]) for q in scheduler.connector.queries if q[0] == "turn"],
    }


def run(options_on: bool, config_values: list | None = None) -> dict:
    """config_values: how the scheduler reads each sparkcache_prefer_local_prefix value instead."""
    if config_values is not None:
        return option_readings(
            [{"sparkcache_prefer_local_prefix": value} for value in config_values],
            lambda scheduler: getattr(scheduler, "sparkcache_prefer_local_prefix", None) is not None,
        )
    cases = {
        f"store{store}_{'divergent' if div else 'default'}": _case(options_on, div, store)
        for store in (80, 64, 0)
        for div in (False, True)
    }
    cases.update(
        {
            f"deepmamba_store{store}_{'divergent' if div else 'default'}": _case(
                options_on, div, store, _seed_deep_mamba
            )
            for store in (96, 48, 0)
            for div in (False, True)
        }
    )
    return cases


if __name__ == "__main__":
    import json

    print(json.dumps({"off": run(False)}, indent=1))
