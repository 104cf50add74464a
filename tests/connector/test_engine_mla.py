"""MLA (DeepSeek-V3's latent KV cache) stored and restored on the real CPU engine, at TP=1 and TP=2.

The model is ``testing.tinymodel.make_tiny_field_model("deepseek-v3")``: the field recipe
(2 dense layers, 4 heads, kv_lora 512 + rope 64: one ``MLAAttentionSpec`` of 1 head x 576,
fp32) with real random weights from transformers' own initialisation, so greedy output depends
on the KV cache (vLLM's dummy weights barely let it). Backend CPU_MLA; without AMX the CPU
platform forces block 16 and turns prefix caching off, so nothing is restored but what a
connector places. Four 1,000-token prompts: A and B stored, C and D never computed by a
writing engine.

Logprobs: a restored request's first token comes from vLLM's MLA prefill over a cached
context (``_compute_prefill_context``: the latents gathered from the KV cache, up-projected,
merged by log-sum-exp with the new tokens' attention), a computed one's from a prefill of the
whole prompt; on CPU_MLA in fp32 the two differ far beyond rounding (the greedy tokens here
agree). No connector-less run takes the first path on this platform: without AMX the CPU
platform turns chunked prefill and prefix caching off for MLA (``CpuPlatform.check_and_update_config``),
so vLLM itself never prefills over a cached context (a run capped at 992 batched tokens still
prefills the 1,000-token prompt whole: its logprobs equal the unchunked run's, gap 0.0). vLLM's own ExampleConnector, which copies the KV cache token by token through its
slot mapping, gives the same logprobs after its restore. So a restore's logprobs are compared
with the ExampleConnector's restore of the same prompt to the same depth (within 1e-5), its
tokens with the connector-less reference, and its gap to the reference is printed.

TP=1, on one store root (each round of a life after the first starts on an emptied GPU
prefix cache; contracts/engine_driver.py, ``"phases"``):

1. connector absent: the reference tokens and logprobs of A, B, C and D;
2. ExampleConnector, one life: A and B computed and saved, then restored;
3. read-write, cold: A and B computed and published;
4. two forged entries published with the store's own writer API under the engine's identity
   (what any writer of the root can do; the store checks bytes against their names, not what
   they mean): C's block keys over B's pages, D's over zeroed pages of the right sizes;
5. after a restart, A and B restored to the stored reusable prefix (whole blocks, never the
   last prompt token): the reference's tokens, the ExampleConnector restore's logprobs;
6. one byte of one of A's stored objects flipped while the engine runs: refused, nothing
   placed, recomputed with the reference's tokens and logprobs;
7. C and D restored from the forged entries, to the same depth: their tokens differ from
   the reference. So a wrong KV cache changes the output, and 5's equality means something.

TP=2 (vLLM's own processes, one worker per rank): reference, ExampleConnector, cold (it also
uploads both ranks' shards to the shared tier: the tests' SeaweedFS), restored, and a flipped
byte in an object of rank 1's shard (rank 0's shard names the same object) refused and
recomputed. A life on an empty root restores A and B from the bucket, where the unit's objects
are stored once (the shared tier keeps a unit's objects under rank 0's identity: both ranks'
shards name the same ones), one prompt a phase.

Bytes on disk per entry (the object files under the store root, per prompt, and the
manifests) at TP=1 and TP=2 are printed (``pytest -s``) and compared: each rank publishes its
own shard under its own identity (its own manifest), and each shard holds the whole latent
(MLA's cache is replicated, not split by heads); objects are named by their BLAKE3 digest and
rank 1's pages are rank 0's bytes, so TP=2 stores TP=1's object bytes plus a manifest per rank.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import obstore
import pytest

from sparkcache.store import PageStore

from .conftest import flip_byte, forge_entry, long_prompt, metric, run_engine, stored_entry
from .test_engine_remote import bucket_check, remote_extra
from .test_engine_tp import _tp_env
from .test_engine_tp import run_engine as run_engine_tp

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 16  # the CPU platform's block size for MLA without AMX (set here so it holds with AMX too)
LENGTH = 1000
MAX_TOKENS = 16
A, B, C, D = (long_prompt(LENGTH, seed=s) for s in (61, 62, 63, 64))
REUSABLE = (LENGTH - 1) // BLOCK * BLOCK  # whole blocks, never the last prompt token: 992
LAYERS = 2  # the MLA layers, each one block of 16 x 576 fp32 per page block
LOGPROB_TOL = 1e-5
ENGINE = {"max_tokens": MAX_TOKENS, "block_size": BLOCK, "attention_backend": "CPU_MLA", "logprobs": True}


@pytest.fixture(scope="session")
def deepseek_model() -> str:
    from testing.tinymodel import make_tiny_field_model

    return make_tiny_field_model("deepseek-v3")


def _entry(store: PageStore, prompt: list[int], tp_rank: int = 0):
    """The entry ``tp_rank`` published for ``prompt`` (it covers the reusable prefix)."""
    return stored_entry(store, prompt, BLOCK, REUSABLE // BLOCK, tp_rank)


def _forge(root: Path, victim: list[int], donor: list[int] | None) -> None:
    """``victim``'s reusable blocks over ``donor``'s pages, or over zeroed pages (A's sizes)."""
    forge_entry(root, victim, A if donor is None else donor, BLOCK, REUSABLE // BLOCK, LAYERS,
                zeroed=donor is None)


def file_bytes(root: Path, kind: str) -> int:
    """Bytes of every file under the store root's ``kind`` directory (objects, manifests)."""
    return sum(p.stat().st_size for p in (root / "default" / kind).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def tp1(deepseek_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-store")
    base = {"model": deepseek_model, **ENGINE}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    out = {"reference": run_engine({**base, "connector": "none", "prompts": [A, B, C, D]})}
    example = {**base, "connector": "example", "example_path": str(tmp_path_factory.mktemp("example"))}
    out["example"] = run_engine({**example, "phases": [{"prompts": [A, B]}] * 2})["phases"][1]
    out["cold"] = run_engine({**rw, "prompts": [A, B]})
    out["bytes"], out["manifest_bytes"] = file_bytes(root, "objects"), file_bytes(root, "manifests")
    out["entries"] = len(PageStore(str(root), read_only=True).entries())
    _forge(root, C, B)
    _forge(root, D, None)

    def between(phase: int, _done: list[dict]) -> None:
        if phase == 1:  # one byte of one of A's stored objects
            store = PageStore(str(root), read_only=True)
            pages = _entry(store, A).manifest.pages
            flip_byte(store.objects.path(pages[len(pages) // 2].digest))

    later = run_engine({**rw, "phases": [{"prompts": [A, B]}, {"prompts": [A]}, {"prompts": [C, D]}]},
                       between=between)
    out["restored"], out["corrupt"], out["forged"] = later["phases"]
    out["corrupt"]["log"] = later["log"]
    return out


@pytest.fixture(scope="module")
def tp2(deepseek_model, tmp_path_factory, seaweedfs):
    root = tmp_path_factory.mktemp("mla-store-tp2")
    env = _tp_env()
    base = {"model": deepseek_model, **ENGINE, "tensor_parallel_size": 2}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64},
          "check_units": {"root": str(root), "ranks": 2}}  # publications settled before the next
    prefix = f"mla/{uuid.uuid4().hex[:8]}"
    remote_env = {**env, **seaweedfs.endpoint.aws_env()}
    out = {"reference": run_engine_tp({**base, "connector": "none", "prompts": [A, B]}, timeout=600, env=env)}
    example = {**base, "connector": "example", "example_path": str(tmp_path_factory.mktemp("example-tp2"))}
    out["example"] = run_engine_tp({**example, "phases": [{"prompts": [A, B]}] * 2}, timeout=600,
                                   env=env)["phases"][1]
    out["cold"] = run_engine_tp({**rw, "prompts": [A, B], "extra": remote_extra(seaweedfs, root, prefix)},
                                timeout=600, env=remote_env)
    out["bucket_check"] = bucket_check(seaweedfs, prefix)
    raw = seaweedfs.raw_store()
    out["bucket_object_bytes"] = sum(m["size"] for chunk in obstore.list(raw, prefix) for m in chunk
                                     if "/objects/" in m["path"])
    fresh = tmp_path_factory.mktemp("mla-store-tp2-from-bucket")
    # one prompt a phase, as the other engine tests that restore from the bucket serve theirs
    # (their fetches ride out the tests' SeaweedFS's stalls: test_engine_remote.FETCH_DEADLINE_S)
    out["from_bucket"] = run_engine_tp({**rw, "phases": [{"prompts": [A]}, {"prompts": [B]}],
                                        "extra": remote_extra(seaweedfs, fresh, prefix),
                                        "check_units": {"root": str(fresh), "ranks": 2}},
                                       timeout=900, env=remote_env)
    store = PageStore(str(root), read_only=True)
    out["bytes"], out["manifest_bytes"] = file_bytes(root, "objects"), file_bytes(root, "manifests")
    out["shards"] = sorted((e.manifest.identity.tp_rank, len(e.manifest.block_keys)) for e in store.entries())
    a0, a1 = _entry(store, A, 0).manifest, _entry(store, A, 1).manifest
    out["same_pages"] = [p.digest for p in a0.pages] == [p.digest for p in a1.pages]

    def between(phase: int, _done: list[dict]) -> None:
        if phase == 1:  # one byte of one object of rank 1's shard of A (rank 0's too, when shared)
            st = PageStore(str(root), read_only=True)
            pages = _entry(st, A, 1).manifest.pages
            flip_byte(st.objects.path(pages[len(pages) // 2].digest))

    later = run_engine_tp({**rw, "phases": [{"prompts": [A, B]}, {"prompts": [A]}]}, timeout=900, env=env,
                          between=between)
    out["restored"], out["corrupt"] = later["phases"]
    out["corrupt"]["log"] = later["log"]
    return out


def _records(result: dict) -> list[dict]:
    return [r["kv_transfer_params"]["sparkcache"] for r in result["results"]]


def _tokens(result: dict) -> list[list[int]]:
    return [r["tokens"] for r in result["results"]]


def _logprob_gap(result: dict, reference: list[dict]) -> float:
    return max(abs(x - y) for r, ref in zip(result["results"], reference)
               for x, y in zip(r["logprobs"], ref["logprobs"], strict=True))


def _assert_restored(result: dict, reference: list[dict], example: dict, what: str) -> None:
    """Every request restored to the stored reusable prefix: the reference's tokens, and the
    logprobs of vLLM's ExampleConnector after its restore to that depth (module doc)."""
    n = len(result["results"])
    assert [r["num_cached_tokens"] for r in example["results"]] == [REUSABLE] * n  # it did restore
    assert _tokens(result) == [r["tokens"] for r in reference] == _tokens(example)
    assert _logprob_gap(result, example["results"]) <= LOGPROB_TOL
    print(f"\n{what}: restored logprobs vs the connector-less reference: max gap "
          f"{_logprob_gap(result, reference):.3g} (the ExampleConnector's restore: "
          f"{_logprob_gap(example, reference):.3g}); vs the ExampleConnector's restore: "
          f"{_logprob_gap(result, example['results']):.3g}")
    records = _records(result)
    assert [(r["external_tokens"], r["complete"], r["failed_restores"]) for r in records] == [(REUSABLE, True, 0)] * n
    assert all(r["local_hit_tokens"] + r["external_tokens"] + r["recomputed_tokens"] == LENGTH for r in records)
    assert [r["num_cached_tokens"] for r in result["results"]] == [REUSABLE] * n
    assert metric(result, "vllm:external_prefix_cache_hits") == n * REUSABLE
    assert metric(result, "vllm:sparkcache_restored_tokens") == n * REUSABLE  # once per request, not per rank


def _assert_refused_and_recomputed(result: dict, reference: dict) -> None:
    assert _tokens(result) == [reference["tokens"]]
    assert _logprob_gap(result, [reference]) <= LOGPROB_TOL
    (rec,) = _records(result)
    assert (rec["external_tokens"], rec["failed_restores"], rec["recomputed_tokens"]) == (0, 1, LENGTH)
    assert metric(result, "vllm:sparkcache_load_failures") == 1
    assert metric(result, "vllm:sparkcache_restored_tokens") == 0
    assert "refused, its blocks recomputed" in result["log"] and "corrupt" in result["log"]


def test_tp1_cold_run_publishes_and_matches_the_reference(tp1):
    ref = tp1["reference"]["results"]
    assert _tokens(tp1["cold"]) == [ref[0]["tokens"], ref[1]["tokens"]]
    assert [r["external_tokens"] for r in _records(tp1["cold"])] == [0, 0]
    assert tp1["entries"] == 2


def test_tp1_restart_restores_the_stored_prefix_with_identical_output(tp1):
    _assert_restored(tp1["restored"], tp1["reference"]["results"][:2], tp1["example"], "TP=1")


def test_tp1_flipped_byte_is_refused_and_recomputed_with_identical_output(tp1):
    _assert_refused_and_recomputed(tp1["corrupt"], tp1["reference"]["results"][0])


def test_tp1_a_wrong_kv_cache_changes_the_output(tp1):
    """C restored from B's pages, D from zeroed pages, each to the full reusable depth:
    placed as a good restore is (the store cannot tell), and the tokens differ."""
    forged, ref = tp1["forged"], tp1["reference"]["results"]
    assert [(r["external_tokens"], r["failed_restores"]) for r in _records(forged)] == [(REUSABLE, 0)] * 2
    got = _tokens(forged)
    assert got[0] != ref[2]["tokens"], "C with B's KV cache gave C's tokens"
    assert got[1] != ref[3]["tokens"], "D with a zeroed KV cache gave D's tokens"


def test_tp2_restart_restores_both_ranks_with_identical_output(tp2):
    ref = tp2["reference"]["results"]
    assert _tokens(tp2["cold"]) == [r["tokens"] for r in ref]
    assert [r["external_tokens"] for r in _records(tp2["cold"])] == [0, 0]
    entry_blocks = (LENGTH + MAX_TOKENS - 1) // BLOCK  # a finished request's computed tokens
    assert tp2["shards"] == [(0, entry_blocks)] * 2 + [(1, entry_blocks)] * 2
    _assert_restored(tp2["restored"], ref, tp2["example"], "TP=2")


def test_tp2_the_bucket_holds_the_units_objects_once_and_an_empty_root_restores_from_it(tp2):
    """Both ranks uploaded their shards; the bucket's objects are the local root's (where the
    ranks' identical pages are one file each), not twice them; a life on an empty root restores
    A and B from the bucket with the reference's tokens, every restored token from the tier."""
    report = tp2["bucket_check"]
    assert report.clean and report.entries == 4, report  # two prompts x two ranks' shards
    assert tp2["same_pages"]
    assert tp2["bucket_object_bytes"] == tp2["bytes"], (tp2["bucket_object_bytes"], tp2["bytes"])
    print(f"\nMLA TP=2 in the bucket: {tp2['bucket_object_bytes']} object bytes for two prompts "
          f"(the local root's: {tp2['bytes']})")
    life = tp2["from_bucket"]
    for i, (result, name) in enumerate(zip(life["phases"], "AB")):
        assert [r["remote_tokens"] for r in _records(result)] == [REUSABLE], \
            (name, _records(result), {k: v for k, v in result["metrics"].items() if "remote" in k and v},
             [x for x in life["log"].splitlines() if "sparkcache" in x and "INFO" not in x])
        _assert_restored(result, tp2["reference"]["results"][i:i + 1], {"results": tp2["example"]["results"][i:i + 1]},
                         f"TP=2 from the bucket, {name}")
        assert metric(result, "vllm:sparkcache_remote_fetch_hits") == 2  # each rank's shard


def test_tp2_flipped_byte_in_rank_1s_shard_is_refused_and_recomputed(tp2):
    _assert_refused_and_recomputed(tp2["corrupt"], tp2["reference"]["results"][0])


def test_bytes_on_disk_per_entry_at_tp1_and_tp2(tp1, tp2):
    """Each rank publishes its own shard of an entry, under its own identity (its own
    manifest), and each shard holds the whole latent: MLA's cache is replicated, not split by
    heads. Objects are named by their BLAKE3 digest, and rank 1's pages are rank 0's bytes
    (the same hidden states after the all-reduce, the same replicated projection), so they are
    stored once: TP=2 costs TP=1's object bytes per entry, plus a manifest per rank."""
    entry_blocks = (LENGTH + MAX_TOKENS - 1) // BLOCK
    (tp1_objects, tp1_manifests), (tp2_objects, tp2_manifests) = (
        (t["bytes"] // 2, t["manifest_bytes"] // 2) for t in (tp1, tp2))  # two prompts stored
    print(f"\nMLA bytes on disk per entry ({entry_blocks} blocks of {BLOCK} tokens): objects TP=1 "
          f"{tp1_objects}, TP=2 {tp2_objects}; manifests TP=1 {tp1_manifests}, TP=2 {tp2_manifests} "
          f"(rank 1's pages the same objects as rank 0's: {tp2['same_pages']})")
    assert tp1_objects == entry_blocks * LAYERS * BLOCK * 576 * 4  # fp32 latent (512) + rope key (64)
    assert tp2["same_pages"]
    assert tp2_objects == tp1_objects
