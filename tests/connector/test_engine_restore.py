"""End to end on the real CPU engine (vllm.LLM, prefix caching on), tiny offline model.

One module-scoped sequence on one store root, in five engine lives, each in its own process
(the engine is really shut down between them); steps 3-5 are rounds of one life, each on an
emptied GPU prefix cache, so it finds only what the connector restores
(contracts/engine_driver.py, ``"phases"``):

1. connector absent: the reference greedy output;
2. read-write, cold: the prompt (2,100 tokens) is computed and published;
3. read-write after a restart: restored; external tokens == the stored reusable prefix
   (from vLLM's own counters and from the attribution record); output identical;
4. one byte of one stored object flipped while the engine runs: the restore is refused
   (nothing placed), the request recomputes, the output is identical, the load-failure counter
   moved, and the corrupt object is removed (quarantine counter 1), so this request's capture
   writes it again;
5. then: restored again, with identical output;
6. restore-only, on a read-only bind mount of the root: restores with identical output, and
   the root's files, directories, bytes and mtimes are unchanged;
7. disabled, pointed at a root that does not exist: it still does not exist afterwards.

And at conversation scale, a 32K-token prompt (the tiny model with positions to 40,960):
computed and published; after a restart restored with identical output, then, in the same
life, one byte of a page in the middle of the entry flipped: refused, recomputed, identical
output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkcache.store import PageStore

from mounts import read_only_view

from .conftest import flip_byte, long_prompt, metric, run_engine, snapshot

pytestmark = [pytest.mark.engine, pytest.mark.root, pytest.mark.slow]

BLOCK = 32
PROMPT = long_prompt(2100)
REUSABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # whole blocks, never the last prompt token: 2080


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    base = {"model": tiny_model, "prompts": [PROMPT], "max_tokens": 16, "block_size": BLOCK}
    out = {"root": root}
    out["reference"] = run_engine({**base, "connector": "none"})
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(root), "min_span_tokens": 64}}
    out["cold"] = run_engine(rw)
    out["after_cold_snapshot"] = snapshot(root)

    flipped: dict[Path, bytes] = {}  # the object and its flipped bytes

    def between(phase: int, _done: list[dict]) -> None:
        if phase == 1:  # after the restore: one byte of one stored object flipped
            objects = sorted(p for p in (root / "default" / "objects").rglob("*") if p.is_file())
            victim = objects[len(objects) // 2]
            flipped[victim] = flip_byte(victim)
        else:
            ((victim, data),) = flipped.items()
            out["victim_after_corrupt"] = victim.exists() and victim.read_bytes() == data

    later = run_engine({**rw, "phases": [{"prompts": [PROMPT]}] * 3}, between=between)
    out["restored"], out["corrupt"], out["healed"] = later["phases"]
    out["corrupt"]["log"] = later["log"]
    before = snapshot(root)
    with read_only_view(root, tmp_path_factory.mktemp("mnt") / "ro") as ro:
        out["restore_only"] = run_engine({**rw, "extra": {**rw["extra"], "root": str(ro),
                                                          "access_mode": "restore-only"}})
    after = snapshot(root)
    out["restore_only_unchanged"] = before == after
    out["restore_only_diff"] = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    missing = root.parent / "never-created"
    out["disabled_root"] = missing
    out["disabled"] = run_engine({**rw, "extra": {"root": str(missing), "access_mode": "disabled"}})
    return out


def record(result: dict) -> dict:
    return result["results"][0]["kv_transfer_params"]["sparkcache"]


def test_cold_run_publishes_and_matches_reference(runs):
    cold = runs["cold"]
    assert cold["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]
    rec = record(cold)
    assert (rec["local_hit_tokens"], rec["external_tokens"], rec["recomputed_tokens"]) == (0, 0, len(PROMPT))
    manifests = [k for k in runs["after_cold_snapshot"] if k.startswith("default/manifests/") and k.count("/") == 3]
    assert len(manifests) == 1, manifests


def test_restart_restores_the_stored_prefix_with_identical_output(runs):
    res = runs["restored"]
    assert res["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]
    assert metric(res, "vllm:external_prefix_cache_hits") == REUSABLE
    assert res["results"][0]["num_cached_tokens"] == REUSABLE
    rec = record(res)
    assert rec["complete"] and rec["external_tokens"] == REUSABLE
    assert rec["local_hit_tokens"] + rec["external_tokens"] + rec["recomputed_tokens"] == len(PROMPT)
    assert metric(res, "vllm:sparkcache_restored_tokens") == REUSABLE
    assert metric(res, "vllm:sparkcache_attributed_tokens", source="external") == REUSABLE


def test_restore_only_on_a_read_only_mount_restores_and_writes_nothing(runs):
    res = runs["restore_only"]
    assert runs["restore_only_unchanged"], runs["restore_only_diff"]
    assert record(res)["external_tokens"] == REUSABLE
    assert res["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]


def test_flipped_byte_is_refused_and_recomputed(runs):
    res = runs["corrupt"]
    assert res["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]
    rec = record(res)
    assert rec["external_tokens"] == 0 and rec["failed_restores"] == 1
    assert rec["recomputed_tokens"] == len(PROMPT) and rec["complete"]
    assert metric(res, "vllm:sparkcache_load_failures") == 1
    assert metric(res, "vllm:sparkcache_restored_tokens") == 0
    assert "refused, its blocks recomputed" in res["log"] and "corrupt" in res["log"]
    assert metric(res, "vllm:sparkcache_quarantined_objects") == 1
    assert not runs["victim_after_corrupt"]  # removed, then written anew by the capture


def test_after_the_corrupt_object_is_removed_the_next_capture_heals_the_entry(runs):
    res = runs["healed"]
    assert res["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]
    rec = record(res)
    assert rec["external_tokens"] == REUSABLE and rec["failed_restores"] == 0
    assert metric(res, "vllm:sparkcache_quarantined_objects") == 0


def test_disabled_does_no_file_io_under_the_root(runs):
    res = runs["disabled"]
    assert not Path(runs["disabled_root"]).exists()
    assert res["results"][0]["tokens"] == runs["reference"]["results"][0]["tokens"]
    rec = record(res)
    assert rec["recomputed_tokens"] == len(PROMPT) and rec["external_tokens"] == 0


LONG_PROMPT = long_prompt(32768, seed=7)


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    from testing.tinymodel import TINY, make_tiny_model

    model = make_tiny_model(dataclasses.replace(TINY, max_position_embeddings=40960))
    root = tmp_path_factory.mktemp("long-store")
    rw = {"model": model, "prompts": [LONG_PROMPT], "max_tokens": 16, "block_size": BLOCK,
          "max_model_len": 40960, "max_num_batched_tokens": 40960, "connector": "sparkcache",
          "extra": {"root": str(root), "min_span_tokens": 64}}
    out = {"cold": run_engine(rw, timeout=900)}

    def between(_phase: int, _done: list[dict]) -> None:
        """After the restore: one byte of a page in the middle of the entry flipped."""
        store = PageStore(str(root), read_only=True)
        (entry,) = store.catalog.entries()
        pages = entry.manifest.pages
        flip_byte(store.objects.path(pages[len(pages) // 2].digest), 3)
        out["pages"] = len(pages)

    later = run_engine({**rw, "phases": [{"prompts": [LONG_PROMPT]}] * 2}, timeout=900, between=between)
    out["restored"], out["corrupt"] = later["phases"]
    out["corrupt"]["log"] = later["log"]
    return out


def test_a_flipped_byte_in_a_32k_token_entry_is_refused_and_recomputed(long_runs):
    reference = long_runs["cold"]["results"][0]["tokens"]
    assert record(long_runs["cold"])["external_tokens"] == 0
    # the restore of the intact entry: every reusable token, identical output
    long_reusable = (len(LONG_PROMPT) - 1) // BLOCK * BLOCK
    assert record(long_runs["restored"])["external_tokens"] == long_reusable
    assert long_runs["restored"]["results"][0]["tokens"] == reference
    assert long_runs["pages"] == -(-len(LONG_PROMPT) // (16 * BLOCK))  # 64 pages of 16 blocks
    corrupt = long_runs["corrupt"]
    rec = record(corrupt)
    assert (rec["external_tokens"], rec["failed_restores"], rec["recomputed_tokens"]) == (0, 1, len(LONG_PROMPT))
    assert corrupt["results"][0]["tokens"] == reference
    assert "refused, its blocks recomputed" in corrupt["log"] and "corrupt" in corrupt["log"]
    assert metric(corrupt, "vllm:sparkcache_quarantined_objects") == 1
