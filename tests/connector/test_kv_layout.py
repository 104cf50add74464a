"""The layout classifier: what each group is, by vLLM 0.32.0's spec types, the same on the
scheduler and the workers, with every field that changes stored bytes in the identity.

Real parts: vLLM's spec, group and config types, ``UniformTypeKVCacheSpecs.from_specs`` and
``generate_scheduler_kv_cache_config`` (what the engine core hands the scheduler). The groups
are those vLLM builds for GLM-5.3 (shared/docs/FIELD_LAYOUTS.md); ``test_field_layouts.py``
checks the classifier on the configs vLLM builds from the models themselves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkcache.connector.kv_layout import LayoutKind, describe_kv_layout

B = 512


def _specs():
    from vllm.v1.kv_cache_interface import (CircularBufferSpec, MambaSpec, MLAAttentionSpec,
                                            SparseCacheRole)

    kda = MambaSpec(block_size=B, shapes=((3, 1536), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                    mamba_cache_mode="align", page_size_padded=524_288)
    indexer = MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                               tokens_per_state=16, cache_role=SparseCacheRole.INDEXER)
    latent = MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
                              is_index_group_leader=True)
    ring = CircularBufferSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    return kda, indexer, latent, ring


def _glm_like(kda=None, indexer=None, latent=None, ring=None, eagle=False):
    """The worker's config of a tiny GLM-5.3 (FIELD_LAYOUTS.md) and the scheduler's."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    d_kda, d_indexer, d_latent, d_ring = _specs()
    kda, indexer, latent, ring = kda or d_kda, indexer or d_indexer, latent or d_latent, ring or d_ring
    mixed = UniformTypeKVCacheSpecs.from_specs({"model.layers.3.self_attn.indexer.k_cache": indexer,
                                                "model.layers.3.self_attn.attn": latent})
    assert mixed is not None  # vLLM merges the two into one group, as it does for the model
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], kda) for i in range(3)]
    groups += [KVCacheGroupSpec(list(mixed.kv_cache_specs), mixed, is_eagle_group=eagle),
               KVCacheGroupSpec(["model.layers.3.self_attn.indexer.tail_cache"], ring)]
    worker = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    worker.kv_cache_layout = "BLHNC"
    return worker, generate_scheduler_kv_cache_config([worker])


def test_a_group_mixing_mla_and_its_indexer_is_the_same_layout_on_both_halves():
    worker, scheduler = _glm_like()
    assert type(scheduler.kv_cache_groups[3].kv_cache_spec).__name__ == "MLAAttentionSpec"  # the indexer's
    w, s = describe_kv_layout(worker, B), describe_kv_layout(scheduler, B)
    assert w.kind is s.kind is LayoutKind.HYBRID, (w.unsupported, s.unsupported)
    assert w.description == s.description
    assert w.page_groups == s.page_groups == (3,)      # MLA latent + indexer key cache
    assert w.state_groups == s.state_groups == (0, 1, 2)  # KDA
    # the ring is neither stored nor refused: nothing in it is read at a block boundary
    assert 4 not in w.page_groups + w.state_groups


def _replace(spec, **change):
    return dataclasses.replace(spec, **change)


@pytest.mark.parametrize("which,change", [
    ("kda", {"num_prefill_checkpoint_blocks": 1}),
    ("kda", {"prefill_checkpoint_alignment": 1}),
    ("kda", {"num_speculative_blocks": 1}),
    ("kda", {"shapes": ((4, 1536), (4, 128, 128))}),
    ("kda", {"dtypes": (torch.float32, torch.float32)}),
    ("indexer", {"tokens_per_state": 32}),
    ("indexer", {"head_size": 136}),
    ("ring", {"block_size": 32}),
])
def test_every_field_that_changes_stored_bytes_changes_the_identity(which, change):
    base = describe_kv_layout(_glm_like()[1]).description
    d = dict(zip(("kda", "indexer", "latent", "ring"), _specs()))
    changed = _glm_like(**{which: _replace(d[which], **change)})[1]
    assert describe_kv_layout(changed).description != base


def test_the_mla_and_indexer_roles_change_the_identity():
    from vllm.v1.kv_cache_interface import SparseCacheRole

    _, indexer, _, _ = _specs()
    base = describe_kv_layout(_glm_like()[1]).description
    other = _glm_like(indexer=_replace(indexer, cache_role=SparseCacheRole.SPARSE))[1]
    assert describe_kv_layout(other).description != base


def _one_group(spec, **group):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.attn"], spec, **group)])


def test_deepseek_mla_is_pages():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    layout = describe_kv_layout(_one_group(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                            dtype=torch.float32)))
    assert layout.kind is LayoutKind.ATTENTION and layout.page_groups == (0,)


def test_a_full_attention_spec_with_a_window_keeps_every_block_and_its_window_is_in_the_identity():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    plain = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    a = describe_kv_layout(_one_group(plain))
    b = describe_kv_layout(_one_group(_replace(plain, sliding_window=64)))
    assert a.kind is b.kind is LayoutKind.ATTENTION
    assert a.description != b.description


@pytest.mark.parametrize("case", ["sliding-other-block", "rswa", "eagle-state", "dspark-group", "dflash", "chunked",
                                  "non-align"])
def test_what_is_not_stored_is_refused_naming_the_group_and_the_fix(case):
    from vllm.v1 import kv_cache_interface as k

    attn = k.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = {
        "sliding-other-block": lambda: k.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            k.KVCacheGroupSpec(["a"], attn),
            k.KVCacheGroupSpec(["b"], k.SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=32,
                                                          dtype=torch.float32, sliding_window=64))]),
        # a subclass of FullAttentionSpec that evicts blocks: never taken for full attention
        "rswa": lambda: _one_group(k.RSWASpec(block_size=32, num_kv_heads=2, head_size=32,
                                              dtype=torch.float32, rswa_window=64)),
        "eagle-state": lambda: k.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            k.KVCacheGroupSpec(["a"], attn), k.KVCacheGroupSpec(["b"], _specs()[0], is_eagle_group=True)]),
        "dspark-group": lambda: _one_group(k.MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576,
                                                              dtype=torch.float32,
                                                              non_causal_multi_token_decode=True)),
        "dflash": lambda: _one_group(attn),
        "chunked": lambda: _one_group(_replace(attn, attention_chunk_size=128)),
        "non-align": lambda: _glm_like(kda=_replace(_specs()[0], mamba_cache_mode="all"))[0],
    }[case]()
    layout = describe_kv_layout(config, 32 if case == "sliding-other-block" else None,
                                speculative_method="dflash" if case == "dflash" else None)
    assert layout.kind is LayoutKind.UNSUPPORTED
    assert ("group " if case != "dflash" else "speculative decoding") in layout.unsupported
    word = {"sliding-other-block": "not the engine's 32", "rswa": "RSWASpec", "eagle-state": "recurrent draft",
            "dspark-group": "DSpark", "dflash": "method mtp, eagle or eagle3",
            "chunked": "chunked", "non-align": "--mamba-cache-mode align"}[case]
    assert word in layout.unsupported, layout.unsupported


@pytest.mark.parametrize("how", ["flagged group", "method only"])
def test_a_next_token_drafters_pages_are_stored_with_keys_that_look_one_token_ahead(how):
    """GLM-5.3 with MTP: the MLA group is the draft layers' group (``is_eagle_group``). Its
    pages are stored, under keys that cover the token after each block (``lookahead`` 1,
    ``keys.BlockKeys``), and the identity says so. vLLM flags no group when a drafter's
    layers share the target's group; then ``speculative_config.method`` alone decides."""
    worker, scheduler = _glm_like(eagle=how == "flagged group")
    method = "mtp" if how == "method only" else None
    w, s = describe_kv_layout(worker, B, method), describe_kv_layout(scheduler, B, method)
    assert w.kind is s.kind is LayoutKind.HYBRID, w.unsupported
    assert w.page_groups == (3,) and w.state_groups == (0, 1, 2)
    assert w.lookahead == s.lookahead == 1 and w.description == s.description
    # a chain of MTP modules reads further: its keys look as far ahead, under another identity
    chain = describe_kv_layout(worker, B, method, prefill_lookahead=3)
    assert chain.lookahead == 3 and chain.description != w.description
    plain = describe_kv_layout(_glm_like()[1], B)
    assert plain.lookahead == 0 and '"key_lookahead"' not in plain.description
    assert plain.description != w.description
    # an ngram drafter reads no KV: nothing changes
    assert describe_kv_layout(_glm_like()[1], B, "ngram") == plain


@pytest.mark.parametrize("window,extra,blocks", [(64, 0, 2), (65, 0, 2), (66, 0, 3), (64, 32, 3), (4096, 0, 128)])
def test_a_window_group_holds_the_blocks_a_resumed_request_reads(window, extra, blocks):
    """A request resumed at boundary N reads tokens [N - window + 1, N) of a windowed layer;
    vLLM keeps ``extra_retained_tokens`` more below them (``get_num_skipped_tokens``): that
    many whole blocks, fewer for an entry shorter than that. Every layer windowed (Mistral):
    an entry is its windows alone."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                            sliding_window=window, extra_retained_tokens=extra)
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mixed = describe_kv_layout(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["w"], swa), KVCacheGroupSpec(["f"], attn)]), 32)
    assert mixed.kind is LayoutKind.HYBRID and mixed.has_state
    assert (mixed.page_groups, mixed.state_groups, mixed.window_groups) == ((1,), (), (0,))
    assert mixed.window_blocks == (blocks,) and mixed.windows_at(1) == (1,)
    alone = describe_kv_layout(_one_group(swa), 32)
    assert alone.kind is LayoutKind.HYBRID and (alone.page_groups, alone.window_groups) == ((), (0,))
    assert alone.description != describe_kv_layout(_one_group(_replace(swa, sliding_window=window + 32)), 32).description


def test_a_group_vllm_does_not_transfer_is_neither_stored_nor_refused():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["b"], attn, enable_kv_transfer=False)])
    layout = describe_kv_layout(config)
    assert layout.kind is LayoutKind.ATTENTION and layout.page_groups == (0,)


def test_a_spec_field_without_a_stable_text_form_stops_startup():
    """A field whose text is an address would give the scheduler and every worker another
    identity: refused at startup, naming the field, rather than never finding an entry."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    odd = _replace(attn, block_stride_alignment=object())
    with pytest.raises(ValueError, match="FullAttentionSpec.block_stride_alignment=.* no stable text form"):
        describe_kv_layout(_one_group(odd))


def test_non_causal_attention_is_refused():
    """Prefix-LM attention: a prefix's KV depends on the tokens after it (vLLM turns its own
    prefix caching off for it); restoring it under another suffix would serve wrong bytes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, non_causal=True)
    layout = describe_kv_layout(_one_group(attn))
    assert layout.kind is LayoutKind.UNSUPPORTED and "non-causal" in layout.unsupported


def test_a_stored_group_in_blocks_of_another_size_is_refused():
    """A boundary is one column of every group's table: a recurrent group in bigger blocks
    (--mamba-block-size) would have its state looked for in another column."""
    kda = _replace(_specs()[0], block_size=2 * B)
    layout = describe_kv_layout(_glm_like(kda=kda)[1], B)
    assert layout.kind is LayoutKind.UNSUPPORTED and f"not the engine's {B}" in layout.unsupported
    assert describe_kv_layout(_glm_like()[1], B).kind is LayoutKind.HYBRID


def test_a_ring_sparkcache_does_not_know_is_refused():
    from vllm.v1.kv_cache_interface import (CircularBufferSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    ring = CircularBufferSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    for layer, kind in (("model.layers.0.attn.compressor.state", LayoutKind.UNSUPPORTED),
                        ("model.layers.0.self_attn.indexer.tail_cache", LayoutKind.ATTENTION)):
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.attn"], attn), KVCacheGroupSpec([layer], ring)])
        assert describe_kv_layout(config, 32).kind is kind, layer


def test_a_group_whose_layers_would_be_stored_differently_stops_startup():
    """The scheduler sees a mixed group's first layer only: a second layer sparkcache would
    refuse must not leave the workers refusing what the scheduler offers."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            UniformTypeKVCacheSpecs)

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mixed = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={
        "model.layers.0.attn": attn, "model.layers.1.attn": _replace(attn, non_causal=True)})
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(list(mixed.kv_cache_specs), mixed)])
    with pytest.raises(ValueError, match="group 0 .* mixes layers .* Fix: SPARKCACHE_ACCESS_MODE=disabled"):
        describe_kv_layout(config, 32)
