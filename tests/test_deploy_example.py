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
# what an operator would export before `docker compose up` (Compose substitutes ${VAR:-default})
OPERATOR = {"SPARKCACHE_REMOTE_BUCKET": "kv-shared", "SPARKCACHE_REMOTE_ENDPOINT": "http://objects.internal:8333"}


def _substituted(env: dict, given: dict) -> dict[str, str]:
    """The service's environment as Compose hands it over: ``${VAR:-default}`` is ``given``'s
    value of VAR, else the default."""
    def one(value: object) -> str:
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: given.get(m[1], m[2]), str(value))
    return {k: one(v) for k, v in env.items()}


def _sparkcache_settings(env: dict, given: dict, **kw):
    return load_settings(env={k: v for k, v in _substituted(env, given).items() if k.startswith("SPARKCACHE_")}, **kw)


def test_the_compose_example_gives_each_rank_its_volume_and_pins_the_image():
    spec = yaml.safe_load(COMPOSE.read_text())
    vllm = spec["services"]["vllm"]
    assert re.fullmatch(r"\$\{SPARKCACHE_IMAGE:\?.*repo@sha256.*\}", vllm["image"])
    args = dict(a.split("=", 1) for a in vllm["command"] if a.startswith("--") and "=" in a)
    ranks = int(args["--tensor-parallel-size"])
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["count"] == ranks
    env = vllm["environment"]
    settings = _sparkcache_settings(env, {})
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
    _sparkcache_settings(env, {}, extra_config=kvt["kv_connector_extra_config"])


def test_the_shared_tier_is_one_bucket_for_every_replica_and_its_sweeper_runs_in_one_place():
    """Every replica and the sweeper name the same bucket, endpoint, prefix and namespace; the
    sweeper runs only where its profile is started (one node per namespace, docs/REMOTE.md);
    credentials come from a secret file, never from the file itself; without a bucket nothing
    changes."""
    spec = yaml.safe_load(COMPOSE.read_text())
    vllm, sweeper = spec["services"]["vllm"], spec["services"]["remote-gc"]
    serving = _sparkcache_settings(vllm["environment"], OPERATOR)
    sweeping = _sparkcache_settings(sweeper["environment"], OPERATOR, require_root=False)  # as remote-gc reads them
    for s in (serving, sweeping):
        assert (s.remote_bucket, s.remote_endpoint) == tuple(OPERATOR.values())
    assert (serving.remote_prefix, serving.namespace) == (sweeping.remote_prefix, sweeping.namespace)
    assert sweeping.remote_max_bytes > 0 and serving.remote_fetch_deadline_seconds > 0
    assert sweeper["profiles"] == ["sweeper"] and "profiles" not in vllm
    command = " ".join(sweeper["command"])
    assert "python -m sparkcache remote-gc" in command and "--metrics-file" in command
    assert sweeper["image"] == vllm["image"]
    for service in (vllm, sweeper):
        env = _substituted(service["environment"], OPERATOR)
        assert service["secrets"] == ["aws_credentials"]
        assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/aws_credentials"
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env)
    assert "file" in spec["secrets"]["aws_credentials"]
    assert _sparkcache_settings(vllm["environment"], {}).remote_bucket == ""  # no bucket: no tier
