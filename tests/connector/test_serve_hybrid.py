"""``vllm serve`` with a hybrid model (the long-memory tiny NemotronH of
``test_engine_hybrid``: Mamba2 + attention, ``--mamba-cache-mode align``), sparkcache
read-write, a 6-turn chat across two server lives on one store: turns 1-3, a restart,
turns 4-6.

For every turn ``usage.prompt_tokens_details.cached_tokens`` equals the attribution record's
``local_hit_tokens + external_tokens``. Turn 4, the first after the restart, is restored from
the store (pages and recurrent state), and the second server's ``/metrics`` counts that
restore as a recurrent-state restore with the state's bytes, next to the attributed tokens.
"""

from __future__ import annotations

import pytest

from .test_engine_hybrid import BLOCK
from .test_serve_chat import _record, _value, converse, serve, settled_metrics

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HYBRID_ARGS = ("--mamba-cache-mode", "align", "--max-num-batched-tokens", str(BLOCK))
# A capture that finds every slot still publishing is skipped (serving never waits for the
# disk); the turns here follow each other faster than a disk busy with another job's writes
# publishes, so each turn's capture gets a slot of its own (a small one: they are small).
SLOTS = {"capture_slots": 8, "capture_slot_bytes": "64MiB"}


@pytest.fixture(scope="module")
def lives(hybrid_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-hybrid")
    root = tmp / "store"
    messages: list[dict] = [{"role": "system", "content": "you answer briefly"}]
    out = {}
    with serve(hybrid_model, tmp, root, block_size=BLOCK, extra_args=HYBRID_ARGS, extra_config=SLOTS) as srv:
        out["first"] = converse(srv["base"], messages, range(0, 3))
        out["first_metrics"], _ = settled_metrics(srv["base"], 3)
    with serve(hybrid_model, tmp, root, block_size=BLOCK, extra_args=HYBRID_ARGS, extra_config=SLOTS) as srv:
        out["second"] = converse(srv["base"], messages, range(3, 6))
        out["second_metrics"], _ = settled_metrics(srv["base"], 3)
    return out


def test_cached_tokens_match_the_record_on_every_turn(lives):
    for i, resp in enumerate(lives["first"] + lives["second"]):
        rec, usage = _record(resp), resp["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(f"turn {i + 1}: prompt={usage['prompt_tokens']} cached={cached} record={rec}")
        assert rec["complete"] and rec["prompt_tokens"] == usage["prompt_tokens"], (i, rec, usage)
        assert rec["local_hit_tokens"] + rec["external_tokens"] + rec["recomputed_tokens"] == rec["prompt_tokens"]
        assert cached == rec["local_hit_tokens"] + rec["external_tokens"], (i, cached, rec)


def test_the_turn_after_the_restart_is_restored_with_its_recurrent_state(lives):
    first = lives["first_metrics"]
    # every turn of the first life published its capture (the deepest state of each prompt)
    assert {o: _value(first, "vllm:sparkcache_captures_total", outcome=o) for o in (
        "queued", "published", "publish_failed", "skipped_slots_full", "skipped_too_large")} == {
        "queued": 3, "published": 3, "publish_failed": 0, "skipped_slots_full": 0, "skipped_too_large": 0}
    first_after = _record(lives["second"][0])
    previous_prompt = lives["first"][-1]["usage"]["prompt_tokens"]
    assert first_after["local_hit_tokens"] == 0
    # the deepest stored state that fits: the last block boundary vLLM computed a state at in the
    # previous turn's prefill (its last prompt token is always computed, so a prompt of whole
    # blocks leaves its state one block short), or deeper
    assert first_after["external_tokens"] >= (previous_prompt - 1) // BLOCK * BLOCK > 0
    m = lives["second_metrics"]
    assert _value(m, "vllm:sparkcache_state_restores_total", outcome="ok") >= 1
    assert _value(m, "vllm:sparkcache_state_restores_total", outcome="refused") == 0
    assert _value(m, "vllm:sparkcache_restored_bytes_total", kind="state") > 0
    assert _value(m, "vllm:sparkcache_attributed_tokens_total", source="external") == sum(
        _record(r)["external_tokens"] for r in lives["second"])
    # the first life published pages and states
    assert _value(lives["first_metrics"], "vllm:sparkcache_captured_bytes_total", kind="state") > 0


def test_the_histograms_count_every_restore_and_publication(lives):
    """Each restore and each publication is one sample of its latency histogram (and, when it
    placed or wrote bytes, of its size histogram); each request's captures settling, one
    sample of the capture wait."""
    for life in ("first_metrics", "second_metrics"):
        m = lives[life]
        restores = sum(_value(m, "vllm:sparkcache_restores_total", outcome=o) for o in ("ok", "refused"))
        assert _value(m, "vllm:sparkcache_restore_seconds_count") == restores, life
        assert _value(m, "vllm:sparkcache_restore_bytes_count") == _value(
            m, "vllm:sparkcache_restores_total", outcome="ok"), life
        published = _value(m, "vllm:sparkcache_captures_total", outcome="published")
        failed = _value(m, "vllm:sparkcache_captures_total", outcome="publish_failed")
        assert published > 0 and _value(m, "vllm:sparkcache_publication_seconds_count") == published + failed
        assert _value(m, "vllm:sparkcache_publication_bytes_count") == published
        assert _value(m, "vllm:sparkcache_capture_wait_seconds_count") >= 3  # each turn settles once or more
        assert _value(m, "vllm:sparkcache_maintenance_pass_seconds_count") == _value(
            m, "vllm:sparkcache_maintenance_passes_total")
    assert _value(lives["second_metrics"], "vllm:sparkcache_restore_seconds_count") >= 1
