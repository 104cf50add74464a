"""The data path's device check (``bench/gpu_copy.py``) runs its CPU part here: vLLM 0.32.0's own
KV cache views of every layout and kernel-block split, written as data
(``python -m testing.vllm_kv_caches``) and rebuilt by the check with torch alone, captured and
restored by ``kv_copy`` byte for byte; and its throughput part on a small 70B-shaped KV cache.
On a CUDA machine the same command runs parts A-C there (docs/RESULTS.md)."""

from __future__ import annotations

import json

from bench import gpu_copy
from testing.vllm_kv_caches import CASES, describe_all


def test_the_device_check_passes_on_cpu_with_vllms_own_views(tmp_path):
    views = tmp_path / "views.json"
    views.write_text(json.dumps(describe_all()))
    out = tmp_path / "gpu_copy.json"
    assert gpu_copy.main(["--views", str(views), "--out", str(out), "--device", "cpu", "--tokens", "512"]) == 0
    result = json.loads(out.read_text())
    cases = result["layouts"]
    assert len(cases) == 2 * len(CASES)
    assert {(c["layout"], c["ratio"]) for c in cases} == {(name, ratio) for name, ratio, _ in CASES}
    assert all(c["ok"] and c["blocks_compared"] >= 20 for c in cases), [c for c in cases if not c["ok"]]
    c = result["throughput"]
    assert c["bytes"] == 512 // 16 * 80 * 2 * 16 * 256 * 2
    assert c["capture_gb_per_s"] > 0 and c["place_gb_per_s"] > 0 and c["restore_gb_per_s"] > 0

