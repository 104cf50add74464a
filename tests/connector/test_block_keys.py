"""Block keys are an on-disk format and the guard against restoring another input's KV.

The reference here is the definition (docs/CONNECTOR.md, ``sparkcache/connector/keys.py``):
a sha256 chain seeded with ``sparkcache-block-key-v2``; per block the token ids as
little-endian uint32 and the canonical encoding of the block's extra keys; the key the
first 40 hex characters of the chained digest. The requests are real vLLM ``Request``s.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkcache.connector.identity import AdapterFingerprints
from sparkcache.connector.keys import BlockKeys, canonical, request_extra_keys

BS = 16
REPO = Path(__file__).resolve().parents[2]


def _reference(tokens: list[int], block_size: int) -> list[str]:
    return _reference_ahead(tokens, block_size, 0, lambda start, end: None)


def test_keys_follow_the_definition_and_extend_incrementally():
    rng = random.Random(7)
    tokens = [rng.randrange(0, 2**32) for _ in range(32 * 9 + 5)]
    keys = BlockKeys(32)
    assert keys.upto(tokens, 3) == _reference(tokens, 32)[:3]
    assert keys.upto(tokens, 20) == _reference(tokens, 32)  # stops at the last full block


def test_lookahead_keys_cover_the_token_after_each_block_and_keep_the_chain():
    """For a drafter that reads the next token (EAGLE / MTP): key i also covers the token
    after block i, so two prompts differing only there share every key but the block before
    it; a block whose next token is not known has no key yet."""
    rng = random.Random(3)
    tokens = [rng.randrange(0, 2**32) for _ in range(32 * 4)]
    other = list(tokens)
    other[64] ^= 1  # the first token of block 2
    plain, ahead, ahead_other = BlockKeys(32), BlockKeys(32, lookahead=1), BlockKeys(32, lookahead=1)
    a, b = ahead.upto(tokens, 4), ahead_other.upto(other, 4)
    assert len(a) == 3  # block 3 ends the tokens: nothing after it
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert plain.upto(tokens, 2) == BlockKeys(32).upto(other, 2)  # without the lookahead they agree
    assert set(a).isdisjoint(plain.upto(tokens, 4))  # never a plain key
    digest = hashlib.sha256(b"sparkcache-block-key-v2").digest()
    digest = hashlib.sha256(digest + b"".join(t.to_bytes(4, "little") for t in tokens[:32]) + b"N").digest()
    assert a[0] == hashlib.sha256(digest + b"lookahead" + tokens[32].to_bytes(4, "little")).hexdigest()[:40]
    assert BlockKeys(32, lookahead=1).upto(tokens + [5], 4)[:3] == a  # extends the same way
    # a chain of two MTP modules (lookahead 2): the second token after a block is covered too
    second = list(tokens)
    second[65] ^= 1
    assert BlockKeys(32, lookahead=1).upto(second, 3)[1] == a[1]
    two = BlockKeys(32, lookahead=2).upto(tokens, 4)
    assert len(two) == 3 and two[1] != BlockKeys(32, lookahead=2).upto(second, 4)[1]
    assert len(BlockKeys(32, lookahead=2).upto(tokens[:97], 4)) == 2  # block 2's second token unknown


def _reference_ahead(tokens: list[int], block_size: int, ahead: int, extra) -> list[str]:
    """The module docstring's definition, one block at a time, with extra keys ``extra``."""
    digest, keys = hashlib.sha256(b"sparkcache-block-key-v2").digest(), []
    le = lambda ts: b"".join(t.to_bytes(4, "little") for t in ts)  # noqa: E731
    for i in range((len(tokens) - ahead) // block_size):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        digest = hashlib.sha256(digest + le(chunk) + canonical(extra(i * block_size, (i + 1) * block_size))).digest()
        after = tokens[(i + 1) * block_size:(i + 1) * block_size + ahead]
        keys.append((hashlib.sha256(digest + b"lookahead" + le(after)).hexdigest() if ahead else digest.hex())[:40])
    return keys


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 3), st.lists(st.integers(0, 2**32 - 1), max_size=80),
       st.lists(st.integers(0, 12), max_size=6), st.booleans())
def test_keys_asked_for_in_any_steps_as_tokens_arrive_follow_the_definition(bs, ahead, tokens, asks, salted):
    """However the scheduler asks (more blocks, fewer, the same again) while the request's
    tokens grow, the keys are the definition's; with extra keys on some blocks too."""
    extra = (lambda s, e: ("salt", s) if s % 3 == 0 else None) if salted else (lambda s, e: None)
    keys = BlockKeys(bs, extra if salted else None, ahead)
    expected = _reference_ahead(tokens, bs, ahead, extra)
    for k, n in enumerate(asks):  # the tokens known so far grow with each ask
        known = tokens[:len(tokens) * (k + 1) // len(asks)]
        got = keys.upto(known, n)
        assert got == expected[:min(n, max(0, (len(known) - ahead) // bs))]


def test_token_id_outside_uint32_is_refused():
    with pytest.raises(OverflowError):
        BlockKeys(2).upto([1, 2**32], 1)


_atoms = st.none() | st.booleans() | st.integers() | st.text() | st.binary()
_values = st.recursive(_atoms, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12)


def _same(a, b) -> bool:
    """Equal in value and in type at every level (``True == 1`` and ``(False,) == (0,)``
    in Python, but they are different extra keys)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=400, deadline=None)
@given(_values, _values)
def test_canonical_encoding_is_injective(a, b):
    assert (canonical(a) == canonical(b)) == _same(a, b), (a, b)


def test_canonical_encoding_tells_types_apart():
    assert len({canonical(v) for v in (True, 1, "1", b"1", (1,), (True,), None, (), "", b"")}) == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(_values, min_size=1, max_size=3), st.lists(_values, min_size=1, max_size=3))
def test_different_extra_keys_never_share_a_key(extras_a, extras_b):
    tokens = list(range(BS * 3))
    a = BlockKeys(BS, lambda s, e: extras_a[s // BS % len(extras_a)]).upto(tokens, 3)
    b = BlockKeys(BS, lambda s, e: extras_b[s // BS % len(extras_b)]).upto(tokens, 3)
    enc = [[canonical(x[i % len(x)]) for i in range(3)] for x in (extras_a, extras_b)]
    for i in range(3):
        assert (a[i] == b[i]) == (enc[0][:i + 1] == enc[1][:i + 1])


def test_unencodable_extra_key_is_refused_and_a_path_is_its_text():
    with pytest.raises(TypeError):
        canonical(1.5)
    assert canonical(Path("/adapters/a")) == canonical("/adapters/a")


# ------------------------------------------------------------------ real vLLM requests

def _request(tokens, *, salt=None, lora=None, mm=(), embeds=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=off, length=n))
                for ident, off, n in mm]
    return Request(request_id="r", prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, cache_salt=salt, lora_request=lora, mm_features=features or None,
                   prompt_embeds=embeds)


def _keys(request, n=6, fingerprint=None):
    return BlockKeys(BS, request_extra_keys(request, fingerprint)).upto(request.all_token_ids, n)


def _lora(name, path, int_id=1, **kw):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, str(path), **kw)


TOKENS = [random.Random(3).randrange(3, 500) for _ in range(BS * 6 + 3)]


def test_plain_request_keys_are_the_token_chain():
    assert _keys(_request(TOKENS)) == _reference(TOKENS, BS)[:6]


def test_cache_salt_changes_every_key_and_the_same_salt_matches():
    plain, s1, s2 = _keys(_request(TOKENS)), _keys(_request(TOKENS, salt="s1")), _keys(_request(TOKENS, salt="s2"))
    assert not set(plain) & set(s1) and not set(s1) & set(s2)
    assert _keys(_request(TOKENS, salt="s1")) == s1


def _adapter(tmp_path: Path, name: str, weights: bytes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def _rewrite(path: Path, data: bytes) -> None:
    before = os.stat(path).st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_lora_adapter_name_path_and_files_change_the_keys(tmp_path):
    a, b = _adapter(tmp_path, "a", b"A" * 64), _adapter(tmp_path, "b", b"B" * 64)
    adapters = AdapterFingerprints()
    fp_a, why = adapters.check(_lora("a", a, 1))
    fp_b, _ = adapters.check(_lora("b", b, 2))
    assert why is None and fp_a and fp_b and fp_a != fp_b
    base = _keys(_request(TOKENS))
    ka = _keys(_request(TOKENS, lora=_lora("a", a, 1)), fingerprint=fp_a)
    kb = _keys(_request(TOKENS, lora=_lora("b", b, 2)), fingerprint=fp_b)
    assert not set(base) & set(ka) and not set(ka) & set(kb)
    assert adapters.check(_lora("a", a, 1)) == (fp_a, None)
    # another name for the same files: vLLM's key (name, path) moves, so does ours
    assert not set(_keys(_request(TOKENS, lora=_lora("a2", a, 1)), fingerprint=fp_a)) & set(ka)
    # the adapter rewritten at the same name and path: the worker keeps the one it loaded
    _rewrite(a / "adapter_model.safetensors", b"C" * 64)
    assert adapters.check(_lora("a", a, 1)) == (None, "lora_changed")
    assert adapters.check(_lora("a", b, 1)) == (None, "lora_changed")  # same id, other path
    reloaded, why = adapters.check(_lora("a", a, 1, load_inplace=True))  # the worker reloads it
    assert why is None and reloaded != fp_a
    assert adapters.check(_lora("a", a, 1)) == (reloaded, None)
    assert AdapterFingerprints().check(_lora("a", a, 1)) == (reloaded, None)  # after a restart
    assert not set(_keys(_request(TOKENS, lora=_lora("a", a, 1)), fingerprint=reloaded)) & set(ka)


def test_unreadable_adapter_is_refused(tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    adapters = AdapterFingerprints()
    assert adapters.check(_lora("x", tmp_path / "missing")) == (None, "lora_unreadable")
    assert adapters.check(_lora("y", empty, 2)) == (None, "lora_unreadable")


def test_different_image_same_placeholders_never_share_a_key_from_its_block_on():
    # image in blocks 2..3 (tokens 40..63): blocks 0-1 are text and may be shared
    img_a = _keys(_request(TOKENS, mm=[("hash-of-image-a", 40, 24)]))
    img_b = _keys(_request(TOKENS, mm=[("hash-of-image-b", 40, 24)]))
    text = _keys(_request(TOKENS))
    assert img_a[:2] == img_b[:2] == text[:2]
    assert not set(img_a[2:]) & set(img_b[2:]) and not set(img_a[2:]) & set(text[2:])
    moved = _keys(_request(TOKENS, mm=[("hash-of-image-a", 41, 23)]))
    assert moved[:2] == img_a[:2] and moved[2] != img_a[2]


def test_prompt_embeds_with_identical_placeholder_ids_never_share_a_key():
    import torch

    g = torch.Generator().manual_seed(0)
    n = BS * 4
    e1, e2 = torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)
    zeros = [0] * n  # what vLLM puts in prompt_token_ids for prompt embeds
    k1, k2 = _keys(_request(zeros, embeds=e1), 4), _keys(_request(zeros, embeds=e2), 4)
    assert not set(k1) & set(k2)
    assert not set(k1) & set(_keys(_request(zeros), 4))
    assert _keys(_request(zeros, embeds=e1.clone()), 4) == k1


def test_lookahead_keys_cover_an_image_or_embeddings_after_the_block():
    """A drafter's KV at a block's last position is computed from the token after it: where
    that token is an image placeholder (or a prompt embedding), its key covers the image
    (the embedding), not only the placeholder id."""
    import torch

    from sparkcache.connector.keys import request_window_keys

    def ahead(request, n=4):
        return BlockKeys(BS, request_extra_keys(request, None), 1,
                         request_window_keys(request)).upto(request.all_token_ids, n)

    # image a / b starting right after block 1 (token 2 * BS), so block 1's own tokens are text
    a = ahead(_request(TOKENS, mm=[("hash-of-image-a", 2 * BS, 8)]))
    b = ahead(_request(TOKENS, mm=[("hash-of-image-b", 2 * BS, 8)]))
    text = ahead(_request(TOKENS))
    assert a[0] == b[0] == text[0]
    assert len({a[1], b[1], text[1]}) == 3  # block 1's key looks at the image after it
    assert ahead(_request(TOKENS, mm=[("hash-of-image-a", 2 * BS, 8)])) == a
    zeros = [0] * (BS * 4 + 1)
    e = torch.randn(len(zeros), 8, generator=torch.Generator().manual_seed(1))
    e2 = e.clone()
    e2[BS, 0] += 1.0  # the first token after block 0
    k1, k2 = ahead(_request(zeros, embeds=e)), ahead(_request(zeros, embeds=e2))
    assert k1[0] != k2[0]  # block 0's own embeddings are equal; the one after differs
    assert ahead(_request(zeros, embeds=e.clone())) == k1


def _vllm_extra(request):
    """vLLM's own extra keys per block (``generate_block_hash_extra_keys``), for comparison."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    index = 0

    def extra(start, end):
        nonlocal index
        keys, index = generate_block_hash_extra_keys(request, start, end, index)
        return tuple(keys) if keys else None

    return extra


def test_keys_equal_vllms_extra_keys_where_items_do_not_share_a_range():
    import torch

    cases = [_request(TOKENS, mm=[("a", 5, 3), ("b", 8, 40), ("c", 48, 2), ("d", 80, 30)], salt="t"),
             _request(TOKENS, mm=[("a", 0, BS * 6 + 3)]),
             _request([0] * len(TOKENS), embeds=torch.randn(len(TOKENS), 4, generator=torch.Generator().manual_seed(2)))]
    for request in cases:
        assert _keys(request) == BlockKeys(BS, _vllm_extra(request)).upto(request.all_token_ids, 6)


def test_an_item_without_an_identifier_is_refused_not_keyed_as_none():
    request = _request(TOKENS, mm=[("x", 20, 8)])
    request.mm_features[0].identifier = None
    with pytest.raises(TypeError, match="no identifier"):
        _keys(request)  # the scheduler side skips such a request (unencodable_input)


def test_items_sharing_a_range_are_each_keyed_in_every_block():
    """Qwen2.5-Omni gives a video's audio the video's placeholder range; vLLM's walk keys the
    audio only in the block where both end, so a restore ending inside the range would not
    tell one audio track from another."""
    dub_a = _request(TOKENS, mm=[("video", 10, 60), ("audio-a", 10, 60)])
    dub_b = _request(TOKENS, mm=[("video", 10, 60), ("audio-b", 10, 60)])
    assert _keys(dub_a)[0] != _keys(dub_b)[0]
    assert BlockKeys(BS, _vllm_extra(dub_a)).upto(TOKENS, 1) == BlockKeys(BS, _vllm_extra(dub_b)).upto(TOKENS, 1)


_SUBPROCESS = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.connector.test_block_keys import TOKENS, _keys, _request
print(json.dumps(_keys(_request(TOKENS, salt="tenant-7", mm=[("img", 40, 24)]))))
"""


def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    here = _keys(_request(TOKENS, salt="tenant-7", mm=[("img", 40, 24)]))
    for seed in ("1", "random"):
        out = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(repo=str(REPO))], check=True,
                             capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED=seed))
        assert json.loads(out.stdout.strip().splitlines()[-1]) == here
