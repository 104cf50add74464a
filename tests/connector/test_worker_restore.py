"""The worker's restore reads the pages the scheduler's lookup found (``LoadPlan.stored``),
verifies every one before placing a byte, and looks the entry up itself only when the plan
came from another identity (another tensor-parallel rank's store entry).

Real parts: vLLM 0.32.0's KV cache config types, torch KV tensors laid out as vLLM hands
them to the connector (blocks at dim 0), sparkcache's worker half and its store on disk.
The plans are the ones the scheduler half builds (``StoredPages.of`` of its lookup).
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from sparkcache.connector.keys import BlockKeys
from sparkcache.connector.capture_plans import CapturePlan
from sparkcache.connector.scheduler_side import LoadPlan, StoredPages

from .conftest import flip_byte
from .test_worker_maintenance import BLOCK, NUM_BLOCKS, _worker

STORED_BLOCKS = 20  # 2 pages of 16 blocks (page_blocks default), the second one partial


@pytest.fixture
def published(tmp_path):
    """A read-write worker that captured one 20-block prompt; its KV and keys. Closed after."""
    worker = _worker(tmp_path / "store", "read-write")
    yield worker, *_captured(worker, STORED_BLOCKS)
    worker.close()


def _captured(worker, blocks: int) -> tuple[list[str], dict]:
    """Capture blocks [0, blocks) of the worker's cache as a prompt and wait until it is
    published; its keys and a copy of its KV."""
    keys = BlockKeys(BLOCK).upto(list(range(1, blocks * BLOCK + 2)), blocks)
    worker.capture(CapturePlan("store", keys, 0, [list(range(blocks))]))
    deadline = time.monotonic() + 120
    while worker.slots.stats.published < 1:
        assert worker.slots.stats.publish_failed == 0 and time.monotonic() < deadline
        time.sleep(0.02)
    return keys, {name: kv[:blocks].clone() for name, kv in worker.kv.items()}


def _plan(worker, keys, start: int, dest: list[int]) -> LoadPlan:
    found = worker.store.lookup(worker.identity, keys)
    assert found.hit and found.hit_blocks == len(keys), found
    return LoadPlan("r", keys, start, [dest], stored=StoredPages.of(found.handle, start, len(keys)))


def _cleared_destination(worker, start: int) -> list[int]:
    """Zeroed blocks at the end of the cache for blocks [start, STORED_BLOCKS) of the prompt."""
    dest = list(range(NUM_BLOCKS - (STORED_BLOCKS - start), NUM_BLOCKS))
    for kv in worker.kv.values():
        kv[dest] = 0
    return dest


def _placed(worker, dest: list[int], start: int, stored: dict) -> bool:
    return all(torch.equal(worker.kv[n][dest], stored[n][start:]) for n in worker.kv)


def test_load_places_the_pages_the_scheduler_found(published):
    worker, keys, stored = published
    assert worker.bpp < STORED_BLOCKS < 2 * worker.bpp
    start = 3  # the first blocks are local hits: only the rest is placed
    dest = _cleared_destination(worker, start)
    entry_id = worker.store.lookup(worker.identity, keys).entry_id
    plan = _plan(worker, keys, start, dest)
    assert plan.stored.first_page == 0 and len(plan.stored.pages) == 2
    # the worker does not read the manifest again (superseded meanwhile: the pages stay)
    os.unlink(worker.store.layout.manifest_path(worker.identity.digest(), entry_id))
    worker.load(plan)
    assert worker.take_results()[1:] == ({"r"}, set())
    assert _placed(worker, dest, start, stored)


def test_plan_of_another_identity_is_looked_up_again(published):
    worker, keys, stored = published
    dest = _cleared_destination(worker, 0)
    plan = _plan(worker, keys, 0, dest)
    # another rank's pages: a digest that is not this worker's; its pages must not be read
    foreign = dataclasses.replace(plan.stored, identity_digest="0" * 32,
                                  pages=tuple(dataclasses.replace(p, digest="f" * 64) for p in plan.stored.pages))
    worker.load(dataclasses.replace(plan, stored=foreign))
    assert worker.take_results()[1:] == ({"r"}, set())
    assert _placed(worker, dest, 0, stored)


def test_object_gone_after_the_lookup_fails_the_load_and_places_nothing(published):
    worker, keys, stored = published
    dest = _cleared_destination(worker, 0)
    plan = _plan(worker, keys, 0, dest)
    os.unlink(worker.store.objects.path(plan.stored.pages[1].digest))  # evicted meanwhile
    worker.load(plan)
    assert worker.take_results()[1:] == ({"r"}, {"r"})
    assert all(not worker.kv[n][dest].any() for n in worker.kv)  # not even the first page
    assert not worker.counters.get("restored_page_bytes")  # the refusal is counted by the scheduler


def test_entry_published_in_another_page_size_is_placed_by_its_own(tmp_path, published):
    writer, keys, stored = published  # pages of 16 blocks
    writer.close()
    worker = _worker(tmp_path / "store", "restore-only", page_blocks=4)  # set differently now
    try:
        assert worker.bpp == 4
        start = 5
        dest = _cleared_destination(worker, start)
        plan = _plan(worker, keys, start, dest)
        assert plan.stored.blocks_per_page == 16
        worker.load(plan)
        assert worker.take_results()[1:] == ({"r"}, set())
        assert _placed(worker, dest, start, stored)
    finally:
        worker.close()


LONG_BLOCKS = 32768 // BLOCK  # a 32K-token prompt: 64 pages of 16 blocks, 32 MiB


def test_a_flipped_byte_in_a_32k_token_restore_is_refused_and_every_block_recomputed(tmp_path):
    """At conversation scale (64 pages): a flipped byte in page 40 fails the restore, and
    every destination block is reported to vLLM as not loaded, so it recomputes them all:
    pages are read straight into their blocks (the CPU backend's layout), so the pages before
    page 40 did reach them, verified or not, and no byte outside them changed. The corrupt
    object is removed (the next capture writes it anew)."""
    worker = _worker(tmp_path / "store", "read-write", num_blocks=2 * LONG_BLOCKS,
                     max_bytes="1GiB", low_watermark_bytes="512MiB", capture_slot_bytes="64MiB")
    try:
        keys, stored = _captured(worker, LONG_BLOCKS)
        dest = list(range(LONG_BLOCKS, 2 * LONG_BLOCKS))
        plan = _plan(worker, keys, 0, dest)
        plan = dataclasses.replace(plan, sync=True)
        # first the intact restore places every byte: the test can tell placed from not
        worker.load(plan)
        assert worker.take_sync_outcomes() == (["r"], [])
        assert _placed(worker, dest, 0, stored)
        for kv in worker.kv.values():
            kv[dest] = 0
        before = {n: kv.clone() for n, kv in worker.kv.items()}
        victim = plan.stored.pages[40]
        path = worker.store.objects.path(victim.digest)
        flip_byte(path, 3)
        worker.load(plan)
        assert worker.take_sync_outcomes() == ([], ["r"])
        assert worker.take_invalid_block_ids() == set(dest)  # vLLM recomputes them all
        outside = [b for b in range(2 * LONG_BLOCKS) if b not in set(dest)]
        assert all(worker.kv[n][outside].equal(before[n][outside]) for n in worker.kv)
        assert not os.path.exists(path)  # quarantined
    finally:
        worker.close()


# A restore's reads on a failing disk: the worker runs in a child process, so that a read that
# faults the process (SIGBUS under a mapping) shows as the child's death, not the suite's.
_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from faultfs import FaultFS
from tests.connector import test_worker_restore as t
fs = FaultFS.attach(sys.argv[2])
worker = t._worker(fs.mount / "store", "read-write")
keys, stored = t._captured(worker, t.STORED_BLOCKS)
dest = t._cleared_destination(worker, 0)
before = {n: kv.clone() for n, kv in worker.kv.items()}
outside = [b for b in range(worker.num_blocks) if b not in set(dest)]
plan = t._plan(worker, keys, 0, dest)
victim = "/store/default/objects/" + plan.stored.pages[1].digest[:2] + "/" + plan.stored.pages[1].digest[2:]
if sys.argv[3] == "eio":
    fs.fail("read", "^" + victim + "$", 5, times=-1)
else:
    fs.truncate_on("read", "^" + victim + "$", 4096)
worker.load(plan)
done, failed = worker.take_results()[1:]
print("RESULT " + json.dumps({"done": sorted(done), "failed": sorted(failed), "outside_untouched":
                              all(worker.kv[n][outside].equal(before[n][outside]) for n in worker.kv)}))
worker.close()
"""


@pytest.mark.root
@pytest.mark.parametrize("fault", ["eio", "truncate"])
def test_an_io_error_or_truncation_under_a_restore_refuses_it_and_the_process_lives(tmp_path, fault):
    import subprocess
    import sys

    from faultfs import FaultFS
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with FaultFS(tmp_path) as fs:
        child = subprocess.run([sys.executable, "-c", _CHILD, repo, str(tmp_path), fault],
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, "PYTHONPATH": repo})
        assert fs.fired() >= 1, "the fault never happened"
    assert child.returncode == 0, f"the restoring process died ({child.returncode}): {child.stderr[-2000:]}"
    import json
    result = json.loads(child.stdout.split("RESULT ", 1)[1])
    # refused: vLLM recomputes every destination block (pages read before the fault are in
    # them, unverified or not: they are never used); nothing outside them changed
    assert result == {"done": ["r"], "failed": ["r"], "outside_untouched": True}, result
