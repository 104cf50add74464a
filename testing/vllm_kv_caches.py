"""KV caches laid out by vLLM 0.32.0's own code, on CPU tensors, in any ``KVCacheLayout`` and
kernel-block ratio: the per-layer tensors a GPU worker hands ``register_kv_caches``.

``get_kv_cache_config_from_groups`` places the layers in one backing allocation (the engine
core's call), ``allocate_kv_cache`` views it per layer as ``[B, H, N, C]`` (the GPU model
runner's ``initialize_kv_cache_tensors``). ``kernel_block_sizes`` is what the GPU runner's
``prepare_kernel_block_sizes`` returns for a backend whose kernels take smaller blocks than the
manager's (FlashInfer on Hopper: 16, 32 or 64 tokens), so dim 0 then counts kernel blocks. The
CPU backend never splits (its kernel sizes are ``MultipleOf(32)``), which is why only these
tensors, not an engine on this machine, show the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 64          # manager block, tokens
NUM_BLOCKS = 48
HEADS, HEAD_SIZE = 2, 8
ATTN_DTYPE = torch.float16  # a page: 2 heads x 64 tokens x (8 + 8) x 2 bytes = 4 KiB
# A Mamba2-like state: conv (fp16) and ssm (fp32), 752 bytes, padded to the attention page.
STATE_SHAPES = ((3, 40), (2, 4, 16))
STATE_DTYPES = (torch.float16, torch.float32)


# Layers per group with which vLLM 0.32.0 splits blocks into kernel blocks in each layout:
# a block-outermost layout only when a block holds one layer's page (the runner's
# prepare_kernel_block_sizes keeps packed blocks whole, create_kv_cache_views refuses them).
SPLIT_LAYERS = {"LBHNC": 2, "LBNHC": 2, "BLHNC": 1, "BLNHC": 1}
NEVER_SPLIT = ("LHBNC", "BHLNC")  # blocks are not dense pages: vLLM never splits them
# (layout, kernel blocks per block, attention layers): every layout and split vLLM hands a connector
CASES = tuple([(name, 1, 2) for name in (*SPLIT_LAYERS, *NEVER_SPLIT)]
              + [(name, 4, n) for name, n in SPLIT_LAYERS.items()])


@dataclass(frozen=True)
class VllmKV:
    config: object          # vLLM's KVCacheConfig, as the worker gets it
    caches: dict[str, torch.Tensor]  # layer -> the view vLLM hands register_kv_caches
    raw: torch.Tensor       # the whole backing allocation, uint8
    page_layers: tuple[str, ...]   # attention layers
    state_layers: tuple[str, ...]  # recurrent layers (hybrid only)

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """Manager block ``block_id`` of ``layer`` by vLLM's own regrouping
        (``group_kernel_blocks``, as its OffloadingConnector reads it), as bytes."""
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        return group_kernel_blocks(self.caches[layer], self.config.num_blocks)[block_id].view(torch.uint8)


def vllm_kv_caches(layout_name: str, ratio: int, *, hybrid: bool = False, layers: int = 2,
                   seed: int = 0) -> VllmKV:
    """One rank's KV cache as vLLM lays it out: ``layers`` attention layers in group 0 (and as
    many Mamba layers in group 1 when ``hybrid``), blocks of ``BLOCK`` tokens split into
    ``ratio`` kernel blocks; every byte random. Raises vLLM's own error where vLLM refuses the
    layout and split (it then never hands such tensors to a connector)."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout.name  # resolved by the engine core
    vllm_config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=ATTN_DTYPE)
    page_layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    groups = [KVCacheGroupSpec(list(page_layers), attn)]
    state_layers: tuple[str, ...] = ()
    kernel_block_sizes = [BLOCK // ratio]
    if hybrid:
        state_layers = tuple(f"model.layers.{layers + i}.mixer" for i in range(layers))
        mamba = MambaSpec(block_size=BLOCK, shapes=STATE_SHAPES, dtypes=STATE_DTYPES,
                          page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
        groups.append(KVCacheGroupSpec(list(state_layers), mamba))
        kernel_block_sizes.append(BLOCK)  # recurrent groups are never split
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)
    config.kv_cache_layout = layout.name  # as the engine core hands it to every worker
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    some = caches[page_layers[0]]
    raw = torch.empty(0, dtype=torch.uint8).set_(some.untyped_storage())
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return VllmKV(config, caches, raw, page_layers, state_layers)


def block_mask(kv: VllmKV, blocks: dict[str, list[int]]) -> torch.Tensor:
    """True at every byte of the backing allocation that the manager blocks ``blocks``
    (layer -> ids) hold, by vLLM's views of a second allocation laid out the same way."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    twin = torch.zeros_like(kv.raw)
    for layer, ids in blocks.items():
        u = kv.caches[layer].view(torch.uint8)  # the layer's view, in bytes, over the twin
        grouped = group_kernel_blocks(torch.as_strided(twin, u.shape, u.stride(), u.storage_offset()),
                                      kv.config.num_blocks)
        for b in ids:
            grouped[b].fill_(1)
    return twin.bool()


def apart_from(kv: VllmKV, taken: dict[str, list[int]], layers: tuple[str, ...]) -> set[int]:
    """The block ids whose bytes in ``layers`` share none with blocks ``taken``. Cache groups
    overlay one allocation from byte 0; in LHBNC, where a layer's block is one run per head,
    recurrent block ``s`` covers part of the attention blocks of other ids (2s's first head
    here), so a test keeps the two groups' blocks apart as vLLM's block ownership alone does
    not."""
    busy = block_mask(kv, taken)
    return {b for b in range(kv.config.num_blocks)
            if not (block_mask(kv, {n: [b] for n in layers}) & busy).any()}


def describe(kv: VllmKV) -> dict:
    """What ``bench/gpu_copy.py`` rebuilds these views from on a machine without vLLM: the
    backing allocation's size and, per layer, the view vLLM made over it (dtype, shape,
    strides and storage offset, in elements of the dtype), with ``torch.as_strided``."""
    def view(t: torch.Tensor) -> dict:
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
                "offset": t.storage_offset()}
    return {"num_blocks": kv.config.num_blocks, "raw_bytes": kv.raw.numel(),
            "page_layers": {n: view(kv.caches[n]) for n in kv.page_layers},
            "state_layers": {n: view(kv.caches[n]) for n in kv.state_layers}}


def describe_all() -> list[dict]:
    """Every case of ``CASES``, attention-only and hybrid, as ``describe`` gives it."""
    return [{"layout": name, "ratio": ratio, "hybrid": hybrid,
             **describe(vllm_kv_caches(name, ratio, hybrid=hybrid, layers=layers))}
            for name, ratio, layers in CASES for hybrid in (False, True)]


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m testing.vllm_kv_caches",
                                description="Write the KV cache views vLLM 0.32.0 hands a connector, for "
                                            "every layout and kernel-block split, as JSON (bench/gpu_copy.py "
                                            "--views reads it on a machine without vLLM).")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.out, "w") as f:
        json.dump(describe_all(), f, indent=1)
    print(f"wrote {args.out}")
