"""Never restore another input's KV, end to end on the real CPU engine (vllm.LLM, prefix
caching on, read-write, kv_load_failure_policy="recompute"), each life a fresh process on
the same store root:

0. connector absent, LoRA on: the reference outputs of one 2,100-token prompt with no
   adapter, with adapter A and with adapter B (tiny random adapters made offline);
1. read-write, cold, on a copy of the model: the prompt under cache_salt s1, and under A;
2. in the same life, the GPU prefix cache emptied (contracts/engine_driver.py, ``"phases"``):
   under salt s2 and under B nothing is restored (another tenant, another adapter); under s1
   and under A the stored prefix is restored with identical output;
3. after a restart, the copy's weights rewritten in place (one tensor, same size, same path):
   nothing is restored, and the output is what the new weights give.
"""

from __future__ import annotations

import shutil

import pytest

from .conftest import long_prompt, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
PROMPT = long_prompt(2100, seed=5)
REUSABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # 2080
LORA = {"max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    from testing.tinymodel import make_tiny_lora

    a = {"name": "a", "id": 1, "path": make_tiny_lora(tiny_model, seed=1)}
    b = {"name": "b", "id": 2, "path": make_tiny_lora(tiny_model, seed=2)}
    model = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_model, model)
    root = tmp_path_factory.mktemp("store")
    base = {"prompts": [], "max_tokens": 16, "block_size": BLOCK, "lora": LORA}
    rw = {**base, "model": str(model), "connector": "sparkcache",
          "extra": {"root": str(root), "min_span_tokens": 64}}

    def ask(salt=None, lora=None):
        return {"ids": PROMPT, "cache_salt": salt, "lora": lora}

    out = {}
    out["reference"] = run_engine({**base, "model": tiny_model, "connector": "none",
                                   "prompts": [ask(), ask(lora=a), ask(lora=b)]})
    out["cold"], out["second"] = run_engine({**rw, "phases": [
        {"prompts": [ask(salt="s1"), ask(lora=a)]},
        {"prompts": [ask(salt="s2"), ask(salt="s1"), ask(lora=b), ask(lora=a)]}]})["phases"]
    _rewrite_one_tensor(model / "model.safetensors")
    out["new_weights"] = run_engine({**rw, "prompts": [ask(salt="s1"), ask()]})
    return out


def _rewrite_one_tensor(path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    emb = tensors["model.embed_tokens.weight"]  # every layer's KV (and the output) change
    emb += torch.randn(emb.shape, generator=torch.Generator().manual_seed(1), dtype=emb.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _rec(result: dict, i: int) -> dict:
    return result["results"][i]["kv_transfer_params"]["sparkcache"]


def _tokens(result: dict, i: int) -> list[int]:
    return result["results"][i]["tokens"]


def test_the_inputs_give_different_outputs(runs):
    ref = runs["reference"]
    assert len({tuple(_tokens(ref, i)) for i in range(3)}) == 3  # adapters matter (the test can fail)
    cold = runs["cold"]
    assert [_rec(cold, i)["external_tokens"] for i in range(2)] == [0, 0]
    assert _tokens(cold, 0) == _tokens(ref, 0) and _tokens(cold, 1) == _tokens(ref, 1)


def test_another_cache_salt_gets_nothing_and_the_same_salt_is_restored(runs):
    ref, res = runs["reference"], runs["second"]
    other, same = _rec(res, 0), _rec(res, 1)
    assert other["external_tokens"] == 0 and other["recomputed_tokens"] == len(PROMPT)
    assert same["external_tokens"] == REUSABLE and same["complete"]
    assert _tokens(res, 0) == _tokens(res, 1) == _tokens(ref, 0)


def test_another_adapter_gets_nothing_and_the_same_adapter_is_restored(runs):
    ref, res = runs["reference"], runs["second"]
    other, same = _rec(res, 2), _rec(res, 3)
    assert other["external_tokens"] == 0 and _tokens(res, 2) == _tokens(ref, 2)
    assert same["external_tokens"] == REUSABLE and _tokens(res, 3) == _tokens(ref, 1)


def test_weights_rewritten_in_place_restore_nothing(runs):
    res = runs["new_weights"]
    assert [_rec(res, i)["external_tokens"] for i in range(2)] == [0, 0]
    assert _tokens(res, 0) == _tokens(res, 1) != _tokens(runs["reference"], 0)
