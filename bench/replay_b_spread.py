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

Writes nothing but ``--out`` (JSON); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
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


def paired(phases: list[dict]) -> tuple[bool, int, int]:
    """As :func:`unpaired`, for the paired form: the bench runs a cycle as two phases in a row."""
    pairs = []
    for a, b in zip(phases[::2], phases[1::2]):
        if a["mode"] == b["mode"]:
            raise SystemExit(f"phases {a['index']} and {b['index']} are both {a['mode']}: not a cycle")
        pairs.append((a, b) if a["mode"] == READ_WRITE else (b, a))
    misses = total = 0
    for swaps in itertools.product((False, True), repeat=len(pairs)):
        total += 1
        misses += not met(paired_ratios([(ro, rw) if s else (rw, ro) for (rw, ro), s in zip(pairs, swaps)]))
    return met(paired_ratios(pairs)), misses, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replay_b_spread", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="bench.replay_b_engine --out directories or their JSON")
    p.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    rows = []
    for run in args.runs:
        phases = load_phases(run)
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
    if args.out:
        args.out.write_text(json.dumps({"bench": "replay_b_spread", "runs": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
