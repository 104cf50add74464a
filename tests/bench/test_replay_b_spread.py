"""``bench.replay_b_spread``: the share of mode namings whose ratios miss Report B's bounds, on
phases shaped as ``bench.replay_b_engine`` writes them."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.replay_b_engine import summarize
from bench.replay_b_spread import load_phases, main, paired, pooled, t_quantile, unpaired


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


@pytest.mark.parametrize(("df", "quantile"), [(1, 12.706), (2, 4.303), (4, 2.776), (18, 2.101), (1000, 1.962)])
def test_the_t_quantile_is_students(df, quantile):
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-3)


def _with_decodes(rw: float, ro: float, cycles: int = 3) -> list[dict]:
    """A run whose read-write phases decode at ``rw`` and restore-only phases at ``ro``."""
    phases = _run([0.0] * (2 * cycles))
    for p in phases:
        p["decode_tok_s"] = rw if p["mode"] == "read-write" else ro
    return phases


def test_pooled_runs_judge_the_interval_not_one_run():
    # runs that differ only by the machine's spread: level on average, the interval inside every bound
    level = [_with_decodes(70.0, 71.0), _with_decodes(71.0, 70.0), _with_decodes(69.0, 69.5), _with_decodes(70.5, 70.0)]
    out = pooled(level)
    decode = out["ratios"]["decode_tok_s"]
    assert out["met"] and out["runs"] == 4 and out["cycles"] == 12
    assert 0.95 < decode["low"] < decode["ratio"] < decode["high"] < 1.05
    # read-write 10% slower in every cycle of every run: the interval sits at 0.9
    slow = pooled([_with_decodes(63.0, 70.0)] * 3)
    assert not slow["met"]
    assert slow["ratios"]["decode_tok_s"] == pytest.approx({"ratio": 0.9, "low": 0.9, "high": 0.9})
    # a bound met on the point estimate is not met when the interval's worse end crosses it
    wide = pooled([_with_decodes(70.0, 70.0), _with_decodes(64.0, 70.0)])
    assert wide["ratios"]["decode_tok_s"]["ratio"] > 0.95 > wide["ratios"]["decode_tok_s"]["low"]
    assert not wide["met"]
    with pytest.raises(ValueError, match="two runs at least"):
        pooled(level[:1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(40, 90), st.floats(40, 90)), min_size=2, max_size=6))
def test_the_pooled_interval_holds_its_estimate_and_swapping_the_modes_inverts_it(decodes):
    runs = [_with_decodes(rw, ro) for rw, ro in decodes]
    swapped = [_with_decodes(ro, rw) for rw, ro in decodes]
    a, b = pooled(runs)["ratios"]["decode_tok_s"], pooled(swapped)["ratios"]["decode_tok_s"]
    assert a["low"] <= a["ratio"] * (1 + 1e-12) and a["ratio"] <= a["high"] * (1 + 1e-12)
    assert a["ratio"] * b["ratio"] == pytest.approx(1.0)
    assert a["low"] * b["high"] == pytest.approx(1.0) and a["high"] * b["low"] == pytest.approx(1.0)


def test_two_runs_or_more_print_and_write_the_pooled_form(tmp_path, capsys):
    dirs = []
    for i, (rw, ro) in enumerate([(70.0, 70.2), (70.2, 70.0)]):
        (d := tmp_path / f"run{i}").mkdir()
        (d / "replay_b_engine.json").write_text(json.dumps({"phases": _with_decodes(rw, ro)}))
        dirs.append(str(d))
    assert main([*dirs, "--out", str(tmp_path / "spread.json")]) == 0
    assert "pooled over 2 runs (6 cycles)" in capsys.readouterr().out
    out = json.loads((tmp_path / "spread.json").read_text())["summary"]["pooled"]
    assert out["met"] and out["ratios"]["ttft_s"]["ratio"] == pytest.approx(1.0)
