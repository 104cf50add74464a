"""``bench.prefill_hold`` end to end, briefly (in its own interpreter: it pins its thread and
notes the model's CPUs, as a worker does): every mode times its forwards, the publisher
publishes into a real store, and in the held mode it waited in its pace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import prefill_hold

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_times_every_mode_and_the_held_forward_held_the_publisher(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.prefill_hold", "--out", str(tmp_path), "--rounds", "2",
                    "--prompt-tokens", "64"], cwd=REPO, check=True, timeout=600)
    result = json.loads((tmp_path / "prefill_hold.json").read_text())
    assert all(len(result["seconds"][m]) == 2 for m in prefill_hold.MODES)
    assert result["publications"] >= 1 and result["held_s"] > 0
    assert (tmp_path / "prefill_hold.png").stat().st_size > 0
