"""The store identity of one rank: everything that changes the bytes of a stored page.

An entry is offered only under the identity it was published with (``Identity.digest``
names its manifest directory), so whatever is folded in here can never be mixed up:

- ``model``: the model as vLLM names it, its revision and dtype;
- ``weights``: ``weights_fingerprint`` of the weight files (or the operator's declared
  ``SPARKCACHE_WEIGHTS_FINGERPRINT`` when the weights are not local files);
- ``model_config``: ``describe_model_config`` (quantization, ``hf_overrides``, KV-cache
  dtype, load format, draft model, ...);
- ``kv_layout``: ``kv_layout.describe_kv_layout``; ``block_size``;
- ``parallel`` and ``tp_rank``: the settings that decide which heads, layers and tokens
  a rank holds;
- ``runtime_lock_hash``: ``installed_runtime`` (the vLLM actually imported);
- ``key_scheme``: ``keys.KEY_SCHEME``.

docs/CONNECTOR.md says what each covers and what an operator keeps stable for hits.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import stat
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from sparkcache.store import Identity

from .keys import KEY_SCHEME
from .kv_layout import KVLayout, describe_kv_layout

if TYPE_CHECKING:  # vLLM's types, for readers and type checkers; never imported at run time here
    from vllm.config import ModelConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.kv_cache_interface import KVCacheConfig

LOCK_RESOURCE = "vllm-0.32.0.lock.json"  # package data: the lock of the runtime we were built for
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5",
                    ".tensors")
_NOT_WEIGHTS = ("tokenizer", "special_tokens_map", "vocab", "added_tokens", "merges",
                "chat_template", "generation_config")
_STREAMED_FORMATS = ("runai_streamer", "runai_streamer_sharded", "tensorizer")
_SMALL_FILE = 4 << 20   # hashed whole
_MAX_HEADER = 64 << 20  # a safetensors header larger than this is not trusted
_MAX_CACHED_FILES = 4096


class IdentityError(RuntimeError):
    """The identity cannot be computed; the message names the input and the fix."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: object) -> str:
    """Strict JSON: a value without a stable text form is a TypeError, never its repr
    (an address would differ between the scheduler's process and a worker's)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


# ------------------------------------------------------------------------ weights

def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= _MAX_HEADER:
            return head
        return head + f.read(n)


# A weight file's record: name, size, mtime_ns and sha256 (or header_sha256).
FileRecord = dict[str, str | int]
# (path, dev, inode, size, mtime_ns, ctime_ns) -> record: each file's contents hashed once
FileRecords = dict[tuple[str, int, int, int, int, int], FileRecord]


def _file_record(path: str, name: str, st: os.stat_result, cache: FileRecords | None) -> FileRecord:
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if cache is not None and key in cache:
        return {**cache[key], "name": name}
    rec: FileRecord = {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size <= _SMALL_FILE:
        with open(path, "rb") as f:
            rec["sha256"] = _sha256(f.read())
    elif name.endswith(".safetensors"):
        rec["header_sha256"] = _sha256(_safetensors_header(path))
    if cache is not None:
        if len(cache) >= _MAX_CACHED_FILES:
            cache.clear()
        cache[key] = rec
    return rec


def _covered(name: str) -> bool:
    lower = name.lower()
    if lower.startswith(_NOT_WEIGHTS):
        return False
    return lower.endswith(_WEIGHT_SUFFIXES) or lower.endswith((".json", ".py"))


def _raise(exc: OSError) -> None:
    raise exc


def directory_fingerprint(path: str, cache: FileRecords | None = None, *,
                          require_weights: bool = True) -> str:
    """sha256 over every file of a model or adapter directory (its top level and one level
    below) that can change the KV it computes: weight files (``_WEIGHT_SUFFIXES``), JSON
    files (config, safetensors index, quantization configs) and Python files (remote code),
    not tokenizer files (token ids, not text, are keyed). Per file: name, size and
    modification time; the content of files up to 4 MiB; the header of larger safetensors
    files (tensor names, dtypes, shapes). Any write to a weight file changes its mtime, so
    weights rewritten in place give a new fingerprint. ``cache`` keeps each file's record
    while its stat (inode, size, mtime, ctime) stays the same. IdentityError when the
    directory holds no weight file (and ``require_weights``); OSError when it cannot be read."""
    records = []
    if os.path.isfile(path):  # a model directory is not ours: links (the HF cache's) are followed
        records.append(_file_record(path, os.path.basename(path), os.stat(path), cache))
    else:
        for dirpath, dirnames, filenames in os.walk(path, onerror=_raise):
            rel = os.path.relpath(dirpath, path)
            top = rel == "."
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if top else []
            for name in sorted(filenames):
                if not _covered(name):
                    continue
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                if stat.S_ISREG(st.st_mode):
                    records.append(_file_record(full, name if top else f"{rel}/{name}", st, cache))
    if require_weights and not any(r["name"].lower().endswith(_WEIGHT_SUFFIXES) for r in records):
        raise IdentityError(f"{path} holds no weight file ({' '.join(_WEIGHT_SUFFIXES)})")
    return "sha256:" + _sha256(_canonical(records).encode())


def _local_model_dir(model: str, revision: str | None, download_dir: str | None) -> str | None:
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception:
        return None


class AdapterFingerprints:
    """The fingerprint of the LoRA adapter files a worker runs, per ``lora_int_id``.

    vLLM's workers load an adapter once per id and keep it (unless the request sets
    ``load_inplace``), so the first fingerprint seen for an id is pinned for the life of
    the process. When the files at its path change afterwards (or the id comes with
    another path), which version a worker computes with is unknown: such requests are
    neither offered nor captured (``lora_changed``). ``check`` returns (fingerprint,
    None) or (None, reason)."""

    def __init__(self) -> None:
        self._pinned: dict[int, tuple[str, str]] = {}
        self._files: FileRecords = {}

    def check(self, lora: LoRARequest) -> tuple[str | None, str | None]:
        path = os.fspath(lora.lora_path)
        local = _local_model_dir(path, None, None)
        try:
            fp = directory_fingerprint(local, self._files) if local else None
        except (OSError, IdentityError):
            fp = None
        if fp is None:
            return None, "lora_unreadable"
        pinned = self._pinned.get(lora.lora_int_id)
        if pinned is None or getattr(lora, "load_inplace", False):
            self._pinned[lora.lora_int_id] = (path, fp)
        elif pinned != (path, fp):
            return None, "lora_changed"
        return fp, None


def weights_fingerprint(vllm_config: VllmConfig, declared: str) -> str:
    """``declared:<value>`` when the operator declared one; ``dummy:`` and the config files
    for vLLM's dummy weights (fixed seed); else ``directory_fingerprint`` of the local model
    directory (a Hugging Face id is looked up in the local cache). Weights that are not
    local files (streamed, tensorizer, ``model_weights``) need a declared fingerprint."""
    mc, lc = vllm_config.model_config, vllm_config.load_config
    if declared:
        return "declared:" + declared
    fix = ("Fix: serve the weights from a local directory, or declare a fingerprint that "
           "changes whenever the weights do (SPARKCACHE_WEIGHTS_FINGERPRINT or "
           "kv_connector_extra_config 'weights_fingerprint', e.g. their commit or content hash)")
    load_format = str(lc.load_format)
    if getattr(mc, "model_weights", "") or load_format in _STREAMED_FORMATS:
        raise IdentityError(f"sparkcache: the weights of model {mc.model!r} are not local files "
                            f"(load_format {load_format!r}, model_weights "
                            f"{getattr(mc, 'model_weights', '')!r}). {fix}")
    local = _local_model_dir(mc.model, getattr(mc, "revision", None), getattr(lc, "download_dir", None))
    if local is None:
        raise IdentityError(f"sparkcache: cannot fingerprint the weights of model {mc.model!r}: "
                            f"it is neither a local path nor in the local Hugging Face cache. {fix}")
    dummy = load_format == "dummy"
    try:
        return ("dummy:" if dummy else "") + directory_fingerprint(local, require_weights=not dummy)
    except (OSError, IdentityError) as exc:
        raise IdentityError(f"sparkcache: cannot fingerprint the weights of model {mc.model!r} "
                            f"at {local}: {exc}. {fix}") from None


# ------------------------------------------------------------------------ runtime

def _lock_bytes() -> bytes:
    try:
        return resources.files("sparkcache").joinpath(LOCK_RESOURCE).read_bytes()
    except OSError as exc:
        raise IdentityError(f"sparkcache: the package has no {LOCK_RESOURCE} ({exc}); fix: "
                            "reinstall sparkcache from a wheel or checkout that ships it") from None


def installed_runtime(site_packages: Path | None = None) -> str:
    """The vLLM this process runs, by the lock sparkcache ships (package data):
    ``sha256:<lock>`` when every file the lock names is at its postimage (transformed),
    ``sha256:<lock>+pristine`` when every one is at its preimage, otherwise
    ``unlocked:vllm-<version>:sha256:<hash of those files>`` (another or a patched vLLM)."""
    import vllm

    raw = _lock_bytes()
    lock = json.loads(raw)
    lock_hash = "sha256:" + _sha256(raw)
    if site_packages is None:
        site_packages = Path(vllm.__file__).resolve().parents[1]
    got = {}
    for f in lock["files"]:
        try:
            got[f["path"]] = _sha256((site_packages / f["path"]).read_bytes())
        except OSError:
            got[f["path"]] = "absent"
    if all(got[f["path"]] == f["postimage_sha256"] for f in lock["files"]):
        return lock_hash
    if all(got[f["path"]] == f["preimage_sha256"] for f in lock["files"]):
        return lock_hash + "+pristine"
    return f"unlocked:vllm-{vllm.__version__}:sha256:" + _sha256(_canonical(got).encode())


# ------------------------------------------------------------------------ layout, config

def _jsonable(value: object, what: str) -> object:
    """``value`` as plain JSON data (dataclasses and pydantic models by their fields), or
    IdentityError naming the setting: never a repr, which differs between processes."""
    if isinstance(value, enum.Enum):
        value = value.value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif callable(value):
        value = f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    try:
        return json.loads(_canonical(value))
    except (TypeError, ValueError) as exc:
        raise IdentityError(f"sparkcache: {what}={value!r} has no stable text form for the store "
                            f"identity ({exc}); fix: use plain JSON values (strings, numbers, "
                            "lists, string-keyed dicts)") from None


def _long_rope(mc: ModelConfig) -> bool | None:
    """Whether LongRoPE models use their long factors, which vLLM decides for every
    position by max_model_len (``phi3_long_rope_scaled_rope.py``); None for other models."""
    cfg = mc.hf_text_config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(
        cfg, "original_max_position_embeddings", None)
    return original is not None and mc.max_model_len > original


def describe_model_config(vllm_config: VllmConfig) -> str:
    """Every model setting that changes KV bytes beside the weight files, as one hash:
    quantization (method and online config), ``hf_overrides``, model implementation and
    class overrides, config source and code revision, load format and loader config, KV-cache
    dtype, LongRoPE's choice of factors, the speculative draft (its layers' KV is stored
    too), and a multimodal model's server-wide encoder settings (``_multimodal_settings``).
    The model's config.json is in ``weights``; the config vLLM derives from it is not used:
    model code may change it in a worker process and not in the scheduler's."""
    mc, cc, lc = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    spec = getattr(vllm_config, "speculative_config", None)
    draft = None
    if spec is not None:
        draft = {"method": spec.method, "model": spec.model, "revision": getattr(spec, "revision", None),
                 "weights": (directory_fingerprint(spec.model, require_weights=False)
                             if spec.model and os.path.isdir(spec.model) else None)}
    settings = {
        "quantization": mc.quantization, "quantization_config": getattr(mc, "quantization_config", None),
        "hf_overrides": mc.hf_overrides, "model_impl": getattr(mc, "model_impl", None),
        "model_class_overrides": getattr(mc, "model_class_overrides", None),
        "hf_config_path": getattr(mc, "hf_config_path", None),
        "config_format": getattr(mc, "config_format", None),
        "code_revision": getattr(mc, "code_revision", None), "long_rope": _long_rope(mc),
        "load_format": lc.load_format, "model_loader_extra_config": getattr(lc, "model_loader_extra_config", None),
        "cache_dtype": cc.cache_dtype,
        "kv_cache_dtype_skip_layers": list(getattr(cc, "kv_cache_dtype_skip_layers", []) or []),
        "calculate_kv_scales": getattr(cc, "calculate_kv_scales", None), "draft": draft,
    }
    multimodal = _multimodal_settings(getattr(mc, "multimodal_config", None))
    if multimodal is not None:  # only multimodal models' identities carry it
        settings["multimodal"] = multimodal
    text = _canonical({k: _jsonable(v, k) for k, v in settings.items()})
    return "sha256:" + _sha256(text.encode())


def _multimodal_settings(mm) -> dict | None:
    """A multimodal model's server-wide settings that change what its encoder makes of an
    image, and so the KV after it, while vLLM's image identifier stays the same (it hashes
    the image and the request's own processor arguments, not the server's): the processor
    and media arguments, the device normalisation, video pruning, and the encoder's fp8
    attention with its scale file's bytes. None for a model without images."""
    if mm is None:
        return None
    scales = getattr(mm, "mm_encoder_fp8_scale_path", None)
    scale_bytes = None
    if scales:
        try:
            with open(scales, "rb") as f:
                scale_bytes = "sha256:" + _sha256(f.read())
        except OSError as exc:
            raise IdentityError(f"mm_encoder_fp8_scale_path={scales!r} cannot be read ({exc}): the store "
                                "identity covers the encoder's fp8 scales; fix the path or unset it") from None
    return {"mm_processor_kwargs": getattr(mm, "mm_processor_kwargs", None),
            "media_io_kwargs": getattr(mm, "media_io_kwargs", None),
            "mm_device_do_normalize": getattr(mm, "mm_device_do_normalize", None),
            "video_pruning_rate": getattr(mm, "video_pruning_rate", None),
            "video_pruning_method": getattr(mm, "video_pruning_method", None),
            "mm_encoder_attn_dtype": getattr(mm, "mm_encoder_attn_dtype", None),
            "mm_encoder_fp8_scales": scale_bytes}


def describe_parallel(vllm_config: VllmConfig, ranks: dict[str, int]) -> str:
    """The parallel settings that decide which heads, layers and tokens a rank holds, and
    this rank's place in each group (``ranks``: pp_rank, pcp_rank)."""
    pc = vllm_config.parallel_config
    sizes = {name: getattr(pc, name, None) for name in (
        "tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
        "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
        "cp_kv_cache_interleave_size")}
    return _canonical({**sizes, **ranks})


def make_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tp_rank: int, *,
                  ranks: dict[str, int] | None = None, declared_weights: str = "") -> tuple[Identity, KVLayout]:
    mc = vllm_config.model_config
    drafter = vllm_config.speculative_config
    layout = describe_kv_layout(kv_cache_config, int(vllm_config.cache_config.block_size),
                                drafter.method if drafter is not None else None,
                                vllm_config.num_prefill_lookahead_tokens)
    weights = weights_fingerprint(vllm_config, declared_weights)
    identity = Identity(
        model=f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}:{mc.dtype}",
        kv_layout=layout.description, block_size=int(vllm_config.cache_config.block_size),
        tp_rank=int(tp_rank), runtime_lock_hash=installed_runtime(), weights=weights,
        model_config=describe_model_config(vllm_config),
        parallel=describe_parallel(vllm_config, ranks or {"pp_rank": 0, "pcp_rank": 0}),
        key_scheme=KEY_SCHEME)
    return identity, layout


def shard_identities(vllm_config: VllmConfig, identity: Identity) -> tuple[Identity, ...]:
    """The identity of every rank's shard of one entry, rank 0's (``identity``, as the
    scheduler makes it) first: one per tensor-parallel rank, as each worker makes its own
    (``make_identity`` with its rank). Other parallel layouts are refused at startup
    (``connector._refuse_unsupported_parallel``)."""
    size = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
    return tuple(dataclasses.replace(identity, tp_rank=tp) for tp in range(size))
