"""The KV cache layouts the field's models get from vLLM 0.32.0 (shared/docs/FIELD_LAYOUTS.md), as
``testing.field_layouts`` records them from vLLM's own start on CPU: each fact the doc states is
asserted here, so a vLLM that builds them otherwise fails a test rather than the connector.

Slow when nothing is cached (one vLLM start per model, in a subprocess); afterwards the layouts
are read from ``.cache/field_layouts``. The GLM-5.3 models need torchvision's wheel
(``make test-wheels``; ``testing/torchvision_shim.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from testing.field_layouts import FIELD_MODELS, FieldLayout, field_layout

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=None)
def layout(name: str) -> FieldLayout:
    return field_layout(name)


def kinds(cfg) -> list[str]:
    return [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups]


def inner(group) -> dict:
    """A worker group's per-layer specs (``UniformTypeKVCacheSpecs``), or its one spec for each layer."""
    spec = group.kv_cache_spec
    return dict(spec.kv_cache_specs) if hasattr(spec, "kv_cache_specs") else {n: spec for n in group.layer_names}


@pytest.mark.parametrize("name", list(FIELD_MODELS))
def test_scheduler_config_is_the_workers_with_each_groups_first_spec(name):
    """``generate_scheduler_kv_cache_config``: the worker's config with each ``UniformTypeKVCacheSpecs``
    replaced by its first layer's spec; the same block count, groups and layer names."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    got = layout(name)
    worker, scheduler = got.worker, got.scheduler
    assert scheduler.num_blocks == worker.num_blocks > 0
    assert [g.layer_names for g in scheduler.kv_cache_groups] == [g.layer_names for g in worker.kv_cache_groups]
    for w, s in zip(worker.kv_cache_groups, scheduler.kv_cache_groups):
        assert not isinstance(s.kv_cache_spec, UniformTypeKVCacheSpecs)
        assert s.kv_cache_spec == next(iter(inner(w).values()))
        assert s.is_eagle_group == w.is_eagle_group
    assert worker.kv_cache_layout == scheduler.kv_cache_layout == got.facts["kv_cache_layout"]
    assert worker.hash_block_size == scheduler.hash_block_size == got.facts["hash_block_size"]
    # every group's block is the engine's, except the tail rings that opt out of prefix caching
    assert got.block_size == min(g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups
                                 if g.kv_cache_spec.prefix_cacheable)
    if name in ("glm5next-mtp", "glm5next-mtp2"):
        assert got.scheduler_from == "engine_core"
    else:
        assert got.scheduler_from == "connector" and got.startup_error is None
        assert got.facts["scheduler_is_engine_core_object"] is True  # the object the engine core built


def test_gemma3_sliding_64_and_full():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    got = layout("gemma3")
    assert got.block_size == 32 and got.facts["enable_prefix_caching"]
    assert kinds(got.worker) == ["SlidingWindowSpec", "FullAttentionSpec"]  # no UniformTypeKVCacheSpecs
    swa, full = (g.kv_cache_spec for g in got.worker.kv_cache_groups)
    assert [g.layer_names for g in got.worker.kv_cache_groups] == [
        ["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]
    assert isinstance(swa, SlidingWindowSpec) and swa.sliding_window == 64
    assert type(full) is FullAttentionSpec
    assert (swa.num_kv_heads, swa.head_size, str(swa.dtype), swa.block_size) == (2, 32, "torch.float32", 32)


def test_gpt_oss_same_groups_as_gemma3_sinks_leave_no_trace():
    got, gemma = layout("gpt-oss"), layout("gemma3")
    assert kinds(got.worker) == ["SlidingWindowSpec", "FullAttentionSpec"]  # not SinkFullAttentionSpec
    assert [g.kv_cache_spec for g in got.worker.kv_cache_groups] == [
        g.kv_cache_spec for g in gemma.worker.kv_cache_groups]
    assert got.block_size == 32


def test_mistral_one_sliding_window_group():
    got = layout("mistral")
    assert kinds(got.worker) == ["SlidingWindowSpec"]
    group = got.worker.kv_cache_groups[0]
    assert group.kv_cache_spec.sliding_window == 64 and len(group.layer_names) == 2
    assert got.block_size == 32


def test_deepseek_v3_one_mla_group_of_576():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    got = layout("deepseek-v3")
    assert kinds(got.worker) == ["MLAAttentionSpec"]
    spec = got.worker.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, MLAAttentionSpec)
    assert (spec.num_kv_heads, spec.head_size) == (1, 576)  # kv_lora 512 + rope 64
    assert spec.cache_role.name == "SPARSE"  # the default, even for dense MLA
    # CPU_MLA: block 16, prefix caching off ("MLA is enabled on a non-GPU platform")
    assert got.block_size == spec.block_size == 16 and not got.facts["enable_prefix_caching"]
    assert got.facts["kv_cache_layout"] == "LBNHC"
    assert set(got.facts["attention_backends"].values()) == {"CPU_MLA"}


def _glm_checks(got, kda_layers: list[list[int]], mla_layers: list[int], ring_block: int, spec_blocks: int):
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    worker = got.worker
    assert got.block_size == 512 and got.facts["kv_cache_layout"] == "BLHNC"
    assert got.facts["enable_prefix_caching"] and got.facts["mamba_cache_mode"] == "align"
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in worker.kv_cache_groups)
    n_kda = len(kda_layers)
    assert len(worker.kv_cache_groups) == n_kda + 2
    for group, layers in zip(worker.kv_cache_groups[:n_kda], kda_layers):
        assert group.layer_names == [f"model.layers.{i}.self_attn" for i in layers]
        for spec in inner(group).values():
            assert type(spec) is MambaSpec and spec.mamba_type.name == "GDN_ATTN"
            assert spec.shapes == ((3 + spec_blocks, 1536), (4, 128, 128))
            assert [str(d) for d in spec.dtypes] == ["torch.bfloat16", "torch.float32"]
            assert spec.page_size_bytes == 524_288 and spec.block_size == 512
            assert spec.num_speculative_blocks == spec_blocks
    mla = worker.kv_cache_groups[n_kda]
    assert mla.layer_names == [name for i in mla_layers for name in (
        f"model.layers.{i}.self_attn.indexer.k_cache", f"model.layers.{i}.self_attn.attn")]
    for name, spec in inner(mla).items():
        assert isinstance(spec, MLAAttentionSpec) and spec.block_size == 512
        if name.endswith("k_cache"):
            assert (spec.head_size, str(spec.dtype), spec.tokens_per_state) == (132, "torch.uint8", 16)
            assert spec.cache_role.name == "INDEXER" and not spec.is_index_group_leader
        else:
            assert (spec.head_size, str(spec.dtype), spec.tokens_per_state) == (512, "torch.bfloat16", 1)
            assert spec.cache_role.name == "SPARSE" and spec.is_index_group_leader
    # the scheduler's group carries the first layer's spec: the indexer cache
    assert got.scheduler.kv_cache_groups[n_kda].kv_cache_spec.cache_role.name == "INDEXER"
    tail = worker.kv_cache_groups[n_kda + 1]
    assert tail.layer_names == [f"model.layers.{i}.self_attn.indexer.tail_cache" for i in mla_layers]
    for spec in inner(tail).values():
        assert type(spec) is CircularBufferSpec and not spec.prefix_cacheable
        assert (spec.block_size, spec.num_kv_heads, spec.head_size, str(spec.dtype)) == (
            ring_block, 2, 128, "torch.bfloat16")
    return worker


def _ring_block(kpool: int, k: int) -> int:
    """kpool x next_pow2(cdiv(kpool + k, kpool)) (FIELD_LAYOUTS.md)."""
    n = -(-(kpool + k) // kpool)
    return kpool * (1 << (n - 1).bit_length())


def test_glm5next_kda_mla_indexer_and_tail_groups():
    got = layout("glm5next")
    worker = _glm_checks(got, kda_layers=[[0], [1], [2]], mla_layers=[3], ring_block=_ring_block(16, 0),
                         spec_blocks=0)
    assert not any(g.is_eagle_group for g in worker.kv_cache_groups)
    assert got.facts["attention_backends"]["model.layers.3.self_attn.attn"] == "FLASHMLA_SPARSE"


def test_glm5next_mtp_groups_and_where_the_start_stops():
    got = layout("glm5next-mtp")
    assert got.facts["speculative_method"] == "mtp" and got.facts["num_speculative_tokens"] == 1
    # the runner refuses the layout after the worker's connector is made (the MTP layer's tail
    # cache is in another group than its attention); the scheduler's config is the engine core's
    assert "All drafting layers should belong to the same kv cache group" in got.startup_error
    assert got.scheduler_from == "engine_core"
    worker = _glm_checks(got, kda_layers=[[0, 2], [1]], mla_layers=[3, 4], ring_block=_ring_block(16, 1),
                         spec_blocks=1)
    # the MLA + indexer group holds the MTP layer (layer 4) and is the drafting group
    assert [g.is_eagle_group for g in worker.kv_cache_groups] == [False, False, True, False]
    # conv state one row longer than without MTP
    plain = layout("glm5next").worker.kv_cache_groups[0].kv_cache_spec.kv_cache_specs
    assert next(iter(inner(worker.kv_cache_groups[0]).values())).shapes[0][0] == \
        next(iter(plain.values())).shapes[0][0] + 1


def test_nemotronh_ngram_speculative_blocks():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    got = layout("nemotronh-ngram")
    k = FIELD_MODELS["nemotronh-ngram"].engine["speculative_config"]["num_speculative_tokens"]
    conv_kernel = json.loads((Path(got.model_dir) / "config.json").read_text())["conv_kernel"]
    assert got.facts["speculative_method"] == "ngram" and got.facts["num_speculative_tokens"] == k == 2
    assert kinds(got.worker) == ["MambaSpec", "MambaSpec", "FullAttentionSpec"]
    for group in got.worker.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            assert spec.num_speculative_blocks == k and spec.mamba_cache_mode == "align"
            assert spec.shapes[0][0] == conv_kernel - 1 + k  # the conv state keeps k more rows
            assert (spec.num_prefill_checkpoint_blocks, spec.prefill_checkpoint_alignment) == (1, 1)
        else:
            assert type(spec) is FullAttentionSpec
    assert got.block_size == got.facts["mamba_block_size"]


def test_torchvision_imports_through_the_shim_without_operators():
    """The shim gives ``import torchvision`` and no operator: calling one fails as without the shim."""
    code = ("from testing.torchvision_shim import install; tv = install(); import torch\n"
            "try:\n    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
            "except NotImplementedError as e:\n    print('refused', type(e).__name__)\n"
            "import torchvision.transforms.v2, sys; print(tv.__version__, tv.extension._has_ops())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["refused", "NotImplementedError", "0.28.0+cu130", "False"]


EXPECTED_KIND = {  # sparkcache's verdict for each model, the same on both halves
    "deepseek-v3": ("attention", ""),
    "glm5next": ("hybrid", ""),
    "nemotronh-ngram": ("hybrid", ""),
    "gemma3": ("hybrid", ""),  # its window group's window in the boundary object
    "gemma3-no-hma": ("attention", ""),  # the fix that refusal names
    "gpt-oss": ("hybrid", ""),  # its window group's window in the boundary object
    "mistral": ("hybrid", ""),  # its window group's window in the boundary object
    "glm5next-mtp": ("hybrid", ""),  # the MTP group's pages under keys that look one token ahead
    "glm5next-mtp2": ("hybrid", ""),  # ... two tokens ahead: the second module reads that far
}


@pytest.mark.parametrize("name", list(FIELD_MODELS))
def test_the_classifier_gives_both_halves_the_same_verdict_and_identity(name):
    """``kv_layout.describe_kv_layout`` on the worker's config (``UniformTypeKVCacheSpecs``
    everywhere) and the scheduler's (each group's first spec): one verdict, one description.
    At 403da3e GLM-5.3's halves differed and everything but NemotronH was refused."""
    from sparkcache.connector.kv_layout import describe_kv_layout

    got = layout(name)
    method, ahead = got.facts["speculative_method"], got.facts["num_prefill_lookahead_tokens"]
    w, s = (describe_kv_layout(got.worker, got.block_size, method, ahead),
            describe_kv_layout(got.scheduler, got.block_size, method, ahead))
    assert (w.kind, w.page_groups, w.state_groups, w.unsupported) == \
        (s.kind, s.page_groups, s.state_groups, s.unsupported)
    assert w.description == s.description
    kind, why = EXPECTED_KIND[name]
    assert w.kind.value == kind, w.unsupported
    assert why in w.unsupported
    if name == "glm5next":  # KDA x3 state; the MLA latent with its indexer cache pages; no ring
        assert (w.state_groups, w.page_groups) == ((0, 1, 2), (3,))
    if name == "glm5next-mtp":  # KDA x2 state; MLA + indexer (the MTP layer's too); no ring
        assert (w.state_groups, w.page_groups, w.lookahead) == ((0, 1), (2,), 1)
    if name == "glm5next-mtp2":  # keys cover as many tokens as vLLM keeps for the drafter's chain
        assert w.lookahead == got.facts["num_prefill_lookahead_tokens"] == 2
        assert '"key_lookahead":2' in w.description
