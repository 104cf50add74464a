"""Block keys: computed by the scheduler, the same in every process and after a restart.

A block's key changes whenever its KV bytes can, for the reasons vLLM's own prefix-cache
keys change (``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``)
and one more. The chain (scheme ``KEY_SCHEME``, docs/CONNECTOR.md):

    d_0 = sha256(b"sparkcache-block-key-v2")
    d_i = sha256(d_{i-1} || token ids of block i as little-endian uint32
                         || canonical(extra keys of block i))
    key_i = hex(d_i)[:40]

or, for a layout whose drafter reads the next tokens (``KVLayout.lookahead`` = k > 0: EAGLE /
MTP draft layers' KV at position p is computed from the token at p + 1; module j of a chain of
MTP modules from the token at p + j, so k is vLLM's ``num_prefill_lookahead_tokens``),

    key_i = hex(sha256(d_i || b"lookahead" || the k token ids after block i, as above
                       [|| canonical(window keys of those k tokens)]))[:40]

(the chain itself, ``d_i``, is the same), so an entry is offered only to a request whose
k tokens after its last block are the ones its draft KV was computed with; where those k tokens
hold an image or prompt embeddings (their window keys: each multimodal item in them with its
offset, the sha256 of their embeddings; none for text), ``canonical(window keys)`` follows
the token ids. A block whose next k tokens are not known yet has no key.

The extra keys are vLLM's for that block (LoRA name and path; each multimodal item in
the block with its offset, every one of items that share a range; ``cache_salt`` on block
0; the sha256 of the block's prompt embeddings) followed, on block 0 of a LoRA request, by ``("lora_files", fingerprint of the
adapter directory)``: vLLM keys an adapter by name and path, so an adapter rewritten at
the same path would otherwise restore KV computed with the old one.

Our own chain rather than ``request.block_hashes``: it does not depend on vLLM's
prefix-caching hash algorithm, its seed (``PYTHONHASHSEED``, random per process for xxhash)
or on prefix caching being on.
"""

from __future__ import annotations

import array
import hashlib
import os
import sys
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    from vllm.v1.request import Request

KEY_SCHEME = "sparkcache-block-key-v2"
_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)

# (start token, end token) of a block -> its extra keys (values ``canonical`` encodes), or None
ExtraKeys = Callable[[int, int], tuple[object, ...] | None]


def canonical(value: object) -> bytes:
    """An unambiguous byte encoding of an extra key: None, bool, int, str (a path as its
    text), bytes and tuples/lists of them; anything else is a TypeError (never a guess)."""
    if value is None:  # first: most blocks have no extra keys, and the ABC check below is slow
        return b"N"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"I%d;" % value
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"S%d:" % len(data) + data
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"B%d:" % len(data) + data
    if isinstance(value, (tuple, list)):
        return b"L%d:" % len(value) + b"".join(canonical(v) for v in value)
    raise TypeError(f"block key: cannot encode an extra key of type {type(value).__name__}: {value!r}")


class BlockKeys:
    """Chained keys of one request's full blocks, extended on demand. ``extra_keys`` gives
    a block's extra keys from its token range (None: the block has none); ``lookahead``: how
    many tokens after each block its key covers (module docstring)."""

    __slots__ = ("block_size", "keys", "_digest", "_extra_keys", "_window_keys", "_lookahead")

    def __init__(self, block_size: int, extra_keys: ExtraKeys | None = None, lookahead: int = 0,
                 window_keys: ExtraKeys | None = None) -> None:
        self.block_size = block_size
        self.keys: list[str] = []
        self._digest = hashlib.sha256(KEY_SCHEME.encode()).digest()
        self._extra_keys = extra_keys
        self._window_keys = window_keys
        self._lookahead = lookahead

    def upto(self, token_ids: Sequence[int], n_blocks: int) -> list[str]:
        """The keys of the first ``n_blocks`` blocks, fewer where the tokens end first."""
        bs, ahead, first = self.block_size, self._lookahead, len(self.keys)
        last = min(n_blocks, (len(token_ids) - ahead) // bs)  # blocks whose tokens (and lookahead) are known
        if last <= first:
            return self.keys[:n_blocks]
        packed = _le_uint32(token_ids[first * bs:last * bs + ahead])  # the blocks' tokens, packed once
        width, digest, extra_keys, window_keys = 4 * bs, self._digest, self._extra_keys, self._window_keys
        for i in range(first, last):
            at = (i - first) * width
            extra = extra_keys(i * bs, (i + 1) * bs) if extra_keys else None
            h = hashlib.sha256(digest)
            h.update(packed[at:at + width])
            h.update(canonical(extra))
            digest = h.digest()
            if ahead:
                key = hashlib.sha256(digest + b"lookahead" + packed[at + width:at + width + 4 * ahead])
                window = window_keys((i + 1) * bs, (i + 1) * bs + ahead) if window_keys else None
                if window is not None:
                    key.update(canonical(window))
                self.keys.append(key.hexdigest()[:40])
            else:
                self.keys.append(digest.hex()[:40])
            self._digest = digest  # kept per block: an extra key that raises leaves the chain at its last key
        return self.keys[:n_blocks]


def request_extra_keys(request: Request, adapter_fingerprint: str | None) -> ExtraKeys:
    """The extra keys of ``request``'s blocks (a vLLM ``Request``; ``adapter_fingerprint``
    of its LoRA adapter, if any): vLLM's (``generate_block_hash_extra_keys``: LoRA, multimodal
    items, ``cache_salt`` on block 0, prompt embeddings, in that order), except that every
    multimodal item overlapping the block is keyed (``_mm_keys``). Blocks are asked for in
    order, as ``BlockKeys`` does. Read from the request at each call: a streaming session
    appends tokens and images to it."""
    from vllm.v1.core.kv_cache_utils import _gen_lora_extra_hash_keys, _gen_prompt_embeds_extra_hash_keys

    lora_files = (("lora_files", adapter_fingerprint),) if request.lora_request else ()
    first = 0  # the first multimodal item that may still overlap a block

    def extra(start: int, end: int) -> tuple[object, ...] | None:
        nonlocal first
        if not (request.mm_features or request.lora_request or request.cache_salt
                or request.prompt_embeds is not None):
            return None  # a text request's blocks (until a streaming update adds an image)
        mm, first = _mm_keys(request, start, end, first)
        keys = (tuple(_gen_lora_extra_hash_keys(request)) + tuple(mm)
                + ((("cache_salt", request.cache_salt),) if start == 0 and request.cache_salt else ())
                + tuple(_gen_prompt_embeds_extra_hash_keys(request, start, end))
                + (lora_files if start == 0 else ()))
        return keys or None

    return extra


def _mm_keys(request: Request, start: int, end: int, first: int = 0) -> tuple[list[tuple], int]:
    """``("mm", identifier, offset in the block)`` of every multimodal item overlapping tokens
    ``[start, end)``, in offset order, and the index to start from for a later range. vLLM's
    own walk (``_gen_mm_extra_hash_keys``) stops at the first item not yet ended in the
    block, so of items sharing a range (Qwen2.5-Omni's audio of a video) it keys only the first
    until the block where they end; here each one is keyed wherever it lies. Items that do not
    overlap another are keyed exactly as vLLM keys them."""
    features = request.mm_features or ()
    while first < len(features) and (features[first].mm_position.offset
                                     + features[first].mm_position.length) <= start:
        first += 1
    keys = []
    for feature in features[first:]:
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if offset >= end:
            break
        if offset + length > start:
            if feature.identifier is None:  # two such images would share keys: never keyed
                raise TypeError(f"block key: a multimodal item at offset {offset} has no identifier")
            keys.append(("mm", feature.identifier, offset - start))
    return keys, first


def request_window_keys(request: Request) -> ExtraKeys:
    """The window keys of ``request``'s tokens ``[start, end)`` (module docstring): each
    multimodal item in them with its offset, the sha256 of their prompt embeddings; None for
    text. What a drafter reads besides token ids when it looks ahead."""
    from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

    def window(start: int, end: int) -> tuple[object, ...] | None:
        if not request.mm_features and request.prompt_embeds is None:
            return None
        mm, _ = _mm_keys(request, start, end)
        keys = tuple(mm) + tuple(_gen_prompt_embeds_extra_hash_keys(request, start, end))
        return keys or None

    return window


def _le_uint32(token_ids: Sequence[int]) -> bytes:
    """The token ids as little-endian uint32, the bytes the keys hash (one C call, not
    ``int.to_bytes`` per token: docs/RESULTS.md, "Measurements behind the code");
    OverflowError for an id outside uint32, like ``int.to_bytes``."""
    packed = array.array(_UINT32, token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()
