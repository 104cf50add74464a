"""The store identity of one rank: everything that changes the bytes of a stored page.

An entry is offered only under the identity it was published with (``Identity.digest``
names its manifest directory), so whatever is folded in here can never be mixed up:

- ``model``: the model as vLLM names it, its revision and dtype;
- ``weights``: ``weights_fingerprint`` of the weight files (or the operator's declared
  ``SPARKCACHE_WEIGHTS_FINGERPRINT`` when the weights are not local files);
- ``model_config``: quantization, ``hf_overrides``, load format, KV-cache dtype, draft model;
- ``kv_layout``: ``describe_kv_layout``; ``block_size``;
- ``parallel`` and ``tp_rank``: the settings that decide which heads, layers and tokens
  a rank holds;
- ``runtime_lock_hash``: ``installed_runtime`` (the vLLM actually imported);
- ``key_scheme``: ``keys.KEY_SCHEME``.

docs/CONNECTOR.md says what each covers and what an operator keeps stable for hits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from sparkcache.store import Identity

from .keys import KEY_SCHEME

logger = logging.getLogger("sparkcache.connector")

LOCK_RESOURCE = "vllm-0.32.0.lock.json"  # package data: the lock of the runtime we were built for
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
_NOT_WEIGHTS = ("tokenizer", "special_tokens_map", "vocab", "added_tokens", "merges",
                "chat_template", "generation_config")
_SMALL_FILE = 4 << 20   # hashed whole
_MAX_HEADER = 64 << 20  # a safetensors header larger than this is not trusted


class IdentityError(RuntimeError):
    """The identity cannot be computed; the message names the input and the fix."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


# ------------------------------------------------------------------------ weights

def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= n <= _MAX_HEADER:
            return head
        return head + f.read(n)


FileRecords = dict  # (path, dev, ino, size, mtime_ns, ctime_ns) -> record: contents hashed once


def _file_record(path: str, name: str, st: os.stat_result, cache: FileRecords | None) -> dict[str, Any]:
    key = (path, name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if cache is not None and key in cache:
        return cache[key]
    rec: dict[str, Any] = {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size <= _SMALL_FILE:
        with open(path, "rb") as f:
            rec["sha256"] = _sha256(f.read())
    elif name.endswith(".safetensors"):
        rec["header_sha256"] = _sha256(_safetensors_header(path))
    if cache is not None:
        cache[key] = rec
    return rec


def _covered(name: str) -> bool:
    lower = name.lower()
    if lower.startswith(_NOT_WEIGHTS):
        return False
    return lower.endswith(_WEIGHT_SUFFIXES) or lower.endswith(".json")


def directory_fingerprint(path: str, cache: FileRecords | None = None) -> str:
    """sha256 over every weight-bearing file of a model or adapter directory (its top level
    and one level below): name, size and modification time of each, the content of each
    file up to 4 MiB (config.json, the safetensors index, quantization configs) and the
    header of each larger safetensors file (tensor names, dtypes, shapes). Any write to a
    weight file changes its mtime, so weights rewritten in place give a new fingerprint;
    tokenizer files are left out (token ids, not text, are keyed). ``cache`` keeps each
    file's record while its stat (inode, size, mtime, ctime) stays the same."""
    records = []
    if os.path.isfile(path):  # a model directory is not ours: links (the HF cache's) are followed
        records.append(_file_record(path, os.path.basename(path), os.stat(path), cache))
    else:
        for dirpath, dirnames, filenames in os.walk(path):
            rel = os.path.relpath(dirpath, path)
            depth = 0 if rel == "." else rel.count(os.sep) + 1
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < 1 else []
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                relname = name if rel == "." else f"{rel}/{name}"
                if not _covered(name):
                    continue
                st = os.stat(full)
                if stat.S_ISREG(st.st_mode):
                    records.append(_file_record(full, relname, st, cache))
    if not any(r["name"].lower().endswith(_WEIGHT_SUFFIXES) for r in records):
        logger.warning("sparkcache: %s holds no weight files (%s); the store identity covers "
                       "only its config files. If the weights live elsewhere, declare "
                       "SPARKCACHE_WEIGHTS_FINGERPRINT", path, " ".join(_WEIGHT_SUFFIXES))
    return "sha256:" + _sha256(_canonical(records).encode())


def adapter_fingerprint(path: str, cache: FileRecords) -> str | None:
    """``directory_fingerprint`` of a LoRA adapter (local, or in the local Hugging Face
    cache), or None when it cannot be read: the request is then neither offered nor
    captured (an adapter we cannot tell apart from another must not share KV)."""
    local = _local_model_dir(path, None, None)
    try:
        return directory_fingerprint(local, cache) if local else None
    except (OSError, IdentityError):
        return None


def _local_model_dir(model: str, revision: str | None, download_dir: str | None) -> str | None:
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception:
        return None


def weights_fingerprint(model: str, revision: str | None, download_dir: str | None,
                        declared: str) -> str:
    """``declared:<value>`` when the operator declared one, else ``directory_fingerprint``
    of the local model directory (a Hugging Face id is looked up in the local cache)."""
    if declared:
        return "declared:" + declared
    local = _local_model_dir(model, revision, download_dir)
    if local is None:
        raise IdentityError(
            f"sparkcache: cannot fingerprint the weights of model {model!r}: it is neither a "
            "local path nor in the local Hugging Face cache. Fix: serve it from a local "
            "directory, or declare a fingerprint that changes whenever the weights do "
            "(SPARKCACHE_WEIGHTS_FINGERPRINT or kv_connector_extra_config "
            "'weights_fingerprint', e.g. the weights' commit or content hash)")
    try:
        return directory_fingerprint(local)
    except (OSError, IdentityError) as exc:
        raise IdentityError(f"sparkcache: cannot fingerprint the weights of model {model!r} "
                            f"at {local}: {exc}. Fix: make the files readable, or declare "
                            "SPARKCACHE_WEIGHTS_FINGERPRINT") from None


# ------------------------------------------------------------------------ runtime

def _lock_bytes() -> bytes:
    return resources.files("sparkcache").joinpath(LOCK_RESOURCE).read_bytes()


def installed_runtime(site_packages: Path | None = None) -> str:
    """The vLLM this process runs, by the lock sparkcache ships (package data):
    ``sha256:<lock>`` when every file the lock names is at its postimage (transformed),
    ``sha256:<lock>+pristine`` when every one is at its preimage, otherwise
    ``unlocked:vllm-<version>:sha256:<hash of those files>`` (another or a patched vLLM)."""
    raw = _lock_bytes()
    lock = json.loads(raw)
    lock_hash = "sha256:" + _sha256(raw)
    if site_packages is None:
        import vllm

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
    import vllm

    return f"unlocked:vllm-{vllm.__version__}:sha256:" + _sha256(_canonical(got).encode())


# ------------------------------------------------------------------------ layout, config

def describe_kv_layout(kv_cache_config: Any) -> tuple[str, bool]:
    """(layout string, whether every group is full attention the worker can copy).

    The string changes whenever page bytes would: spec type, heads, head size, dtype,
    block size, layer names per group, and vLLM's kv_cache_layout.
    """
    groups = []
    attention_only = True
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
            attention_only = False
        groups.append({
            "spec": kind, "layers": list(g.layer_names),
            "block_size": getattr(spec, "block_size", None),
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "dtype": str(getattr(spec, "dtype", getattr(spec, "dtypes", ""))),
            "shapes": str(getattr(spec, "shapes", "")),
        })
    layout = {"groups": groups, "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", ""))}
    return _canonical(layout), attention_only


def describe_model_config(vllm_config: Any) -> str:
    """Quantization, ``hf_overrides``, load format, KV-cache dtype and the speculative
    draft model (its layers' KV is stored too) as one hash. The model's config.json is in
    ``weights``; the config vLLM derives from it is not used: model code may change it in
    a worker process and not in the scheduler's."""
    mc, cc, lc = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    overrides = mc.hf_overrides
    if callable(overrides):
        overrides = f"callable:{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"
    spec = getattr(vllm_config, "speculative_config", None)
    draft = None if spec is None else {"method": spec.method, "model": spec.model,
                                       "revision": getattr(spec, "revision", None)}
    text = _canonical({
        "quantization": mc.quantization, "hf_overrides": overrides,
        "load_format": str(lc.load_format), "cache_dtype": str(cc.cache_dtype),
        "kv_cache_dtype_skip_layers": list(getattr(cc, "kv_cache_dtype_skip_layers", []) or []),
        "calculate_kv_scales": getattr(cc, "calculate_kv_scales", None), "draft": draft,
    })
    return "sha256:" + _sha256(text.encode())


def describe_parallel(vllm_config: Any, ranks: dict[str, int]) -> str:
    """The parallel settings that decide which heads, layers and tokens a rank holds, and
    this rank's place in each group (``ranks``: pp_rank, pcp_rank)."""
    pc = vllm_config.parallel_config
    sizes = {name: getattr(pc, name, None) for name in (
        "tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
        "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
        "cp_kv_cache_interleave_size")}
    return _canonical({**sizes, **ranks})


def make_identity(vllm_config: Any, kv_cache_config: Any, tp_rank: int, *,
                  ranks: dict[str, int] | None = None, declared_weights: str = "") -> tuple[Identity, bool]:
    mc = vllm_config.model_config
    layout, attention_only = describe_kv_layout(kv_cache_config)
    weights = weights_fingerprint(mc.model, getattr(mc, "revision", None),
                                  getattr(vllm_config.load_config, "download_dir", None),
                                  declared_weights)
    identity = Identity(
        model=f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}:{mc.dtype}",
        kv_layout=layout, block_size=int(vllm_config.cache_config.block_size),
        tp_rank=int(tp_rank), runtime_lock_hash=installed_runtime(), weights=weights,
        model_config=describe_model_config(vllm_config),
        parallel=describe_parallel(vllm_config, ranks or {"pp_rank": 0, "pcp_rank": 0}),
        key_scheme=KEY_SCHEME)
    return identity, attention_only
