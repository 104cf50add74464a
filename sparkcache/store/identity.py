"""Who an entry belongs to. Entries of a different identity are never returned."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence, Union

BlockHash = Union[bytes, str, int]


@dataclass(frozen=True)
class Identity:
    """Everything that must agree for stored KV bytes to be valid for a reader.

    model: model name/revision; kv_layout: dtype, layers, heads, head size, attention
    groups (any string that changes when the page bytes would); block_size: tokens per
    block; tp_rank: the tensor-parallel rank that owns the pages; runtime_lock_hash: the
    hash of the pinned vLLM lock (a different runtime may lay out pages differently).
    """

    model: str
    kv_layout: str
    block_size: int
    tp_rank: int
    runtime_lock_hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"Identity.block_size={self.block_size!r}: must be a positive int")
        if not isinstance(self.tp_rank, int) or self.tp_rank < 0:
            raise ValueError(f"Identity.tp_rank={self.tp_rank!r}: must be an int >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Identity":
        return cls(model=str(data["model"]), kv_layout=str(data["kv_layout"]),
                   block_size=int(data["block_size"]), tp_rank=int(data["tp_rank"]),
                   runtime_lock_hash=str(data["runtime_lock_hash"]))

    def digest(self) -> str:
        """A stable 32-hex-char name for this identity (its manifest directory)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def block_key(block_hash: BlockHash) -> str:
    """One chained block hash as the string stored in manifests."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    if isinstance(block_hash, bool):
        raise TypeError("a block hash cannot be a bool")
    if isinstance(block_hash, int):
        return format(block_hash, "x") if block_hash >= 0 else "-" + format(-block_hash, "x")
    if isinstance(block_hash, str) and block_hash and "\n" not in block_hash:
        return block_hash
    raise TypeError(f"block hash {block_hash!r}: expected bytes, int or a non-empty str")


def block_keys(block_hashes: Sequence[BlockHash]) -> list[str]:
    return [block_key(h) for h in block_hashes]


def entry_id_for(identity_digest: str, last_block_key: str) -> str:
    """An entry is named by its identity and the chained hash of its last block."""
    return hashlib.sha256(f"{identity_digest}\n{last_block_key}".encode()).hexdigest()[:40]
