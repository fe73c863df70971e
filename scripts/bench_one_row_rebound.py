#!/usr/bin/env python
"""What it costs to fire class K on the z-score's step: a rebound decided on one row of the length.

Usage: python scripts/bench_one_row_rebound.py [--z 6 10 16] [--seeds 40]

Class K (issue 33) returns to an early high while its score collapses; the rolling z-score fires on
the return's first row, ``cusum`` a step later (its level needs 2 rows and the score falls a step
after the length). This experiment adds one rule to ``cusum`` (a subclass here, not the product):
at a rebound (the run had an earlier high, ``CusumDetector._rebound``), fire on the newest row
alone once it is ``z`` noise units (the baseline's MAD scale) and ``min_rise`` x above the
baseline. It prints, per ``z``, K's median step against the z-score's, K detected before the
crash, and the false alarms on the healthy classes (dense logs), side by side in one run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_detector as bench  # noqa: E402
from tqdm import tqdm  # noqa: E402

from verl_lrstab import cusum, schedule  # noqa: E402

HEALTHY = "CDEFHLMN"


def one_row_detector(z: float) -> type:
    class OneRowRebound(cusum.CusumDetector):
        def update(self, step, value, *args, **kwargs):
            fired = super().update(step, value, *args, **kwargs)
            if fired or self.surge_steps or not self._log or self._log[-1][0] != step or step <= self.skip_first_steps:
                return fired
            rows = self._baseline_rows(step)
            if len(rows) < 3:
                return False
            base = statistics.median(rows)
            noise = max(cusum._mad_scale(rows, base), self.noise_floor)
            y = self._log[-1][1]
            if (y - base) / noise >= z and math.exp(y - base) >= self.min_rise and self._rebound(step, base):
                self.surge_steps.append(step)
                self._disarm()
                return True
            return False

    return OneRowRebound


def measure(z: float | None, runs: list[dict]) -> dict:
    schedule.CusumDetector = cusum.CusumDetector if z is None else one_row_detector(z)
    try:
        out = {"rule": "cusum" if z is None else f"+ one row at z >= {z:g}"}
        k_vs_z, k_before, alarms = [], 0, {c: 0 for c in HEALTHY}
        for run in tqdm(runs, desc=out["rule"], leave=False):
            fired = bench._cusum(run)
            if run["cls"] == "K":
                ref = bench._zscore(run)
                if fired is not None and ref is not None:
                    k_vs_z.append(fired - ref)
                k_before += fired is not None and run["onset"] < fired < run["crash"]
            elif fired is not None:
                alarms[run["cls"]] += 1
        out["K: median step vs z-score"] = f"{statistics.median(k_vs_z):+g}" if k_vs_z else "-"
        out["K: before the crash"] = f"{k_before} / {sum(r['cls'] == 'K' for r in runs)}"
        out.update({f"false alarms {c}": n for c, n in alarms.items()})
        return out
    finally:
        schedule.CusumDetector = cusum.CusumDetector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--z", type=float, nargs="+", default=[6.0, 10.0, 16.0], help="noise units of the one-row rule")
    ap.add_argument("--seeds", type=int, default=40, help="seeds per class (default 40)")
    args = ap.parse_args()
    runs = bench.phenomena_runs(seeds=range(args.seeds), classes="K" + HEALTHY)
    rows = [measure(None, runs)] + [measure(z, runs) for z in args.z]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
