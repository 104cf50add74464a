"""Random-weight Llama models made offline, with a byte-level BPE tokenizer trained locally.

Nothing is downloaded: the weights come from ``torch.manual_seed(seed)``; the tokenizer is
trained with ``tokenizers`` on a generated corpus. A model directory is cached under
``cache_dir`` (default ``<repo>/.cache/tinymodels``, or ``SPARKCACHE_TINYMODEL_CACHE``)
in a folder named by a hash of its parameters, so a second call returns at once.

Two presets:
- ``TINY``: hidden 128, 2 layers, 4 heads of 32 (the CPU attention backend needs head_dim >= 32);
  it recomputes faster than any disk read; used by the end-to-end tests.
- ``BENCH``: hidden 1024, 8 layers, 16 query heads / 4 KV heads of 64 (grouped KV), bf16:
  92M parameters, about 182 MFLOP per token (2 per weight) against 8 KiB of KV per token
  (1 KiB per layer), ~22K FLOP per KV byte (26K with attention at a 2,100-token prompt);
  real 1-8B models sit at ~75-120K, so restores win there by more; the tiny model is at
  ~0.9K. Used by ``bench/restore_ttft.py`` (which records these figures in its JSON).

``make_tiny_lora(model_dir, seed)`` writes a random PEFT-format LoRA adapter (rank 8 by
default, on q/k/v/o of every layer) for such a model, cached the same way; its ``lora_B`` is
far from zero (PEFT initialises it to zero), so adapters of different seeds change greedy
outputs visibly, and differently.

Usage: ``python -m sparkcache.tinymodel [tiny|bench]`` prints the directory;
``python -m sparkcache.tinymodel lora [SEED]`` prints a LoRA adapter's directory for ``TINY``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True) + "|v1"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


TINY = TinyModelSpec()
BENCH = TinyModelSpec(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                      num_kv_heads=4, head_dim=64, vocab_size=1024, dtype="bfloat16")

_WORDS = ("the cache store page block token prefix restore recompute model layer head value key "
          "query attention scheduler request engine turn agent conversation tool result image "
          "durable verified corrupt refuse publish lookup lease slot capture rank vector").split()


def default_cache_dir() -> Path:
    env = os.environ.get("SPARKCACHE_TINYMODEL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / ".cache" / "tinymodels"


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ":", ","]))
    return lines


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed=spec.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": spec.max_position_embeddings,
        "add_bos_token": False, "chat_template": chat_template,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def _config(spec: TinyModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": spec.dtype,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }


def _write_weights(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, i, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    tensors = {"model.embed_tokens.weight": rnd(spec.vocab_size, h, std=1.0),
               "model.norm.weight": torch.ones(h, dtype=dtype),
               "lm_head.weight": rnd(spec.vocab_size, h, std=0.2)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": rnd(q, h, std=0.1),
            p + "self_attn.k_proj.weight": rnd(kv, h, std=0.1),
            p + "self_attn.v_proj.weight": rnd(kv, h, std=0.1),
            p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(i, h),
            p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
        })
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def make_tiny_model(spec: TinyModelSpec = TINY, cache_dir: str | os.PathLike | None = None) -> str:
    """The model directory for ``spec`` (built once, then reused). Returns its path."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = base / f"llama-{spec.hidden_size}h{spec.num_layers}l-{spec.key()}"
    if (out / ".complete").exists():
        return str(out)
    tmp = base / f".tmp-{spec.key()}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(_config(spec), indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _train_tokenizer(spec, tmp)
    _write_weights(spec, tmp)
    (tmp / ".complete").write_text(json.dumps(asdict(spec)))
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_tiny_lora(model_dir: str, seed: int, rank: int = 8,
                   cache_dir: str | os.PathLike | None = None) -> str:
    """A random PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for
    the Llama in ``model_dir`` (sizes read from its ``config.json``), on ``q/k/v/o_proj`` of
    every layer, weights from ``torch.Generator().manual_seed(seed)``: ``lora_A`` ~ N(0, 1/in),
    ``lora_B`` ~ N(0, 0.5^2), alpha = 2 * rank. Built once, then reused. Returns its path."""
    import torch
    from safetensors.torch import save_file

    config_text = (Path(model_dir) / "config.json").read_text()
    cfg = json.loads(config_text)
    key = hashlib.sha256(json.dumps({"model_dir": str(model_dir), "config": config_text,
                                     "seed": seed, "rank": rank}, sort_keys=True).encode()
                         + b"|lora-v1").hexdigest()[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = base / f"lora-r{rank}-s{seed}-{key}"
    if (out / ".complete").exists():
        return str(out)
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}  # (in, out)
    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in _LORA_TARGETS:
            n_in, n_out = shapes[proj]
            p = f"base_model.model.model.layers.{layer}.self_attn.{proj}."
            tensors[p + "lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in ** 0.5).to(dtype)
            tensors[p + "lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.5).to(dtype)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(_LORA_TARGETS), "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }
    tmp = base / f".tmp-lora-{key}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / ".complete").write_text(json.dumps({"model_dir": str(model_dir), "seed": seed, "rank": rank}))
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    if which == "lora":
        print(make_tiny_lora(make_tiny_model(TINY), int(sys.argv[2]) if len(sys.argv) > 2 else 1))
    else:
        print(make_tiny_model({"tiny": TINY, "bench": BENCH}[which]))
