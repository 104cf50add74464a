"""Who an entry belongs to. Entries of a different identity are never returned."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence, Union

BlockHash = Union[bytes, str, int]


@dataclass(frozen=True)
class Identity:
    """Everything that must agree for stored KV bytes to be valid for a reader.

    model: model name or path, revision and dtype; kv_layout: per KV group the spec, layers,
    heads, head size and KV-cache dtype, and vLLM's kv_cache_layout (any string that changes
    when the page bytes would); block_size: tokens per block; tp_rank: the tensor-parallel
    rank that owns the pages; runtime_lock_hash: which vLLM is installed (the transform lock
    its files match); weights: a fingerprint of the weight files; model_config: quantization,
    ``hf_overrides``, load format and KV-cache dtype; parallel: tensor-parallel
    size and every other setting that changes which heads or tokens a rank holds;
    key_scheme: the definition of the block keys (a store of another scheme is not found).
    The connector fills them (``sparkcache/connector/identity.py``); the store only compares.
    """

    model: str
    kv_layout: str
    block_size: int
    tp_rank: int
    runtime_lock_hash: str
    weights: str = ""
    model_config: str = ""
    parallel: str = ""
    key_scheme: str = ""

    def __post_init__(self) -> None:
        for name, low in (("block_size", 1), ("tp_rank", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"Identity.{name}={value!r}: must be an int >= {low}")
        for f in dataclasses.fields(self):
            if f.type in ("str", str) and not isinstance(getattr(self, f.name), str):
                raise ValueError(f"Identity.{f.name}={getattr(self, f.name)!r}: must be a str")

    def to_dict(self) -> dict[str, str | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Identity":
        """The identity a manifest records (decoded JSON: ``__post_init__`` checks each value's
        type); ValueError for one of another sparkcache version (a field missing or unknown):
        its entries are not ours to read."""
        try:
            key = tuple(sorted(data.items()))
            hash(key)
        except TypeError:
            key = None  # an unhashable value: __post_init__ refuses it below
        known = _DECODED.get(key) if key is not None else None
        if known is not None:
            return known
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"identity fields {sorted(data)} are not this sparkcache's "
                             f"{sorted(names)} (an entry of another key scheme)")
        identity = cls(**{name: data[name] for name in names})
        if key is not None:
            if len(_DECODED) >= 256:  # a store holds few identities; a hostile one many
                _DECODED.clear()
            _DECODED[key] = identity
        return identity

    def digest(self) -> str:
        """A stable 32-hex-char name for this identity (its manifest directory); computed once
        (an identity is immutable)."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.sha256(canonical.encode()).hexdigest()[:32]
            object.__setattr__(self, "_digest", cached)
        return cached

    def unit_digest(self) -> str:
        """The digest of rank 0's identity of the same unit (this one with ``tp_rank`` 0): what
        every tensor-parallel rank's shard of an entry shares. The shared tier keeps a unit's
        objects under it, so the ranks of a replicated layout (MLA: each rank's pages are rank
        0's bytes) store them once (``remote_keys``)."""
        return self.digest() if self.tp_rank == 0 else dataclasses.replace(self, tp_rank=0).digest()


_DECODED: dict[tuple, Identity] = {}  # the identities manifests recorded, by their fields


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
