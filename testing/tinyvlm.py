"""Random-weight vision-language models made offline: a tiny Qwen2-VL (attention, M-RoPE)
and a tiny Qwen3.5 (GatedDeltaNet hybrid plus vision), each with a locally trained BPE
tokenizer that has Qwen's vision tokens, and Qwen's own processor saved with
``save_pretrained``; random test images.

Nothing is downloaded. A model directory is built once under ``.cache/tinymodels`` (as
``testing.tinymodel`` does). Building and running need ``import torchvision`` (transformers'
Qwen processors and vLLM's Qwen modules import it): ``testing.torchvision_shim``.

- ``TINY_QWEN2_VL``: text hidden 128, 2 layers, 4 query / 2 KV heads of 32, M-RoPE sections
  (4, 6, 6); vision depth 1, embed 64, patch 14, merge 2; fp32. A 64x64 image is 4
  placeholder tokens, a 112x112 one 16.
- ``TINY_QWEN3_5``: text hidden 128, layers GatedDeltaNet / attention, GDN head dim 128 (the
  kernels' smallest), bf16; the same vision tower.

Weights: transformers' own initialisation at ``initializer_range`` 0.1 (at 0.02 greedy
output barely follows the context), so the output depends on the prompt and the image; the
GatedDeltaNet layers decay slowly (A = 0.05, dt = 0.05 per token, as ``testing.tinymodel``'s
long-memory Mamba), so their recurrent state carries the context.

Usage: ``python -m testing.tinyvlm [qwen2-vl|qwen3.5]`` prints the directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from testing.tinymodel import _build_once, default_cache_dir, trained_bpe

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen2-VL's chat template, reduced to what the tests send (text and images, in order).
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass(frozen=True)
class VlmSpec:
    arch: str = "qwen2_vl"          # or "qwen3_5"
    hidden_size: int = 128
    num_layers: int = 2
    layer_types: tuple[str, ...] = ()  # qwen3_5: "linear_attention" / "full_attention"
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    vision_depth: int = 1
    vision_embed: int = 64
    dtype: str = "float32"
    initializer_range: float = 0.1
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True) + "|vlm-v3"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


TINY_QWEN2_VL = VlmSpec()
TINY_QWEN3_5 = VlmSpec(arch="qwen3_5", layer_types=("linear_attention", "full_attention"),
                       num_kv_heads=2, dtype="bfloat16")


def _tokenizer(spec: VlmSpec, out: Path):
    """A byte-level BPE with Qwen's chat and vision tokens as special tokens (ids 0-6), saved
    with the chat template; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = trained_bpe(spec.vocab_size, spec.seed, list(CHAT_TOKENS + VISION_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=8192, chat_template=_CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    return fast


def _token_ids(tok) -> dict[str, int]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in CHAT_TOKENS + VISION_TOKENS}
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"],
            "pad_token_id": ids["<|endoftext|>"]}


def _config(spec: VlmSpec, ids: dict[str, int]):
    text = {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "intermediate_size": 2 * spec.hidden_size, "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "max_position_embeddings": 131072,  # RoPE: no weights "rms_norm_eps": 1e-6,
            "initializer_range": spec.initializer_range, "tie_word_embeddings": False,
            "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
            "pad_token_id": ids["pad_token_id"]}
    special = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id")}
    if spec.arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
        vision = {"depth": spec.vision_depth, "embed_dim": spec.vision_embed, "hidden_size": spec.hidden_size,
                  "num_heads": 2, "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "initializer_range": spec.initializer_range}
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    if spec.arch == "qwen3_5":
        from transformers import Qwen3_5Config

        text.update({"layer_types": list(spec.layer_types), "linear_num_key_heads": 2,
                     "linear_num_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                     "linear_conv_kernel_dim": 4, "full_attention_interval": len(spec.layer_types),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [4, 6, 6], "mrope_interleaved": True,
                                         "partial_rotary_factor": 1.0}})
        vision = {"depth": spec.vision_depth, "hidden_size": spec.vision_embed, "out_hidden_size": spec.hidden_size,
                  "num_heads": 2, "intermediate_size": 2 * spec.vision_embed, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                  "initializer_range": spec.initializer_range}
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    raise ValueError(f"VlmSpec(arch={spec.arch!r}): not 'qwen2_vl' or 'qwen3_5'")


def _write(spec: VlmSpec, out: Path) -> None:
    import torch
    from transformers import (AutoModelForImageTextToText, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    tok = _tokenizer(spec, out)
    ids = _token_ids(tok)
    config = _config(spec, ids)
    config.architectures = [{"qwen2_vl": "Qwen2VLForConditionalGeneration",
                             "qwen3_5": "Qwen3_5ForConditionalGeneration"}[spec.arch]]
    torch.manual_seed(spec.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, spec.dtype))
    with torch.no_grad():  # GatedDeltaNet: a slow decay, so its state carries the context
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.fill_(math.log(0.05))
            elif name.endswith("linear_attn.dt_bias"):
                param.fill_(math.log(math.expm1(0.05)))
    model.save_pretrained(str(out), safe_serialization=True)
    images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14,
                                   merge_size=2, temporal_patch_size=2)
    Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                     chat_template=_CHAT_TEMPLATE).save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}))


def make_tiny_vlm(spec: VlmSpec = TINY_QWEN2_VL, cache_dir: str | os.PathLike | None = None) -> str:
    """The model directory for ``spec`` (built once, then reused). Returns its path. Built in a
    fresh interpreter whose transformers sees torchvision from the start (in a process that
    imported transformers before the shim, its Qwen processors stay unavailable)."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _build_once(base / f"{spec.arch}-{spec.hidden_size}h{spec.num_layers}l-{spec.key()}",
                       json.dumps(asdict(spec)), lambda tmp: _write_in_fresh_process(spec, tmp))


def _write_in_fresh_process(spec: VlmSpec, tmp: Path) -> None:
    import subprocess

    from testing.torchvision_shim import REPO, site_dir

    code = ("import json, sys; from pathlib import Path; from testing.tinyvlm import VlmSpec, _write; "
            "d = json.loads(sys.argv[1]); d['layer_types'] = tuple(d['layer_types']); "
            "_write(VlmSpec(**d), Path(sys.argv[2]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site_dir()), str(REPO),
                                                                   os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(spec)), str(tmp)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny {spec.arch} failed:\n{done.stderr[-4000:]}")


def write_image(path: str | os.PathLike, seed: int, size: int = 64) -> str:
    """A ``size`` x ``size`` RGB PNG of random pixels from ``seed`` at ``path``; returns it."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)).save(path, format="PNG")
    return str(path)


def user_turn(model_dir: str, text: str, images: int = 0, first: bool = False) -> list[int]:
    """The token ids of one user turn of a chat (the previous answer's end first, unless
    ``first``), with ``images`` image placeholders before the text, ending with the assistant's
    prompt: what Qwen's chat template makes of it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = ("" if first else "<|im_end|>\n") + "<|im_start|>user\n" + IMAGE_PLACEHOLDER * images
    return tok.encode(body + text + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "qwen2-vl"
    print(make_tiny_vlm({"qwen2-vl": TINY_QWEN2_VL, "qwen3.5": TINY_QWEN3_5}[which]))
