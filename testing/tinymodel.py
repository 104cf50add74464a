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
  ~0.9K. Positions up to 131,072 (RoPE: no weights), for restores of 64K-token prompts.
  Used by ``bench/restore_ttft.py`` (which records these figures in its JSON).

Hybrid models (``HybridSpec``, ``make_tiny_hybrid``): Mamba2 plus attention, NemotronH or
GraniteMoeHybrid, with transformers' own initialisation (and a long-memory variant whose
recurrent state decides the output). Three presets:
- ``TINY_HYBRID``: NemotronH, hidden 128, Mamba2 / attention / Mamba2 / MLP / Mamba2 /
  attention, long memory, fp32; used by the end-to-end hybrid tests;
- ``TINY_GRANITE_HYBRID``: GraniteMoeHybrid (dense), hidden 128, Mamba2 / attention x 2,
  long memory, fp32; the second architecture of those tests;
- ``BENCH_HYBRID``: NemotronH, hidden 1024, 4 Mamba2 (32 heads of 64, state 128, 8 groups)
  and 4 attention layers (16 query / 4 KV heads of 64), fp32: 8 KiB of KV per token, like
  ``BENCH``, plus 4.2 MiB of recurrent state per entry; used by ``bench/restore_ttft.py
  --model hybrid``.

``make_tiny_lora(model_dir, seed)`` writes a random PEFT-format LoRA adapter (rank 8 by
default, on q/k/v/o of every layer) for such a model, cached the same way; its ``lora_B`` is
far from zero (PEFT initialises it to zero), so adapters of different seeds change greedy
outputs visibly, and differently.

Usage: ``python -m testing.tinymodel [tiny|bench|hybrid|granite|bench-hybrid|deepseek-v3|gemma3|gpt-oss|mistral]`` prints the directory;
``python -m testing.tinymodel lora [SEED]`` prints a LoRA adapter's directory for ``TINY``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable


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
                      num_kv_heads=4, head_dim=64, vocab_size=1024, dtype="bfloat16",
                      max_position_embeddings=131072)  # RoPE: positions cost no weights

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


def trained_bpe(vocab_size: int, seed: int, special: list[str]):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on the generated corpus of ``seed``,
    ``special`` its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    return tok


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    tok = trained_bpe(spec.vocab_size, spec.seed, ["<unk>", "<s>", "</s>"])
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

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(_config(spec), indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        _train_tokenizer(spec, tmp)
        _write_weights(spec, tmp)

    return _build_once(base / f"llama-{spec.hidden_size}h{spec.num_layers}l-{spec.key()}",
                       json.dumps(asdict(spec)), write)


def _build_once(out: Path, description: str, write: Callable[[Path], None]) -> str:
    """``out`` as ``write`` fills it, built once: written into a temporary sibling, marked
    complete with ``description``, then renamed into place (a build cut short leaves no
    ``out``; racing builders, in other processes or threads, make identical ones and the first
    rename wins). Returns its path."""
    if (out / ".complete").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))  # one per builder, threads too
    write(tmp)
    (tmp / ".complete").write_text(description)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race; theirs is identical
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

    def write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return _build_once(out, json.dumps({"model_dir": str(model_dir), "seed": seed, "rank": rank}), write)


@dataclass(frozen=True)
class HybridSpec:
    """A hybrid model of ``arch`` (``HYBRID_ARCHS``: ``nemotron_h``, NemotronH; or
    ``granitemoehybrid``, GraniteMoeHybrid, dense), both Mamba2 plus attention; ``pattern``:
    ``M`` Mamba2, ``*`` attention, ``-`` MLP (NemotronH only), built with transformers' own
    ``from_config`` initialisation. ``long_memory`` slows the SSM decay
    (A = -0.05, dt = 0.05: a state keeps ~78% of what it held 100 tokens back), drops the
    skip path (D = 0) and widens the Mamba projections (in_proj std 0.1, conv std 0.5), so a
    Mamba layer's output is what its state remembers and a wrong or missing recurrent state
    changes greedy tokens; with stock initialisation the state barely matters (a zeroed
    state moved logprobs by ~3e-4 and no token)."""
    pattern: str = "M*M-M*"
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mamba_num_heads: int = 16
    mamba_head_dim: int = 16
    ssm_state_size: int = 16
    n_groups: int = 1
    chunk_size: int = 16
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    long_memory: bool = True
    seed: int = 0
    arch: str = "nemotron_h"

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True) + "|hybrid-v3"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


TINY_HYBRID = HybridSpec()
TINY_GRANITE_HYBRID = HybridSpec(pattern="M*M*", arch="granitemoehybrid")
BENCH_HYBRID = HybridSpec(pattern="M*M*M*M*", hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64,
                          mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                          chunk_size=64, vocab_size=1024, long_memory=False)


def _nemotron_h_config(spec: HybridSpec) -> Any:
    from transformers import NemotronHConfig

    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    return NemotronHConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size, num_hidden_layers=len(spec.pattern),
        hybrid_override_pattern=spec.pattern,
        layers_block_type=[kinds[c] for c in spec.pattern],
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, mamba_num_heads=spec.mamba_num_heads,
        mamba_head_dim=spec.mamba_head_dim, ssm_state_size=spec.ssm_state_size,
        n_groups=spec.n_groups, chunk_size=spec.chunk_size, expand=(
            spec.mamba_num_heads * spec.mamba_head_dim) // spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=spec.dtype)


def _granite_config(spec: HybridSpec) -> Any:
    from transformers import GraniteMoeHybridConfig

    kinds = {"M": "linear_attention", "*": "full_attention"}
    if set(spec.pattern) - set(kinds) or spec.hidden_size != spec.num_heads * spec.head_dim:
        raise ValueError(f"HybridSpec(arch='granitemoehybrid', pattern={spec.pattern!r}, hidden_size="
                         f"{spec.hidden_size}, num_heads={spec.num_heads}, head_dim={spec.head_dim}): "
                         "GraniteMoeHybrid has Mamba2 ('M') and attention ('*') layers only, each with "
                         "its own MLP, and head_dim = hidden_size / num_heads; fix the spec")
    return GraniteMoeHybridConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size, shared_intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=len(spec.pattern), layer_types=[kinds[c] for c in spec.pattern],
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        attention_multiplier=spec.head_dim ** -0.5,  # Granite's softmax scale, 1.0 by default
        num_local_experts=0, position_embedding_type="rope",
        mamba_n_heads=spec.mamba_num_heads, mamba_d_head=spec.mamba_head_dim,
        mamba_d_state=spec.ssm_state_size, mamba_n_groups=spec.n_groups,
        mamba_chunk_size=spec.chunk_size,
        mamba_expand=(spec.mamba_num_heads * spec.mamba_head_dim) // spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=spec.dtype)


HYBRID_ARCHS = {"nemotron_h": _nemotron_h_config, "granitemoehybrid": _granite_config}


def _hybrid_config(spec: HybridSpec) -> Any:
    if spec.arch not in HYBRID_ARCHS:
        raise ValueError(f"HybridSpec(arch={spec.arch!r}): not one of {sorted(HYBRID_ARCHS)}")
    return HYBRID_ARCHS[spec.arch](spec)


def make_tiny_hybrid(spec: HybridSpec = TINY_HYBRID, cache_dir: str | os.PathLike | None = None) -> str:
    """The model directory for a hybrid ``spec`` (built once, then reused). Returns its path."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _build_once(base / f"{spec.arch}-{spec.pattern.replace('*', 'A')}-{spec.key()}",
                       json.dumps(asdict(spec)), lambda tmp: _write_hybrid(spec, tmp))


def _write_hybrid(spec: HybridSpec, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(_hybrid_config(spec), torch_dtype=getattr(torch, spec.dtype))
    if spec.long_memory:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".A_log"):  # NemotronH's ``mixer.``, Granite's ``mamba.``
                    param.fill_(math.log(0.05))
                elif name.endswith(".dt_bias"):
                    param.fill_(math.log(math.expm1(0.05)))
                elif name.endswith(".D"):
                    param.zero_()  # no skip path: a Mamba layer's output is its state's
                elif name.endswith(".conv1d.weight"):
                    param.normal_(0.0, 0.5)  # at std 0.02 the state's inputs are ~1e-3 ...
                elif name.endswith(".in_proj.weight"):
                    param.normal_(0.0, 0.1)  # ... and its output falls below the norm's eps
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok_spec = TinyModelSpec(vocab_size=spec.vocab_size, seed=spec.seed,
                             max_position_embeddings=spec.max_position_embeddings)
    _train_tokenizer(tok_spec, tmp)


def make_tiny_field_model(name: str, seed: int = 0, initializer_range: float = 0.1,
                          cache_dir: str | os.PathLike | None = None) -> str:
    """A field recipe of ``testing.field_layouts`` (``deepseek-v3``: MLA; ``gemma3``,
    ``gpt-oss``, ``mistral``: sliding windows) with real random weights: the recipe's
    ``config.json``, the weights from transformers' own initialisation of that architecture after
    ``torch.manual_seed(seed)`` (normal with std ``initializer_range``, norms at one), saved as
    safetensors; the recipe's own directory has no weights (``load_format="dummy"``, whose tiny
    weights make greedy output insensitive to the KV cache). At transformers' default range
    (0.02) DeepSeek-V3's next-token distribution is near uniform and greedy output repeats one
    token; at 0.1 it varies and follows the context. Built once, then reused. Returns its path."""
    from testing.field_layouts import FIELD_MODELS

    config = {**FIELD_MODELS[name].hf_config, "initializer_range": initializer_range}
    text = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    key = hashlib.sha256((text + f"|{name}-v1").encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _build_once(base / f"{name}-{config['hidden_size']}h{config['num_hidden_layers']}l-{key}",
                       text, lambda tmp: _write_field_model(config, seed, tmp))


def _write_field_model(config: dict, seed: int, tmp: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                      if k not in ("architectures", "model_type", "torch_dtype")})
    hf.architectures = list(config["architectures"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, config["torch_dtype"]))
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _train_tokenizer(TinyModelSpec(vocab_size=config["vocab_size"], seed=seed,
                                   max_position_embeddings=config["max_position_embeddings"]), tmp)


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    if which == "lora":
        print(make_tiny_lora(make_tiny_model(TINY), int(sys.argv[2]) if len(sys.argv) > 2 else 1))
    elif which in ("deepseek-v3", "gemma3", "gpt-oss", "mistral"):
        print(make_tiny_field_model(which))
    elif which in ("hybrid", "granite", "bench-hybrid"):
        print(make_tiny_hybrid({"hybrid": TINY_HYBRID, "granite": TINY_GRANITE_HYBRID,
                                "bench-hybrid": BENCH_HYBRID}[which]))
    else:
        print(make_tiny_model({"tiny": TINY, "bench": BENCH}[which]))
