"""The connector loads through vLLM's own factory, and the tiny-model round trip works in the image.

End to end, each engine life in its own process on one store root (the host's
tests/connector/test_engine_restore.py, shortened): read-write cold (computes and publishes),
then read-write after a restart (restores the stored prefix); the restored greedy output must
equal the computed one, and the stored entry's identity must name the image's transform lock. The model is made offline inside the container.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from contracts.engine_driver import run_in_fresh_process

HOME = Path(__file__).resolve().parents[1]  # /opt/sparkcache in the image
BLOCK = 32


def test_factory_loads_the_connector_class():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    config = KVTransferConfig(kv_connector="SparkcacheConnector", kv_connector_module_path="sparkcache.connector",
                              kv_role="kv_both")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls.__module__.startswith("sparkcache.connector") and cls.__name__ == "SparkcacheConnector"
    assert issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA)
    assert KVConnectorFactory.supports_hma_config(config)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from testing.tinymodel import TINY, make_tiny_model

    return make_tiny_model(TINY, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.mark.model_run
def test_publish_restart_restore_identical_output(tiny_model, tmp_path, lock):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 512) for _ in range(2100)]
    reusable = (len(prompt) - 1) // BLOCK * BLOCK
    base = {"model": tiny_model, "prompts": [prompt], "max_tokens": 16, "block_size": BLOCK}
    rw = {**base, "connector": "sparkcache", "extra": {"root": str(tmp_path / "store"), "min_span_tokens": 64}}

    cold = run_in_fresh_process(rw, cwd=HOME)["results"][0]
    restored = run_in_fresh_process(rw, cwd=HOME)
    got = restored["results"][0]
    record = got["kv_transfer_params"]["sparkcache"]

    assert cold["kv_transfer_params"]["sparkcache"]["recomputed_tokens"] == len(prompt)
    assert got["num_cached_tokens"] == reusable == record["external_tokens"], restored["log"][-3000:]
    assert record["complete"] and record["local_hit_tokens"] + record["external_tokens"] + record["recomputed_tokens"] == len(prompt)
    assert got["tokens"] == cold["tokens"]
    # the entry's identity names the vLLM this image runs: its transform lock, every file at its postimage
    from sparkcache.connector.identity import installed_runtime
    from sparkcache.store.manifests import decode

    manifests = [p for p in (tmp_path / "store" / "default" / "manifests").rglob("*") if p.is_file()]
    assert len(manifests) == 1, manifests
    assert decode(manifests[0].read_bytes()).identity.runtime_lock_hash == installed_runtime() == "sha256:" + lock.sha256
