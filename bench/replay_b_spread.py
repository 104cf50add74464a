"""How often Report B's verdict fails where the access mode makes no difference at all.

    python -m bench.replay_b_spread RUN [RUN ...] [--out FILE.json]

Each RUN is a ``bench.replay_b_engine`` output (its directory or its ``replay_b_engine.json``).
A permutation test over each run's own phases: if read-write and restore-only served alike,
which phase carried which mode would not matter, so every way of naming as many of the run's
phases read-write as it had is as likely as the one the bench ran. The share of those namings
whose ratios miss a bound (``bench.replay_b_engine.ratio_targets``: decode and TTFT within 5%,
decode-gap p99 within 10%) is how often the verdict fails from the machine's spread alone;
(1 - that share)^3 is the chance of three runs in a row meeting it.

The same for a paired form of the comparison (not the bench's verdict; shown for whoever
sets the bounds): each cycle's read-write phase over the restore-only phase next to it, the
median of those ratios, under every swap of the two within a cycle.

With two runs or more, every run's cycles pooled: for each figure the geometric mean of each
cycle's read-write over restore-only ratio, with its confidence interval (Student's t over the
runs, each run's mean log ratio one observation: a run's cycles share its stretch of the machine),
and each bound applied to the interval's worse end (decode's lower end, TTFT's and the
decode-gap p99's upper ends): where those hold, the modes differ by less than the bounds
at that confidence, whatever one run's verdict did.

Writes nothing but ``--out`` (JSON); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from bench.replay_b_engine import MODES, RATIO_KEYS, mode_ratios, ratio_targets

READ_WRITE, RESTORE_ONLY = MODES


def load_phases(path: Path) -> list[dict]:
    file = path / "replay_b_engine.json" if path.is_dir() else path
    try:
        phases = json.loads(file.read_text())["phases"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{file}: not a bench.replay_b_engine output ({exc}); give its --out directory "
                         "or the replay_b_engine.json in it") from None
    if len(phases) < 2 or len(phases) % 2 or {p["mode"] for p in phases} != set(MODES):
        raise SystemExit(f"{file}: {len(phases)} phases; a run has one read-write and one restore-only "
                         "phase per cycle")
    return phases


def met(ratios: dict[str, float]) -> bool:
    return all(ratio_targets(ratios).values())


def unpaired(phases: list[dict]) -> tuple[bool, int, int]:
    """(the run's verdict on the probe's bounds, namings that miss one, namings)."""
    n_rw = sum(p["mode"] == READ_WRITE for p in phases)
    misses = total = 0
    for chosen in itertools.combinations(range(len(phases)), n_rw):
        rw = [phases[i] for i in chosen]
        ro = [p for i, p in enumerate(phases) if i not in chosen]
        total += 1
        misses += not met(mode_ratios(rw, ro))
    actual = met(mode_ratios([p for p in phases if p["mode"] == READ_WRITE],
                             [p for p in phases if p["mode"] == RESTORE_ONLY]))
    return actual, misses, total


def paired_ratios(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    return {k: statistics.median(rw[k] / ro[k] for rw, ro in pairs) for k in RATIO_KEYS}


def cycles(phases: list[dict]) -> list[tuple[dict, dict]]:
    """(read-write, restore-only) of each cycle: the bench runs a cycle as two phases in a row."""
    pairs = []
    for a, b in zip(phases[::2], phases[1::2]):
        if a["mode"] == b["mode"]:
            raise SystemExit(f"phases {a['index']} and {b['index']} are both {a['mode']}: not a cycle")
        pairs.append((a, b) if a["mode"] == READ_WRITE else (b, a))
    return pairs


def paired(phases: list[dict]) -> tuple[bool, int, int]:
    """As :func:`unpaired`, for the paired form."""
    pairs = cycles(phases)
    misses = total = 0
    for swaps in itertools.product((False, True), repeat=len(pairs)):
        total += 1
        misses += not met(paired_ratios([(ro, rw) if s else (rw, ro) for (rw, ro), s in zip(pairs, swaps)]))
    return met(paired_ratios(pairs)), misses, total


def t_quantile(p: float, df: int) -> float:
    """Student's t distribution's ``p`` quantile (``0.5 < p < 1``) with ``df`` degrees of freedom."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, steps: int = 4000) -> float:  # 0.5 + the density's integral over [0, x], Simpson's rule
        h = x / steps
        f = [scale * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def pooled(runs: list[list[dict]], confidence: float = 0.95) -> dict:
    """Every run's cycles together (two runs at least): per figure the geometric mean of the
    cycles' read-write over restore-only ratios and its ``confidence`` interval, by Student's t
    over the runs' mean log ratios; ``met``: every bound holds at the interval's worse end (each
    bound is one-sided, so it holds at both ends exactly when it holds at the worse one)."""
    if len(runs) < 2:
        raise ValueError("pooling needs two runs at least (the runs are the interval's observations)")
    t = t_quantile((1 + confidence) / 2, len(runs) - 1)
    run_cycles = [cycles(phases) for phases in runs]
    figures = {}
    for key in RATIO_KEYS:
        means = [statistics.fmean(math.log(rw[key] / ro[key]) for rw, ro in pairs) for pairs in run_cycles]
        mean, half = statistics.fmean(means), t * statistics.stdev(means) / math.sqrt(len(means))
        figures[key] = {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half)}
    met = all(met_at_end for end in ("low", "high")
              for met_at_end in ratio_targets({k: f[end] for k, f in figures.items()}).values())
    return {"runs": len(runs), "cycles": sum(map(len, run_cycles)), "confidence": confidence,
            "ratios": figures, "met": met}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay_b_spread", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="bench.replay_b_engine --out directories or their JSON")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    rows, runs = [], []
    for run in args.runs:
        phases = load_phases(run)
        runs.append(phases)
        (u_met, u_miss, u_n), (p_met, p_miss, p_n) = unpaired(phases), paired(phases)
        rows.append({"run": str(run), "met": u_met, "null_misses": u_miss, "namings": u_n,
                     "paired_met": p_met, "paired_null_misses": p_miss, "paired_namings": p_n})
        print(f"{run}: met {u_met} (namings missing a bound {u_miss} of {u_n}); paired: met {p_met} "
              f"({p_miss} of {p_n})")
    summary = {}
    for form, miss, n, ok in (("bench", "null_misses", "namings", "met"),
                              ("paired", "paired_null_misses", "paired_namings", "paired_met")):
        rate = sum(r[miss] for r in rows) / sum(r[n] for r in rows)
        summary[form] = {"null_miss_rate": rate, "three_in_a_row_if_no_difference": (1 - rate) ** 3,
                         "runs_met": sum(r[ok] for r in rows), "runs": len(rows)}
        print(f"{form}: with no difference between the modes a run misses {rate:.1%} of the time "
              f"(three in a row meet {(1 - rate) ** 3:.0%}); these runs met {summary[form]['runs_met']} of {len(rows)}")
    if len(runs) > 1:
        summary["pooled"] = pool = pooled(runs)
        figures = ", ".join(f"{k} {f['ratio']:.3f} ({f['low']:.3f}-{f['high']:.3f})" for k, f in pool["ratios"].items())
        print(f"pooled over {pool['runs']} runs ({pool['cycles']} cycles), read-write over restore-only with "
              f"{pool['confidence']:.0%} intervals: {figures}; every bound holds at the interval's worse end: "
              f"{'yes' if pool['met'] else 'no'}")
    if args.out:
        args.out.write_text(json.dumps({"bench": "replay_b_spread", "runs": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
