"""Store identity and block keys, computed the same way by the scheduler and the workers.

Block keys are our own chain over token ids (sha256), not vLLM's block hashes: vLLM seeds
its chain per process unless PYTHONHASHSEED is set, so its hashes do not survive a restart.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from sparkcache.store import Identity

_LOCK_ENV = "SPARKCACHE_RUNTIME_LOCK"
_KEY_SEED = b"sparkcache-block-key-v1"
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def runtime_lock_hash() -> str:
    """sha256 of ``transforms/vllm-0.32.0.lock.json`` (or the file named by
    SPARKCACHE_RUNTIME_LOCK); 'untransformed' when there is none."""
    candidates = [os.environ.get(_LOCK_ENV, "")]
    candidates.append(str(Path(__file__).resolve().parents[2] / "transforms" / "vllm-0.32.0.lock.json"))
    for path in candidates:
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    return "untransformed"


def describe_kv_layout(kv_cache_config: Any) -> tuple[str, bool]:
    """(layout string, whether every group is full attention the worker can copy).

    The string changes whenever page bytes would: spec type, heads, head size, dtype,
    block size, layer names per group, and vLLM's kv_cache_layout.
    """
    groups = []
    attention_only = True
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
            attention_only = False
        groups.append({
            "spec": kind, "layers": list(g.layer_names),
            "block_size": getattr(spec, "block_size", None),
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", getattr(spec, "dtypes", ""))),
            "shapes": str(getattr(spec, "shapes", "")),
        })
    layout = {"groups": groups, "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", ""))}
    return json.dumps(layout, sort_keys=True, separators=(",", ":")), attention_only


def make_identity(vllm_config: Any, kv_cache_config: Any, tp_rank: int) -> tuple[Identity, bool]:
    mc = vllm_config.model_config
    model = f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}:{mc.dtype}"
    layout, attention_only = describe_kv_layout(kv_cache_config)
    identity = Identity(model=model, kv_layout=layout,
                        block_size=int(vllm_config.cache_config.block_size),
                        tp_rank=int(tp_rank), runtime_lock_hash=runtime_lock_hash())
    return identity, attention_only


class BlockKeys:
    """Chained keys of one request's full blocks, extended on demand."""

    __slots__ = ("block_size", "keys", "_digest")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: list[str] = []
        self._digest = hashlib.sha256(_KEY_SEED).digest()

    def upto(self, token_ids: Sequence[int], n_blocks: int) -> list[str]:
        bs = self.block_size
        while len(self.keys) < n_blocks:
            i = len(self.keys)
            chunk = token_ids[i * bs:(i + 1) * bs]
            if len(chunk) < bs:
                break
            h = hashlib.sha256(self._digest)
            h.update(_le_uint32(chunk))
            self._digest = h.digest()
            self.keys.append(self._digest.hex()[:40])
        return self.keys[:n_blocks]


def _le_uint32(token_ids: Sequence[int]) -> bytes:
    """The token ids as little-endian uint32, the bytes the keys hash (10x faster than
    ``int.to_bytes`` per token; OverflowError for an id outside uint32, like that was)."""
    packed = array.array(_UINT32, token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()
