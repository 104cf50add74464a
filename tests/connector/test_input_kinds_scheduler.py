"""Requests whose KV depends on more than their token ids, on vLLM's real Scheduler with
sparkcache's real scheduler side and a real on-disk store (model outputs synthetic).

A multimodal request and a prompt-embeds request carry the same token ids as a text
request (placeholders; ``[0] * n`` for embeddings), so a token-only key would offer one the
other's KV. Their keys cover each image's identifier and offset and each block's embeddings
(keys.py, test_block_keys.py): such a request is offered what was stored for the same
images or embeddings, and from another image's only the blocks before it.

Where a restore ends inside or after an image, vLLM's scheduler decides what the encoder
computes (``Scheduler._try_schedule_encoder_inputs``, vllm/v1/core/sched/scheduler.py): an item
with ``start_pos + num_encoder_tokens <= num_computed_tokens`` is skipped ("The encoder input
is already computed and stored in the decoder's KV cache"), and ``num_computed_tokens``
includes the external tokens the connector loaded; an item that ends past them is encoded
whole and the model takes the embeddings of its positions not yet computed. The last test
shows both on the real Scheduler, with a real multimodal model config (tiny Qwen2-VL, so the
scheduler has an encoder budget).
"""

from __future__ import annotations

import random

import pytest

from .scheduler_scenarios import BS, finish_all, make_scheduler, record_of, request, step

N = 200
WHOLE = (N - 1) // BS * BS  # what a full-prompt entry restores: every whole block but the last token's


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(N)]


def _feature(ident: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _vllm_request(rid: str, tokens: list[int], *, mm=(), embeds=None, max_tokens: int = 3):
    features = [_feature(ident, off, n) for ident, off, n in mm]
    return request(rid, tokens, mm_features=features or None, prompt_embeds=embeds, max_tokens=max_tokens)


def _publish(scheduler, req, blocks: int | None = None) -> int:
    """Publish ``blocks`` (default: every whole block) of ``req`` under the keys the connector
    computes for it."""
    from sparkcache.connector.keys import BlockKeys, request_extra_keys

    side = scheduler.connector._sched
    n = req.num_tokens // BS if blocks is None else blocks
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
    """Admit ``req`` on an emptied local prefix cache (so only the store can hold its
    prefix), then abort it (a text-only model config has no encoder budget, so an image
    request stops at its placeholders) and return its attribution record."""
    from vllm.v1.request import RequestStatus

    assert s.reset_prefix_cache()
    s.add_request(req)
    out = step(s)
    loads = [p for p in out.kv_connector_metadata.loads if p.req_id == req.request_id]
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    finish_all(s)
    rec = record_of(s, req.request_id)
    assert bool(loads) == (rec["external_tokens"] > 0)
    return rec


def test_a_text_prefix_is_offered_to_an_image_request_only_before_the_image(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(1)
    _publish(s, request("seed", prompt))
    # the control: a text request with these ids is restored whole (the test can fail)
    assert _run(s, request("text", prompt))["external_tokens"] == WHOLE
    rec = _run(s, _vllm_request("img", prompt, mm=[("image-a", 56, 32)]))
    assert rec["external_tokens"] == 48 and rec["input"] == "multimodal"  # blocks 0-2, before the image


def test_image_a_stored_is_restored_for_image_a_and_only_before_it_for_image_b(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    prompt = _prompt(2)
    # (an image starting inside block 3: this text-only config schedules no encoder, so a
    # request is only admitted with tokens to compute before its first image)
    _publish(s, _vllm_request("seed", prompt, mm=[("image-a", 56, 32)]))
    counters = _counted(s)
    assert _run(s, _vllm_request("b", prompt, mm=[("image-b", 56, 32)]))["external_tokens"] == 48
    assert _run(s, _vllm_request("moved", prompt, mm=[("image-a", 60, 32)]))["external_tokens"] == 48
    assert _run(s, _vllm_request("a", prompt, mm=[("image-a", 56, 32)]))["external_tokens"] == WHOLE
    assert _run(s, request("text", prompt))["external_tokens"] == 48
    assert counters["attr_external_tokens_multimodal"] == 48 + 48 + WHOLE
    assert counters["attr_external_tokens_text"] == 48
    assert not any(k.startswith("skipped_") for k in counters), counters


def test_prompt_embeds_are_restored_for_the_same_embeddings_only(tmp_path):
    import torch

    s = make_scheduler(str(tmp_path), hybrid=False)
    zeros = [0] * N
    embeds = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))
    other = embeds.clone()
    other[N // 2, 0] += 1.0  # one value in block 6
    _publish(s, request("text-zeros", zeros))
    _publish(s, _vllm_request("seed", zeros, embeds=embeds))
    counters = _counted(s)
    rec = _run(s, _vllm_request("same", zeros, embeds=embeds.clone()))
    assert rec["external_tokens"] == WHOLE and rec["input"] == "prompt_embeds"
    assert _run(s, _vllm_request("other", zeros, embeds=other))["external_tokens"] == N // 2 // BS * BS
    assert _run(s, _vllm_request("fresh", zeros, embeds=torch.randn(N, 8)))["external_tokens"] == 0
    assert _run(s, request("text", zeros))["external_tokens"] == WHOLE  # the text entry, not the embeddings'
    assert counters["attr_external_tokens_prompt_embeds"] == WHOLE + N // 2 // BS * BS


def test_a_streaming_update_that_adds_an_image_keys_it_as_a_request_built_whole(tmp_path):
    """vLLM's streaming sessions (``Scheduler._update_request_as_session``) append tokens and
    images to a request after the connector first keyed it."""
    from sparkcache.connector.keys import BlockKeys, request_extra_keys
    from vllm.v1.request import StreamingUpdate

    s = make_scheduler(str(tmp_path), hybrid=False)
    side = s.connector._sched
    prompt, more = _prompt(3), _prompt(4)[:100]
    req = _vllm_request("session", prompt)
    side.get_num_new_matched_tokens(req, 0)  # keyed while text only
    req.num_computed_tokens = N
    s._update_request_as_session(req, StreamingUpdate(
        mm_features=[_feature("image-a", 20, 32)], prompt_token_ids=more, max_tokens=3,
        arrival_time=0.0, sampling_params=req.sampling_params))
    whole = _vllm_request("whole", prompt + more, mm=[("image-a", N + 20, 32)])
    n = (N + 100) // BS
    expected = BlockKeys(BS, request_extra_keys(whole, None)).upto(whole.all_token_ids, n)
    text_only = BlockKeys(BS).upto(prompt + more, n)
    assert expected[:13] == text_only[:13] and expected[13] != text_only[13]  # the image starts in block 13
    assert side._keys(side.state(req), n) == expected


def test_an_input_that_cannot_be_keyed_is_skipped_not_raised(tmp_path):
    s = make_scheduler(str(tmp_path), hybrid=False)
    counters = _counted(s)
    req = _vllm_request("odd", _prompt(6))
    req.cache_salt = 1.5  # vLLM's msgspec requests are not type-checked at construction
    assert _run(s, req)["external_tokens"] == 0
    assert counters.get("skipped_unencodable_input") == 1


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


def _encoded_after_admission(s, req, restored: bool) -> list[int]:
    """Admit ``req`` (when ``restored``, its restore is planned, and reported done if it
    is asynchronous), then return the indices of its images the scheduler sent to the
    encoder in the step that scheduled its prefill."""
    from vllm.v1.request import RequestStatus

    s.add_request(req)
    out = step(s)
    if restored:
        assert any(p.req_id == req.request_id for p in out.kv_connector_metadata.loads)
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert not out.scheduled_encoder_inputs.get(req.request_id)
            out = step(s, recving=[req.request_id])
    assert req.request_id in out.num_scheduled_tokens
    encoded = sorted(out.scheduled_encoder_inputs.get(req.request_id, []))
    finish_all(s)
    return encoded


def encoder_scenario(root: str) -> dict:
    """The last test's scenario, in a process whose transformers and vLLM import torchvision
    through the shim from the start (``testing.torchvision_shim.site_dir``): image 0 lies
    wholly inside the restored 128 tokens, image 1 straddles their end."""
    from testing.tinyvlm import make_tiny_vlm
    from testing.torchvision_shim import install_for_vllm

    install_for_vllm()
    model = make_tiny_vlm()
    prompt = _prompt(7)
    images = [("image-x", 20, 16), ("image-y", 112, 32)]
    # each in a scheduler of its own: vLLM's encoder cache keeps an image's output for the
    # next request with that image
    s = make_scheduler(root + "/cold", hybrid=False, model=model)
    out = {"encoder_budget": s.max_num_encoder_input_tokens,
           "cold": _encoded_after_admission(s, _vllm_request("cold", prompt, mm=images), restored=False)}
    s = make_scheduler(root + "/warm", hybrid=False, model=model)
    _publish(s, _vllm_request("seed", prompt, mm=images), blocks=8)
    out["warm"] = _encoded_after_admission(s, _vllm_request("warm", prompt, mm=images), restored=True)
    out["warm_external"] = record_of(s, "warm")["external_tokens"]
    return out


def test_the_scheduler_encodes_only_the_images_not_wholly_restored(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from testing.torchvision_shim import site_dir

    tests = Path(__file__).resolve().parents[1]
    code = ("import json, sys; from connector.test_input_kinds_scheduler import encoder_scenario; "
            "print('RESULT', json.dumps(encoder_scenario(sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir()), str(tests.parent), str(tests)]))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["encoder_budget"] > 0  # a multimodal config: the encoder is scheduled
    assert out["cold"] == [0, 1]  # the control: nothing stored, both images encoded
    assert out["warm_external"] == 128
    assert out["warm"] == [1]
