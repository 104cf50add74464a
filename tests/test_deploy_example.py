"""``docs/deploy/compose.yaml``, the one-node multi-rank deployment example, says what the
docs say: the image by digest (never a tag), one cache volume per tensor-parallel rank under
the ``{rank}`` root, host IPC for vLLM's shared memory, the API on the host's loopback, and a
kv-transfer-config that the connector's settings accept. (No Compose here runs it: CI has no
GPU; the image contracts are ``build.py verify``'s.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from sparkcache.settings import load_settings

COMPOSE = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "compose.yaml"


def test_the_compose_example_gives_each_rank_its_volume_and_pins_the_image():
    spec = yaml.safe_load(COMPOSE.read_text())
    vllm = spec["services"]["vllm"]
    assert re.fullmatch(r"\$\{SPARKCACHE_IMAGE:\?.*repo@sha256.*\}", vllm["image"])
    args = dict(a.split("=", 1) for a in vllm["command"] if a.startswith("--") and "=" in a)
    ranks = int(args["--tensor-parallel-size"])
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["count"] == ranks
    env = vllm["environment"]
    settings = load_settings(env={f"{k}": str(v) for k, v in env.items() if k.startswith("SPARKCACHE_")})
    assert settings.per_rank_root
    mounts = {v.split(":")[1]: v.split(":")[0] for v in vllm["volumes"]}
    devices = set()
    for rank in range(ranks):  # a volume each, bound to its own host directory
        volume = spec["volumes"][mounts[settings.for_rank(rank).root]]
        assert volume["driver_opts"]["o"] == "bind"
        devices.add(volume["driver_opts"]["device"])
    assert len(devices) == ranks
    assert vllm["ipc"] == "host" and all(p.startswith("127.0.0.1:") for p in vllm["ports"])
    kvt = json.loads(args["--kv-transfer-config"].replace("\n", " "))
    assert kvt["kv_connector"] == "SparkcacheConnector" and kvt["kv_load_failure_policy"] == "recompute"
    load_settings(env={**{k: str(v) for k, v in env.items() if k.startswith("SPARKCACHE_")}},
                  extra_config=kvt["kv_connector_extra_config"])
