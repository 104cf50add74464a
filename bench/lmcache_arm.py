"""LMCache 0.5.6 as a bench arm on vLLM's CPU backend: install, environment, and a CPU copy.

LMCache has no CPU build: its wheel's copy between vLLM's paged KV cache and LMCache's memory
chunks (``VLLMPagedMemGPUConnectorV2.to_gpu``/``from_gpu``, ``device_ops.multi_layer_kv_transfer``
over CUDA streams) needs CUDA, and ``lmcache.v1.gpu_connector.CreateGPUConnector`` raises
"No supported cpu connector found" on a CPU torch. This module is the bench-only adapter:

- ``ensure_installed()`` installs ``requirements/bench-lmcache.txt`` (lmcache and the few pure
  packages its vLLM-v1 path imports that the venv lacks) with ``pip --no-deps --require-hashes``
  into ``.cache/bench-lmcache``, never into the venv; a stamp keyed on the requirements file's
  sha256 makes it a no-op after the first time.
- ``activate()`` appends that folder to ``sys.path`` after the venv's site-packages (the
  venv's numpy, torch and transformers win over LMCache's pins) and replaces
  ``CreateGPUConnector`` with one that returns ``TorchPagedCPUConnector`` for vLLM:
  the same memory-object format (``KV_2LTD``: [2, layers, tokens, heads x head dim]) filled
  and read with plain torch indexing on vLLM's CPU KV tensors. Everything else (chunking,
  token hashing, the ``fs://`` remote backend, lookup, vLLM integration) is LMCache's own code.
- ``LMCacheCPUConnector`` (``kv_connector_module_path="bench.lmcache_arm"``) is vLLM's own
  ``LMCacheConnectorV1`` with ``activate()`` run first in every process that builds it.
- ``lmcache_env(root)`` is the environment an engine life sets before importing vLLM: the
  ``fs://`` backend under ``root`` (its ``local_disk`` backend keeps its index in memory and
  restores nothing after a restart), no local CPU tier, 256-token chunks, sha256_cbor
  prefix hashing (stable across processes), no usage reporting.

No stand-in modules are needed: on this path LMCache imports ``nvtx`` inside a try (with its own
no-op fallback) and ``cupy``/``cufile``/``cuda-python`` only in CUDA-device code that a CPU
torch never reaches, so none of the CUDA wheels is installed. Results of this arm are LMCache's
storage and lookup with this bench's torch copy, not LMCache's CUDA kernels.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements" / "bench-lmcache.txt"
TARGET = REPO / ".cache" / "bench-lmcache"
_STAMP = ".requirements-sha256"
CHUNK_TOKENS = 256


def _requirements_digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def ensure_installed(target: Path = TARGET) -> Path:
    """Install the pinned LMCache wheels into ``target`` unless its stamp matches the
    requirements file; returns ``target``. Never touches the running venv."""
    digest = _requirements_digest()
    stamp = target / _STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return target
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes", "--upgrade",
           "--target", str(target), "-r", str(REQUIREMENTS)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"installing the lmcache arm failed: {' '.join(cmd)}\n{done.stderr[-3000:]}\n"
                           "fix: check network access to PyPI and the hashes in requirements/bench-lmcache.txt, "
                           "or leave the arm out (--arms without lmcache)")
    stamp.write_text(digest + "\n")
    return target


def lmcache_env(root: str) -> dict[str, str]:
    """LMCache's settings for one engine life whose stored chunks live under ``root``."""
    return {"LMCACHE_REMOTE_URL": f"fs://127.0.0.1:0/{Path(root).resolve()}/",
            "LMCACHE_LOCAL_CPU": "False", "LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS),
            "LMCACHE_PRE_CACHING_HASH_ALGORITHM": "sha256_cbor", "LMCACHE_TRACK_USAGE": "false"}


def activate(target: Path = TARGET) -> None:
    """Make ``import lmcache`` work in this process and swap in the CPU copy (idempotent)."""
    if not (target / _STAMP).is_file():
        raise RuntimeError(f"{target} holds no lmcache install; fix: call bench.lmcache_arm.ensure_installed() "
                           "in the parent before starting the engine life")
    if str(target) not in sys.path:
        sys.path.append(str(target))  # after site-packages: the venv's own packages win
    import lmcache.v1.gpu_connector as factory

    if getattr(factory.CreateGPUConnector, "_bench_cpu", False):
        return
    original = factory.CreateGPUConnector

    def create(config, metadata, engine, layout_hints=None):
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM:
            return original(config, metadata, engine, layout_hints=layout_hints)
        if config.use_layerwise or config.enable_blending or metadata.use_mla:
            raise RuntimeError("the bench's CPU copy handles LMCache's default (non-layerwise, non-blending, "
                               "non-MLA) vLLM path only; fix: unset LMCACHE_USE_LAYERWISE/LMCACHE_ENABLE_BLENDING")
        return _classes()["TorchPagedCPUConnector"](metadata.kv_shape)

    create._bench_cpu = True  # type: ignore[attr-defined]
    factory.CreateGPUConnector = create


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """The classes import vLLM and LMCache, so they are built on first use (PEP 562): the
    bench's parent process imports this module for ``ensure_installed`` alone."""
    if name in ("LMCacheCPUConnector", "TorchPagedCPUConnector"):
        return _classes()[name]
    raise AttributeError(name)


def _classes() -> dict[str, type]:
    if not _CLASSES:
        _CLASSES.update(_build_classes())
    return _CLASSES


def _build_classes() -> dict[str, type]:
    activate()
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.memory_management import MemoryFormat
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    class TorchPagedCPUConnector(GPUConnectorInterface):
        """LMCache's paged-memory connector contract (``KV_2LTD`` memory objects, a full-sequence
        ``slot_mapping``) on vLLM's CPU KV cache: per layer a tensor [blocks, KV heads, block
        size, 2 x head dim] whose memory is [blocks, heads, K|V, block size, head dim]
        (``CPUAttentionBackendImpl.forward`` splits it so)."""

        def __init__(self, kv_shape: tuple[int, ...]):
            self.num_layers, _, _, self.num_heads, self.head_dim = kv_shape
            self.kvcaches: list[torch.Tensor] | None = None

        def _token_major(self, kvcaches) -> list[torch.Tensor]:
            """Per layer a [blocks, block size, K|V, heads, head dim] view of vLLM's tensor."""
            views = []
            for t in kvcaches:
                blocks, heads, block, twice = t.shape
                if (heads, twice) != (self.num_heads, 2 * self.head_dim):
                    raise RuntimeError(f"vLLM KV cache layer shape {tuple(t.shape)} is not [blocks, "
                                       f"{self.num_heads}, block, {2 * self.head_dim}]; fix: adapt "
                                       "bench.lmcache_arm.TorchPagedCPUConnector to vLLM's CPU layout")
                views.append(t.view(blocks, heads, 2, block, self.head_dim).permute(0, 3, 2, 1, 4))
            return views

        def _slots(self, kwargs: dict, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            if "slot_mapping" not in kwargs:
                raise ValueError("'slot_mapping' should be provided in kwargs")
            if "kvcaches" in kwargs:
                self.kvcaches = list(kwargs["kvcaches"])
            if not self.kvcaches:
                raise ValueError("kvcaches should be provided in kwargs or initialized beforehand")
            block = self.kvcaches[0].shape[2]
            slots = kwargs["slot_mapping"][start:end].to("cpu", torch.long)
            return slots // block, slots % block, block

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            blocks, offsets, _ = self._slots(kwargs, start, end)
            out = memory_obj.tensor  # [2, layers, tokens, heads x head dim]
            for layer, cache in enumerate(self._token_major(self.kvcaches)):
                tokens = cache[blocks, offsets]  # [tokens, K|V, heads, head dim]
                out[:, layer].copy_(tokens.permute(1, 0, 2, 3).reshape(2, end - start, -1))
            memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
                raise ValueError(f"memory object format {memory_obj.metadata.fmt}, expected KV_2LTD")
            blocks, offsets, _ = self._slots(kwargs, start, end)
            # tokens vLLM already holds in its own prefix cache are not overwritten (LMCache's kernel
            # skips them too: vLLM may be reading those blocks)
            skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
            src = memory_obj.tensor[:, :, skip:end - start]
            for layer, cache in enumerate(self._token_major(self.kvcaches)):
                rows = src[:, layer].reshape(2, -1, self.num_heads, self.head_dim).permute(1, 0, 2, 3)
                cache[blocks[skip:], offsets[skip:]] = rows.to(cache.dtype)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.num_heads * self.head_dim])

    class LMCacheCPUConnector(LMCacheConnectorV1):
        """vLLM's ``LMCacheConnectorV1`` with the bench's CPU copy in place (``activate``)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            activate()
            super().__init__(vllm_config, role, kv_cache_config)

    return {"TorchPagedCPUConnector": TorchPagedCPUConnector, "LMCacheCPUConnector": LMCacheCPUConnector}
