"""Image turns and prompt embeddings end to end on the real CPU engine (vllm.LLM, prefix
caching on), tiny offline models (``testing.tinyvlm``, ``testing.tinymodel``), each engine
life in its own process.

Qwen2-VL (attention, M-RoPE), a five-turn chat where turn 2 adds image A, with a restart
between turns 3 and 4 on the same root:

- every turn's output equals a connector-disabled run of the same chat;
- turn 4, the first request of the new life, is restored from the store past the image (the
  attribution record's external tokens, counted as multimodal): the M-RoPE positions of the
  tokens after the image are the ones vLLM computes for the whole prompt, so the output is equal;
- the same chat with image B in place of A, as the first request of another life on that
  root, gets the blocks before the image and nothing past them, and equals its own
  connector-disabled run;
- on a copy of the root whose entries were rewritten with zeroed pages (through the store's
  own writer, under the same keys), turn 4's output changes: the restore decides the output.

Qwen3.5 (GatedDeltaNet hybrid plus vision, bf16): a prompt with an image is published, then
restored with its recurrent state after a restart, with identical greedy tokens; another image
changes them, and a zeroed state does too.

Prompt embeddings (tiny Llama): restored after a restart with identical output; other
embeddings of the same length are not offered.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import metric, run_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32


def _env() -> dict:
    from testing.torchvision_shim import site_dir

    return {"PYTHONPATH": str(site_dir())}


def _zero_every_entry(root: Path) -> int:
    """Rewrite every entry of ``root`` with zeroed pages (and state), same identity and keys,
    through the store's writer: what any writer of the root can do. Returns the entries."""
    from sparkcache.store import PageStore

    store = PageStore(str(root))
    entries = store.entries()
    for e in entries:
        m = e.manifest
        pages = [bytes(len(p)) for p in store.read_pages(list(m.pages))]
        state = None if m.state is None else bytes(m.state.size)
        store.discard([e.entry_id])
        assert store.publish(m.identity, list(m.block_keys), pages, blocks_per_page=m.blocks_per_page,
                             state=state).ok
    store.close()
    return len(entries)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from testing.tinyvlm import make_tiny_vlm, user_turn, write_image

    model = make_tiny_vlm()
    images = tmp_path_factory.mktemp("images")
    a, b = write_image(images / "a.png", seed=1), write_image(images / "b.png", seed=2)
    turns = [{"ids": user_turn(model, "the cache store page block token prefix restore recompute model "
                                      "layer head value key query attention", first=True)},
             {"ids": user_turn(model, "what is in this image and why", images=1), "images": [a]},
             {"ids": user_turn(model, "tell me more about the durable verified store")},
             {"ids": user_turn(model, "and the scheduler request engine turn agent")},
             {"ids": user_turn(model, "publish lookup lease slot capture rank vector")}]
    root = tmp_path_factory.mktemp("store")
    base = {"model": model, "max_tokens": 8, "block_size": BLOCK, "chain": True}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": BLOCK}}
    out = {"model": model, "root": root}
    out["reference"] = run_engine({**base, "connector": "none", "prompts": turns}, env=_env())["results"]
    out["before"] = run_engine({**rw, "prompts": turns[:3]}, env=_env())
    turn4 = out["reference"][3]["prompt"]  # turns 1-3, their answers and turn 4's ids
    out["after"] = run_engine({**rw, "prompts": [{"ids": turn4, "images": [a]}, turns[4]]}, env=_env())
    turn2 = out["reference"][1]["prompt"]
    other = {"ids": turn2, "images": [b]}
    out["reference_b"] = run_engine({**base, "connector": "none", "prompts": [other]}, env=_env())["results"]
    out["b"] = run_engine({**rw, "prompts": [other]}, env=_env())
    zeroed = tmp_path_factory.mktemp("zeroed") / "root"
    shutil.copytree(root, zeroed)
    out["zeroed_entries"] = _zero_every_entry(zeroed)
    out["zeroed"] = run_engine({**rw, "extra": {**rw["extra"], "root": str(zeroed)},
                                "prompts": [{"ids": turn4, "images": [a]}]}, env=_env())
    return out


def _image_offset(model: str, ids: list[int]) -> int:
    from transformers import AutoTokenizer

    return ids.index(AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|image_pad|>"))


def test_the_image_changes_the_output(chat):
    """Without it, equal outputs below would mean nothing."""
    assert chat["reference_b"][0]["tokens"] != chat["reference"][1]["tokens"]


def test_every_turn_equals_the_connector_disabled_run(chat):
    got = [r["tokens"] for r in chat["before"]["results"] + chat["after"]["results"]]
    assert got == [r["tokens"] for r in chat["reference"]]


def test_after_the_restart_turn_4_is_restored_past_the_image(chat):
    first = chat["after"]["results"][0]
    record = first["kv_transfer_params"]["sparkcache"]
    offset = _image_offset(chat["model"], first["prompt"])
    turn3 = chat["before"]["results"][2]["prompt_tokens"]  # turn 3's prompt, the image expanded
    assert record["input"] == "multimodal"
    assert record["external_tokens"] >= turn3 // BLOCK * BLOCK > offset + 4, (record, offset, turn3)
    assert record["external_tokens"] == first["num_cached_tokens"]
    assert metric(chat["after"], "vllm:sparkcache_attributed_external_tokens",
                  input="multimodal") >= record["external_tokens"]


def test_image_b_gets_only_the_blocks_before_the_image(chat):
    first = chat["b"]["results"][0]
    record = first["kv_transfer_params"]["sparkcache"]
    offset = _image_offset(chat["model"], first["prompt"])
    assert offset >= BLOCK  # there are blocks before the image to restore
    assert record["external_tokens"] == offset // BLOCK * BLOCK, (record, offset)
    assert first["tokens"] == chat["reference_b"][0]["tokens"]


def test_a_zeroed_stored_page_changes_the_output(chat):
    record = chat["zeroed"]["results"][0]["kv_transfer_params"]["sparkcache"]
    assert chat["zeroed_entries"] > 0
    assert record["external_tokens"] > 0  # the zeroed pages were restored ...
    assert chat["zeroed"]["results"][0]["tokens"] != chat["reference"][3]["tokens"]  # ... and decided it


# ------------------------------------------------------------------ Qwen3.5: hybrid plus vision


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from testing.tinyvlm import TINY_QWEN3_5, make_tiny_vlm, user_turn, write_image

    model = make_tiny_vlm(TINY_QWEN3_5)
    images = tmp_path_factory.mktemp("images")
    a, b = write_image(images / "a.png", seed=1), write_image(images / "b.png", seed=2)
    text = " ".join(["the cache store page block token prefix restore recompute model layer"] * 150)
    ids = user_turn(model, "what is in this image? " + text, images=1, first=True)
    root = tmp_path_factory.mktemp("store")
    base = {"model": model, "max_tokens": 8, "block_size": BLOCK, "dtype": "bfloat16",
            "mamba_cache_mode": "align", "max_model_len": 8192}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": BLOCK}}
    out = {"model": model, "ids": ids}
    out["reference"] = run_engine({**base, "connector": "none",
                                   "prompts": [{"ids": ids, "images": [a]}, {"ids": ids, "images": [b]}]},
                                  env=_env())["results"]
    out["cold"] = run_engine({**rw, "prompts": [{"ids": ids, "images": [a]}]}, env=_env())
    out["restored"] = run_engine({**rw, "prompts": [{"ids": ids, "images": [a]}]}, env=_env())
    zeroed = tmp_path_factory.mktemp("zeroed") / "root"
    shutil.copytree(root, zeroed)
    out["zeroed_entries"] = _zero_every_entry(zeroed)
    out["zeroed"] = run_engine({**rw, "extra": {**rw["extra"], "root": str(zeroed)},
                                "prompts": [{"ids": ids, "images": [a]}]}, env=_env())
    return out


def test_qwen3_5_output_depends_on_the_image(hybrid):
    assert hybrid["reference"][0]["tokens"] != hybrid["reference"][1]["tokens"]


def test_qwen3_5_is_restored_with_its_state_and_identical_tokens(hybrid):
    first = hybrid["restored"]["results"][0]
    record = first["kv_transfer_params"]["sparkcache"]
    assert record["input"] == "multimodal" and record["external_tokens"] > _image_offset(hybrid["model"], hybrid["ids"])
    assert metric(hybrid["restored"], "vllm:sparkcache_state_restores", outcome="ok") == 1
    assert first["tokens"] == hybrid["reference"][0]["tokens"]
    assert hybrid["cold"]["results"][0]["tokens"] == hybrid["reference"][0]["tokens"]


def test_qwen3_5_zeroed_pages_and_state_change_the_output(hybrid):
    record = hybrid["zeroed"]["results"][0]["kv_transfer_params"]["sparkcache"]
    assert hybrid["zeroed_entries"] > 0 and record["external_tokens"] > 0
    assert hybrid["zeroed"]["results"][0]["tokens"] != hybrid["reference"][0]["tokens"]


# ------------------------------------------------------------------ prompt embeddings


@pytest.fixture(scope="module")
def embeds(tiny_model, tmp_path_factory):
    import torch

    folder = tmp_path_factory.mktemp("embeds")
    g = torch.Generator().manual_seed(0)
    e = torch.randn(300, 128, generator=g)
    other = e.clone()
    other[-1] += 1.0  # the same length, the same first 299 rows
    fresh = torch.randn(300, 128, generator=g)
    paths = {}
    for name, tensor in (("e", e), ("other", other), ("fresh", fresh)):
        paths[name] = str(folder / f"{name}.pt")
        torch.save(tensor, paths[name])
    root = tmp_path_factory.mktemp("store")
    base = {"model": tiny_model, "max_tokens": 8, "block_size": BLOCK, "prompt_embeds": True}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": BLOCK}}
    prompts = [{"ids": [], "embeds": paths[n]} for n in ("e", "fresh")]
    out = {"reference": run_engine({**base, "connector": "none", "prompts": prompts})["results"]}
    out["cold"] = run_engine({**rw, "prompts": prompts[:1]})
    out["after"] = run_engine({**rw, "prompts": [{"ids": [], "embeds": paths["e"]}, prompts[1]]})
    return out


def test_prompt_embeddings_are_restored_with_identical_output(embeds):
    restored, fresh = embeds["after"]["results"]
    record = restored["kv_transfer_params"]["sparkcache"]
    assert record["input"] == "prompt_embeds" and record["external_tokens"] == 299 // BLOCK * BLOCK
    assert restored["tokens"] == embeds["reference"][0]["tokens"]
    assert embeds["reference"][0]["tokens"] != embeds["reference"][1]["tokens"]  # embeddings decide it


def test_other_embeddings_of_the_same_length_are_not_offered(embeds):
    _, fresh = embeds["after"]["results"]
    assert fresh["kv_transfer_params"]["sparkcache"]["external_tokens"] == 0
    assert fresh["tokens"] == embeds["reference"][1]["tokens"]
