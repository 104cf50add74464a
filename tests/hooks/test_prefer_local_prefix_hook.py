"""sparkcache.hooks.prefer_local_prefix in-process, on vLLM 0.32.0's real (pristine) Scheduler
and block pool with the scenarios' ProbeConnector: the lookup at the attention depth and every
row of the connector-asking table. The transformed scheduler's use of it is
tests/transforms/test_prefer_local_prefix.py (both trees, in a subprocess)."""

from __future__ import annotations

import pytest

from sparkcache.hooks.prefer_local_prefix import KEY, LocalPrefixFirst
from testing.scenarios import prefer_local_prefix as shapes
from testing.vllm_scheduler import BLOCK_SIZE, make_request, make_scheduler, probe_connector


def _seeded(seed=shapes._seed, store_tokens: int = 0):
    """A scheduler whose attention is resident deeper than its Mamba state, the hook, a 100-token
    turn, and the store holding its first store_tokens."""
    scheduler = make_scheduler(probe_connector({KEY: True}), num_blocks=100)
    seed(scheduler)
    scheduler.connector.store_prefix(shapes.PROMPT[:store_tokens])
    return scheduler, LocalPrefixFirst(scheduler), make_request("turn", shapes.PROMPT, max_tokens=1)


def test_attach_reads_the_option_as_the_connector_does():
    assert LocalPrefixFirst.attach(make_scheduler(probe_connector({KEY: True}))) is not None
    assert LocalPrefixFirst.attach(make_scheduler(probe_connector({KEY: False}))) is None
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['sparkcache_prefer_local_prefix'\]='false'"):
        LocalPrefixFirst.attach(make_scheduler(probe_connector({KEY: "false"})))


def test_local_hit_is_the_attention_depth_and_says_it_diverged():
    scheduler, hook, turn = _seeded()
    blocks, tokens, boundary, diverged = hook.local_hit(turn)
    assert (tokens, boundary, diverged) == (shapes.ATTN_DEPTH, 0, True)
    assert len(blocks.blocks[0]) == shapes.ATTN_DEPTH // BLOCK_SIZE
    # Upstream's own lookup stops where both groups agree.
    assert scheduler.kv_cache_manager.get_computed_blocks(turn)[1] == shapes.MAMBA_DEPTH


def test_local_hit_reports_attention_below_a_deeper_mamba_checkpoint():
    scheduler, hook, turn = _seeded(seed=shapes._seed_deep_mamba)
    _, tokens, _, diverged = hook.local_hit(turn)
    assert (tokens, diverged) == (shapes.SHALLOW_ATTN, True)
    # Upstream's connector lookup falls back to the common depth (none) without saying so.
    _, upstream_tokens, _, upstream_diverged = scheduler.kv_cache_manager.get_computed_blocks_for_connector(turn)
    assert (upstream_tokens, upstream_diverged) == (0, False)


# store end S -> (local tokens resumed at, external tokens, diverged) with L=64 attention, H=16 Mamba
@pytest.mark.parametrize("store_tokens,expected", [
    (80, (64, 16, True)),  # S > L: keep every resident attention block, load only past L
    (64, (48, 16, True)),  # S == L (a tie): reload the last block with the state at S
    (48, (32, 16, True)),  # H < S < L: resume one block below S
    (16, (16, 0, False)),  # S <= H: the hybrid hit, nothing external
    (0, (16, 0, False)),
])
def test_ask_connector_never_reloads_more_than_one_resident_block(store_tokens, expected):
    scheduler, hook, turn = _seeded(store_tokens=store_tokens)
    blocks, num_local, _, diverged = hook.local_hit(turn)
    blocks, num_local, ext, load_async, diverged = hook.ask_connector(turn, blocks, num_local, diverged)
    assert (num_local, ext, diverged) == expected
    assert load_async is False
    assert len(blocks.blocks[0]) == num_local // BLOCK_SIZE
    # The connector's last answer is for the depth finally chosen.
    assert scheduler.connector.queries[-1][1:] == (num_local, ext)


def test_ask_connector_not_diverged_clamps_a_claim_below_the_local_hit():
    scheduler, hook, turn = _seeded(store_tokens=32)
    blocks, num_local, _, _ = hook.local_hit(turn)
    assert hook.ask_connector(turn, blocks, num_local, False)[1:] == (num_local, 0, False, False)
