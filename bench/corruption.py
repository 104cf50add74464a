"""What each connector does with damaged stored KV: vLLM's ExampleConnector, LMCache, sparkcache.

    python -m bench.corruption --out bench-out/corruption.json [--prompt-tokens 2048] [--check-tokens 8]

One prompt (random token ids) on the bench model (``testing.tinymodel.BENCH``), greedy. A
recompute life (no connector) gives the reference of a full prefill. Then per arm one life
stores the prompt's KV, and three fresh engines restore it, each from its own copy of that
stored root (the stored files are copied after the storing life ended, so one variant's
damage, or a connector's own repair of it, never reaches the next):

- ``clean``: the copy as stored (the arm's reference output after a restart);
- ``flip``: one byte of one stored KV file changed by one bit: the high byte (sign and
  exponent) of a bf16 value in the middle of that file's payload, away from any header, its
  exponent's top bit set (the first normal value from the middle on whose magnitude is below 1,
  so the flip multiplies it by 2^128 and it stays finite: a value that matters, not a
  rounding-sized change)
  (ExampleConnector: one layer's safetensors data section, after its JSON header; LMCache:
  one chunk file of its ``fs://`` backend, after its ``RemoteMetadata`` header; sparkcache:
  one page object under ``objects/``, all payload, never a manifest or the journal);
- ``random``: that whole payload overwritten with random bytes of the same length.

Per variant: the file and offset damaged, the external prefix-cache hit tokens and
``num_cached_tokens`` (did the arm load it), the greedy output and whether it equals the
arm's clean output and the recompute output, and for sparkcache the connector's own
refusal lines from the life's log (it checks each page against the XXH3-128 its manifest
records and, with ``kv_load_failure_policy="recompute"``, lets vLLM compute the prompt).
The lives are ``bench.restore_ttft``'s (``run_life``, ``_engine_life``); the lmcache arm is
that bench's too (bench/lmcache_arm.py: LMCache 0.5.6 with a torch copy in place of its
CUDA kernels).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.restore_ttft import LLAMA_SHAPE, REPO, run_life

ARMS = ("example", "lmcache", "sparkcache")
VARIANTS = ("clean", "flip", "random")
REFUSAL_MARKS = ("sparkcache: restore of", "sparkcache: removed the corrupt")


def payload_span(arm: str, path: Path, chunk_payload: int) -> tuple[int, int]:
    """(first byte, length) of the KV payload in one stored file of ``arm``."""
    size = path.stat().st_size
    if arm == "example":  # safetensors: u64 little-endian header length, JSON header, data
        with path.open("rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
    elif arm == "lmcache":  # RemoteMetadata, then one chunk's KV
        start = size - chunk_payload
        if not 0 < start <= 4096:
            raise RuntimeError(f"{path}: {size} bytes is no {chunk_payload}-byte LMCache chunk plus a header; "
                               "fix: check LMCACHE_CHUNK_SIZE against bench.lmcache_arm.CHUNK_TOKENS")
    else:  # a sparkcache page object is its bytes alone (named by their BLAKE3)
        start = 0
    if start % 2 or size - start < 2:
        raise RuntimeError(f"{path}: payload at {start} of {size} bytes is not bf16-aligned; fix: payload_span")
    return start, size - start


def stored_kv_file(arm: str, root: Path) -> Path:
    """The stored KV file the variants damage (sorted first, so every run picks the same)."""
    pattern = {"example": "**/*.safetensors", "lmcache": "**/*.data", "sparkcache": "**/objects/*/*"}[arm]
    files = sorted(p for p in root.glob(pattern) if p.is_file())
    if arm == "example":  # the first layer's file: its KV feeds every later layer
        files = [p for p in files if ".layers.0." in p.name] or files
    if not files:
        raise RuntimeError(f"no {pattern} under {root}: the {arm} storing life stored nothing; "
                           "fix: check its log (run_life raises with it when the life fails)")
    return files[0]


def damage(arm: str, root: Path, variant: str, chunk_payload: int, seed: int) -> dict:
    """Apply ``variant`` to the arm's stored KV file under ``root``; what was changed."""
    if variant == "clean":
        return {}
    path = stored_kv_file(arm, root)
    start, length = payload_span(arm, path, chunk_payload)
    data = bytearray(path.read_bytes())
    record = {"file": str(path.relative_to(root)), "file_bytes": len(data), "payload_start": start,
              "payload_bytes": length}
    if variant == "flip":
        offset = _small_value_high_byte(data, start + length // 4 * 2)
        before = int.from_bytes(data[offset - 1:offset + 1], "little")
        data[offset] ^= 0x40  # the exponent's top bit
        after = int.from_bytes(data[offset - 1:offset + 1], "little")
        record.update(offset=offset, bf16_before=_bf16(before), bf16_after=_bf16(after),
                      bits_before=f"{before:#06x}", bits_after=f"{after:#06x}")
    else:
        data[start:] = random.Random(seed).randbytes(length)
    path.write_bytes(bytes(data))
    return record


def _small_value_high_byte(data: bytearray, first: int) -> int:
    """The offset of the high byte of the first normal bf16 at or after ``first`` (even) with a
    magnitude below 1 (exponent field 1..126: setting its top bit keeps it finite)."""
    for offset in range(first + 1, len(data), 2):
        exponent = (data[offset] & 0x7F) << 1 | data[offset - 1] >> 7
        if 0 < exponent < 0x7F:
            return offset
    raise RuntimeError("no normal bf16 below 1 in the second half of the payload; fix: _small_value_high_byte")


def _bf16(bits: int) -> float:
    import struct

    return struct.unpack("<f", (bits << 16).to_bytes(4, "little"))[0]


def _life(base: dict, arm: str, root: Path, timeout: int) -> dict:
    life = run_life({**base, "arm": arm, "root": str(root)}, timeout)
    request = life["requests"][0]
    refusals = [line.strip()[-400:] for line in life["log"].splitlines()
                if any(mark in line for mark in REFUSAL_MARKS)]
    return {"output": request["check_tokens"], "num_cached_tokens": request["num_cached_tokens"],
            "external_hit_tokens": life["external_hit_tokens"], "refusals": refusals[:4]}


def run(args: argparse.Namespace) -> dict:
    from bench.lmcache_arm import CHUNK_TOKENS, ensure_installed
    from testing.tinymodel import BENCH, make_tiny_model

    ensure_installed()
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, BENCH.vocab_size) for _ in range(args.prompt_tokens)]
    kv_bytes_per_token = BENCH.num_layers * 2 * BENCH.num_kv_heads * BENCH.head_dim * 2  # bf16
    chunk_payload = CHUNK_TOKENS * kv_bytes_per_token
    max_model_len = max(4096, args.prompt_tokens + 64)
    base = {"model": make_tiny_model(BENCH), "dtype": BENCH.dtype, "prompts": [prompt], "warmup": None,
            "shape": asdict(LLAMA_SHAPE), "check_tokens": args.check_tokens, "max_model_len": max_model_len,
            "cold": False, "warm": False, "repeat_local": False,
            "kv_cache_bytes": max(1 << 30, 2 * max_model_len * kv_bytes_per_token)}
    work = Path(tempfile.mkdtemp(prefix="corruption-", dir=args.work_dir))
    try:
        recompute = _life(base, "recompute", work / "recompute", args.life_timeout)["output"]
        print(f"[recompute] output {recompute}", flush=True)
        arms = {arm: run_arm(arm, base, work, recompute, chunk_payload, args) for arm in ARMS}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"bench": "corruption", "prompt_tokens": args.prompt_tokens, "check_tokens": args.check_tokens,
            "model": "testing.tinymodel.BENCH", "recompute_output": recompute, "arms": arms,
            "lmcache": "LMCache 0.5.6, fs:// backend, with bench/lmcache_arm.py's torch copy (no CUDA kernels)"}


def run_arm(arm: str, base: dict, work: Path, recompute: list[int], chunk_payload: int,
            args: argparse.Namespace) -> dict:
    stored = work / arm / "stored"
    store = _life(base, arm, stored, args.life_timeout)
    result = {"storing_life_output": store["output"], "variants": {}}
    for variant in VARIANTS:
        root = work / arm / variant
        shutil.copytree(stored, root, symlinks=True)
        damaged = damage(arm, root, variant, chunk_payload, args.seed)
        life = _life(base, arm, root, args.life_timeout)
        clean = life["output"] if variant == "clean" else result["variants"]["clean"]["output"]
        result["variants"][variant] = {**life, "damaged": damaged, "equals_clean": life["output"] == clean,
                                       "equals_recompute": life["output"] == recompute}
        print(f"[{arm}] {variant}: external hits {life['external_hit_tokens']:.0f}, cached "
              f"{life['num_cached_tokens']}, output {life['output']}"
              + (f", refusals {life['refusals'][:1]}" if life["refusals"] else ""), flush=True)
    return result


def table(result: dict) -> str:
    lines = [(f"{result['prompt_tokens']}-token prompt, {result['check_tokens']} greedy tokens; recompute output "
              f"{result['recompute_output']}"),
             f"{'arm':<12}{'variant':<9}{'ext hits':>9}{'cached':>8}{'= clean':>9}{'= recompute':>13}  refused"]
    for arm, r in result["arms"].items():
        for variant, v in r["variants"].items():
            lines.append(f"{arm:<12}{variant:<9}{v['external_hit_tokens']:>9.0f}{v['num_cached_tokens']:>8}"
                         f"{v['equals_clean']!s:>9}{v['equals_recompute']!s:>13}  "
                         f"{'yes' if v['refusals'] else 'no'}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.corruption", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--out", type=Path, default=REPO / "bench-out" / "corruption.json")
    a("--prompt-tokens", type=int, default=2048, help="prompt size in tokens (default 2048)")
    a("--check-tokens", type=int, default=8, help="greedy output tokens compared (default 8)")
    a("--seed", type=int, default=0)
    a("--life-timeout", type=int, default=900, help="seconds one engine life may take (default 900)")
    a("--work-dir", default=None, help="where the stores live (default: the system temp dir)")
    a("--keep", action="store_true", help="keep the stores after the run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 512 <= args.prompt_tokens <= 8192:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: pick 512..8192 (LMCache needs whole "
                         "256-token chunks; the bench model's context bounds the top)")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
