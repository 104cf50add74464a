"""Block keys are an on-disk format: stored manifests are found again only if every version
computes the same keys. The reference here is the definition (docs/CONNECTOR.md): a sha256
chain seeded with ``sparkcache-block-key-v1``, each block's token ids as little-endian
uint32, the key the first 40 hex characters of the chained digest."""

from __future__ import annotations

import hashlib
import random

import pytest

from sparkcache.connector.keys import BlockKeys


def _reference(tokens: list[int], block_size: int) -> list[str]:
    digest, keys = hashlib.sha256(b"sparkcache-block-key-v1").digest(), []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        digest = hashlib.sha256(digest + b"".join(t.to_bytes(4, "little") for t in chunk)).digest()
        keys.append(digest.hex()[:40])
    return keys


def test_keys_follow_the_definition_and_extend_incrementally():
    rng = random.Random(7)
    tokens = [rng.randrange(0, 2**32) for _ in range(32 * 9 + 5)]
    keys = BlockKeys(32)
    assert keys.upto(tokens, 3) == _reference(tokens, 32)[:3]
    assert keys.upto(tokens, 20) == _reference(tokens, 32)  # stops at the last full block


def test_token_id_outside_uint32_is_refused():
    with pytest.raises(OverflowError):
        BlockKeys(2).upto([1, 2**32], 1)
