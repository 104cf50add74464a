"""``bench.replay_b_spread``: the share of mode namings whose ratios miss Report B's bounds, on
phases shaped as ``bench.replay_b_engine`` writes them."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.replay_b_engine import summarize
from bench.replay_b_spread import load_phases, main, paired, unpaired


def _phase(index: int, mode: str, decode: float, ttft: float = 0.14, gap: float = 0.025) -> dict:
    return {"index": index, "mode": mode, "decode_tok_s": decode, "ttft_s": ttft, "gap_p50_s": gap / 2,
            "gap_p99_s": gap,
            "passes_over_budget": 0, "evictions": 1, "at_cap_fraction": 0.7, "probes": 1,
            "probes_at_cap": 1, "probes_publication_pending": 1}


def _run(decodes: list[float]) -> list[dict]:
    """Cycles as the bench runs them: read-write first in even cycles, restore-only first in odd."""
    modes = []
    for cycle in range(len(decodes) // 2):
        modes += ["read-write", "restore-only"] if cycle % 2 == 0 else ["restore-only", "read-write"]
    return [_phase(i, m, d) for i, (m, d) in enumerate(zip(modes, decodes))]


def test_alike_phases_never_miss_and_a_slower_mode_misses_only_where_it_is_named_read_write():
    assert unpaired(_run([70.0] * 6)) == (True, 0, 20)
    assert paired(_run([70.0] * 6)) == (True, 0, 8)
    # read-write (phases 0, 3, 4) decodes 10% slower than restore-only in every cycle
    slow = _run([63.0, 70.0, 70.0, 63.0, 63.0, 70.0])
    met, misses, namings = unpaired(slow)
    assert not met and namings == 20
    assert 1 <= misses < namings  # namings that call the fast phases read-write meet the bounds
    p_met, p_misses, p_namings = paired(slow)
    assert not p_met and p_namings == 8 and 1 <= p_misses < p_namings


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(40, 90), min_size=6, max_size=6), st.lists(st.floats(0.1, 0.2), min_size=6, max_size=6),
       st.lists(st.floats(0.02, 0.04), min_size=6, max_size=6))
def test_the_runs_own_naming_gets_the_benchs_verdict(decodes, ttfts, gaps):
    phases = _run(decodes)
    for p, t, g in zip(phases, ttfts, gaps):
        p["ttft_s"], p["gap_p99_s"] = t, g
    targets = summarize(phases, argparse.Namespace())["targets"]
    bench_verdict = targets["decode_within_5pct"] and targets["ttft_within_5pct"] and \
        targets["decode_gap_p99_within_10pct"]
    assert unpaired(phases)[0] == bench_verdict
    # the namings are symmetric: the miss count does not depend on the order the phases ran in
    assert unpaired(phases)[1] == unpaired(phases[::-1])[1]


def test_what_is_not_a_run_is_named_with_the_fix(tmp_path, capsys):
    (tmp_path / "replay_b_engine.json").write_text(json.dumps({"phases": _run([70.0] * 6)}))
    assert main([str(tmp_path), "--out", str(tmp_path / "spread.json")]) == 0
    out = json.loads((tmp_path / "spread.json").read_text())
    assert out["summary"]["bench"]["null_miss_rate"] == 0 and out["summary"]["bench"]["runs_met"] == 1
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(SystemExit, match="other.json: not a bench.replay_b_engine output"):
        load_phases(other)
    other.write_text(json.dumps({"phases": _run([70.0] * 6)[:3]}))
    with pytest.raises(SystemExit, match="3 phases"):
        load_phases(other)
