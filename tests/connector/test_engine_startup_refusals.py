"""A misconfigured connector stops vLLM's startup with a message that names the setting and
the fix, on the real CPU engine (each life a fresh process): never silently runs with a
default, turns a transform on, or fails requests it could recompute.

- ``SPARKCACHE_ACESS_MODE=restore-only`` (a typo of ``SPARKCACHE_ACCESS_MODE``): the store
  would otherwise run read-write and write;
- ``{"sparkcache_prefer_local_prefix": "false"}``: read with ``bool()`` the string ``"false"``
  would turn the transform on; the transformed scheduler and the connector parse the key with
  the same row of the settings table, which takes JSON booleans only;
- ``kv_load_failure_policy="fail"`` (vLLM 0.32.0's default) without
  ``SPARKCACHE_ALLOW_FAILING_LOADS``: every refused restore would fail its request;
- a root that is a regular file (it used to fail later with a bare ``FileExistsError``);
- another cap than the one a live writer of the root recorded (the smaller would win).
The control is the last test's second life: the same model, root and configuration, with the
opt-in, starts and serves (so the refusals come from the setting, not from a broken base).
"""

from __future__ import annotations

import pytest

from .conftest import REPO
from contracts.engine_driver import run_in_fresh_process

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32


@pytest.fixture(scope="module")
def base(tiny_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("store")
    return {"model": tiny_model, "prompts": [list(range(3, 100))], "max_tokens": 2, "block_size": BLOCK,
            "connector": "sparkcache", "extra": {"root": str(root)}, "enforce_eager": True,
            "in_process": True}


def _refused(cfg: dict, env: dict | None = None) -> str:
    with pytest.raises(RuntimeError) as err:
        run_in_fresh_process(cfg, REPO, timeout=300, env=env)
    return str(err.value)


def test_a_misspelled_environment_variable_stops_startup(base):
    # in vLLM's own processes: the refusal raised in the engine core reaches the operator
    out = _refused({**base, "in_process": False}, env={"SPARKCACHE_ACESS_MODE": "restore-only"})
    assert "SPARKCACHE_ACESS_MODE='restore-only' is not a sparkcache setting" in out
    assert "did you mean SPARKCACHE_ACCESS_MODE?" in out


def test_a_string_for_a_transform_boolean_stops_startup(base):
    cfg = {**base, "extra": {**base["extra"], "sparkcache_prefer_local_prefix": "false"}}
    out = _refused(cfg)
    assert "kv_connector_extra_config['sparkcache_prefer_local_prefix']='false'" in out
    assert "true/false" in out


def test_a_load_failure_policy_that_fails_requests_needs_an_explicit_yes(base):
    out = _refused({**base, "load_failure_policy": "fail"})
    assert "kv_load_failure_policy='fail'" in out and "SPARKCACHE_ALLOW_FAILING_LOADS=1" in out
    served = run_in_fresh_process({**base, "load_failure_policy": "fail"}, REPO, timeout=300,
                                  env={"SPARKCACHE_ALLOW_FAILING_LOADS": "1"})
    assert served["results"][0]["tokens"]


def test_a_root_that_is_a_file_stops_startup(base, tmp_path):
    root = tmp_path / "a-file"
    root.write_bytes(b"not a directory")
    out = _refused({**base, "extra": {"root": str(root)}})
    assert f"SPARKCACHE_ROOT={str(root)!r}" in out and "is a regular file" in out, out[-2000:]


def test_another_cap_than_a_live_writers_stops_startup(base, tmp_path):
    from sparkcache.store import PageStore

    root = tmp_path / "shared"
    writer = PageStore(str(root), max_bytes=2 << 30, low_watermark_bytes=1 << 30)  # alive meanwhile
    out = _refused({**base, "extra": {"root": str(root)}})  # the default cap, 40GiB
    assert "SPARKCACHE_MAX_BYTES=40GiB" in out and "SPARKCACHE_MAX_BYTES=2GiB" in out, out[-2000:]
    assert "cap.json" in out and "SPARKCACHE_NAMESPACE" in out
    writer.close()
