"""Requests whose KV depends on more than their token ids, on vLLM's real Scheduler with
sparkcache's real scheduler side and a real on-disk store (model outputs synthetic).

A multimodal request and a prompt-embeds request carry the same token ids as a text
request (placeholders; ``[0] * n`` for embeddings), so a token-only key offers one the
other's KV. Their keys differ (test_block_keys.py); until their restore is shown end to
end they are neither offered nor captured, and counted by reason."""

from __future__ import annotations

import random

from .scheduler_scenarios import BS, finish_all, make_scheduler, record_of, request, step

N = 200


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(N)]


def _vllm_request(rid: str, tokens: list[int], *, mm=(), embeds=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n))
                for ident, off, n in mm]
    return request(rid, tokens, mm_features=features or None, prompt_embeds=embeds)


def _publish(scheduler, req) -> int:
    """Publish the whole blocks of ``req`` under the keys the connector computes for it."""
    from sparkcache.connector.keys import BlockKeys, request_extra_keys

    side = scheduler.connector._sched
    n = req.num_tokens // BS
    keys = BlockKeys(BS, request_extra_keys(req, None)).upto(req.all_token_ids, n)
    pages = [bytes([p % 251]) * 64 for p in range(-(-n // side.bpp))]
    assert side.store.publish(side.identity, keys, pages).ok
    return n * BS


def _counted(s) -> dict:
    """Every counter the scheduler side hands to vLLM's stats from now on, summed."""
    side, seen = s.connector._sched, {}
    take = side.take_counters

    def taking() -> dict:
        data = take()
        for k, v in data.items():
            seen[k] = seen.get(k, 0) + v
        return data

    side.take_counters = taking
    return seen


def _run(s, req) -> dict:
    """Admit ``req``, then abort it (a text-only model config has no encoder budget, so an
    image request stops at its placeholders) and return its attribution record."""
    from vllm.v1.request import RequestStatus

    s.add_request(req)
    out = step(s)
    loads = [p for p in out.kv_connector_metadata.loads if p.req_id == req.request_id]
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    finish_all(s)
    rec = record_of(s, req.request_id)
    assert bool(loads) == (rec["external_tokens"] > 0)
    return rec


def test_text_prefix_is_offered_to_text_but_never_to_an_image_with_the_same_ids(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(1)
    _publish(s, request("seed", prompt))
    # the control: a text request with these ids is restored (the test can fail)
    assert _run(s, request("text", prompt))["external_tokens"] == (N - 1) // BS * BS
    assert _run(s, _vllm_request("img", prompt, mm=[("image-a", 48, 32)]))["external_tokens"] == 0


def test_image_a_stored_is_never_offered_to_image_b(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(2)
    _publish(s, _vllm_request("seed", prompt, mm=[("image-a", 48, 32)]))
    counters = _counted(s)
    for rid, ident in (("b", "image-b"), ("a", "image-a")):
        rec = _run(s, _vllm_request(rid, prompt, mm=[(ident, 48, 32)]))
        assert rec["external_tokens"] == 0, rid
    assert counters.get("skipped_multimodal") == 2 and "offered_tokens" not in counters


def test_prompt_embeds_never_take_the_kv_of_zero_token_ids(tmp_path):
    import torch

    s = make_scheduler(str(tmp_path), hybrid=False)
    zeros = [0] * N
    stored = _publish(s, request("seed", zeros))
    assert stored
    embeds = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))
    counters = _counted(s)
    rec = _run(s, _vllm_request("emb", zeros, embeds=embeds))
    assert rec["external_tokens"] == 0
    assert counters.get("skipped_prompt_embeds") == 1
    # its 200 computed tokens are not captured under any key
    assert not s.connector._sched.unsettled


def test_an_image_added_by_a_streaming_update_stops_offers_and_captures(tmp_path):
    """vLLM's streaming sessions (``_update_request_as_session``) extend a request's
    ``mm_features`` after the connector first saw it; the gate is asked again each time."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(3)
    _publish(s, request("seed", prompt))
    side = s.connector._sched
    counters = _counted(s)
    req = _vllm_request("session", prompt)
    assert side.get_num_new_matched_tokens(req, 0)[0] > 0  # text so far: offered
    req.mm_features.append(MultiModalFeatureSpec(data=None, modality="image", identifier="image-a",
                                                 mm_position=PlaceholderRange(offset=48, length=32)))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    req.num_computed_tokens = N
    assert side._capture_plan(side.state(req), req, ([1] * (N // BS),)) is None
    side.take_counters()
    assert counters.get("skipped_multimodal") == 1


def test_after_vllm_resets_the_connector_cache_nothing_is_offered_or_captured(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(4)
    _publish(s, request("seed", prompt))
    counters = _counted(s)
    assert _run(s, request("before", prompt))["external_tokens"] > 0
    assert s.reset_prefix_cache(reset_connector=True)  # what vLLM does after a weight update
    assert _run(s, request("after", prompt))["external_tokens"] == 0
    long_one = request("after-long", _prompt(5), max_tokens=2)
    s.add_request(long_one)
    finish_all(s)
    assert not s.connector._sched.unsettled  # computed, but not captured
    assert counters.get("skipped_after_reset") == 2


def test_an_input_that_cannot_be_keyed_is_skipped_not_raised(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    counters = _counted(s)
    req = _vllm_request("odd", _prompt(6))
    req.cache_salt = 1.5  # vLLM's msgspec requests are not type-checked at construction
    assert _run(s, req)["external_tokens"] == 0
    assert counters.get("skipped_unencodable_input") == 1
