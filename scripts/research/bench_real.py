#!/usr/bin/env python
"""The default detector on public training logs: the bench every change to the rule is measured on first.

Replays each run of ``scripts/research/traces/real`` (48 public RL training logs, their sources in each CSV's
``#`` lines, the expectations in ``EXPECT.txt`` and their reasons in ``README.md`` there) through the default
rule exactly as ``lrstab replay`` does (:func:`verl_lrstab.cli.replay.replay_run` with the default
``LengthSurgeConfig``), its columns renamed to verl's names as that README says. Beside it, the reference rule:
the rolling z-score of the raw length against the previous 50 steps (at least 10 rows), firing at z > 4.

Prints one row per run (decision step, the way that fired, the expectation, the z-score's step) and a summary
line: judged surges inside their windows, healthy runs firing, and the median lag behind the z-score over the
judged surges where both fire. ``--markdown`` prints the table as docs/detector.md shows it::

    python scripts/research/bench_real.py [--markdown] [--option KEY=VALUE ...]

``--leave-one-source-out`` checks that every number of the rule generalises across sources: for each number
(each option of the rule and each constant of ``verl_lrstab/cusum.py``) and each of the 8 sources (a run's name
up to its first ``_``), the number is chosen from ``CANDIDATES`` on the runs of the other 7 sources (the most
judged surges in their windows, then the fewest healthy runs firing, then the smallest median lag behind the
z-score; a tie keeps the default), and the left-out source is decided with that choice. It prints one row per
source: the numbers whose choice moves, and what changes for the left-out source::

    python scripts/research/bench_real.py --leave-one-source-out [--markdown]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
import yaml
from tqdm import tqdm

import verl_lrstab.cusum as cusum
from verl_lrstab.cli.replay import replay_run
from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.runs import load_run

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "scripts" / "research" / "traces" / "real"
# the README's column map: the CSVs' names -> verl's
VERL_NAMES = {"response_length_mean": "response_length/mean", "mismatch_kl_k3": "rollout_corr/k3_kl",
              "actor_grad_norm": "actor/grad_norm", "entropy": "actor/entropy", "reward_acc": "critic/score/mean"}
Z_WINDOW, Z_LEAST, Z_FIRE = 50, 10, 4.0


@dataclass
class Outcome:
    name: str
    expect: str  # "lo-hi", "none" or "any"
    step: Optional[int]  # the default rule's first surge step
    way: Optional[str]
    z_step: Optional[int]

    @property
    def window(self) -> Optional[tuple[int, int]]:
        if "-" not in self.expect:
            return None
        lo, hi = self.expect.split("-")
        return int(lo), int(hi)

    @property
    def verdict(self) -> str:
        if self.expect == "any":
            return "reported"
        if self.expect == "none":
            return "quiet" if self.step is None else "FALSE ALARM"
        lo, hi = self.window
        if self.step is None:
            return "MISSED"
        return "in window" if lo <= self.step <= hi else ("EARLY" if self.step < lo else "LATE")

    @property
    def lag(self) -> Optional[int]:
        """Steps after the z-score (negative: before it); None unless both fire."""
        return None if self.step is None or self.z_step is None else self.step - self.z_step


def expectations(runs: Path = RUNS) -> dict[str, str]:
    out = {}
    for line in (runs / "EXPECT.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, expect = line.split()
            out[name] = expect
    return out


def verl_frame(path: Path) -> pd.DataFrame:
    """The run as ``lrstab replay`` would read its verl log: the CSV, its columns under verl's names."""
    df = load_run(path)
    return df.rename(columns=VERL_NAMES)


def z_score_step(steps: list[int], values: list[float]) -> Optional[int]:
    """The reference rule: the first step whose length is Z_FIRE sd above the mean of the previous Z_WINDOW steps."""
    for i, (step, value) in enumerate(zip(steps, values)):
        before = [v for s, v in zip(steps[:i], values[:i]) if s >= step - Z_WINDOW and math.isfinite(v)]
        if len(before) < Z_LEAST or not math.isfinite(value):
            continue
        sd = statistics.stdev(before)
        if sd > 0 and (value - statistics.fmean(before)) / sd > Z_FIRE:
            return step
    return None


def run_one(name: str, expect: str, config: LengthSurgeConfig, runs: Path = RUNS) -> Outcome:
    df = verl_frame(runs / f"{name}.csv")
    result, values = replay_run(df, "response_length/mean", config)
    z = z_score_step([int(s) for s in values.index], [float(v) for v in values])
    return Outcome(name, expect, result.surge_step, result.fired_by, z)


def bench(config: Optional[LengthSurgeConfig] = None, runs: Path = RUNS) -> list[Outcome]:
    config = config or LengthSurgeConfig()
    logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
    return [run_one(name, expect, config, runs) for name, expect in expectations(runs).items()]


@dataclass
class Summary:
    judged: int
    in_window: int
    healthy: int
    healthy_fired: int
    median_lag: Optional[float]

    def line(self) -> str:
        lag = "-" if self.median_lag is None else f"{self.median_lag:+g}"
        return (f"judged surges in window: {self.in_window}/{self.judged}; healthy runs firing: "
                f"{self.healthy_fired}/{self.healthy}; median lag behind the z-score: {lag} steps")


def summarize(outcomes: list[Outcome]) -> Summary:
    judged = [o for o in outcomes if o.window]
    healthy = [o for o in outcomes if o.expect == "none"]
    lags = [o.lag for o in judged if o.lag is not None]
    return Summary(len(judged), sum(o.verdict == "in window" for o in judged), len(healthy),
                   sum(o.step is not None for o in healthy), statistics.median(lags) if lags else None)


def _cell(v) -> str:
    return "-" if v is None else str(v)


def table(outcomes: list[Outcome], markdown: bool = False) -> str:
    order = sorted(outcomes, key=lambda o: ({"-": 0, "a": 2, "n": 1}.get("-" if o.window else o.expect[0]), o.name))
    head = ("run", "expect", "fires", "way", "z-score", "lag", "verdict")
    rows = [(o.name, o.expect, _cell(o.step), _cell(o.way), _cell(o.z_step),
             "-" if o.lag is None else f"{o.lag:+d}", o.verdict) for o in order]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(r)) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in (head, *rows))


# -- leave one source out -----------------------------------------------------------------------------
#: Each number of the rule and the values it is chosen from (its default among them): the options of
#: LengthSurgeConfig, and the constants of verl_lrstab/cusum.py (prefixed ``cusum.``).
CANDIDATES: dict[str, tuple] = {
    "skip_first_steps": (5, 10, 15, 20), "cusum_span": (20, 25, 30, 40), "cusum_lag": (3, 6, 8, 10, 12, 15),
    "cusum_drift": (0.5, 0.75, 1.0, 1.5), "cusum_threshold": (3.0, 4.0, 5.0, 6.0, 7.0),
    "cusum_min_rise": (1.1, 1.15, 1.2, 1.25, 1.3), "cusum_noise_floor": (0.03, 0.05, 0.07),
    "cusum_rebound_margin": (1.15, 1.3, 1.5), "cusum_rebound_memory": (50, 100, 150),
    "cusum_confirm_steps": (20, 40, 60), "cusum_score_z": (2.5, 3.0, 3.5, 4.0), "cusum_kl_rise": (1.3, 1.5, 1.75),
    "cusum_clip_rise": (0.15, 0.25, 0.35), "cusum_runaway_rise": (2.0, 2.5, 3.0), "cusum_spike_rise": (1.1, 1.2, 1.3),
    "cusum.FAST_ROWS": (1, 2, 3), "cusum.LEVEL_STEPS": (3, 5, 7), "cusum.FEW_ROWS": (2, 3, 4),
    "cusum.MIN_ROWS": (5, 8, 12), "cusum.NOISE_ROWS": (12, 20, 30), "cusum.OLD_STEPS": (40, 60, 80),
    "cusum.WITNESS_RISE": (1.05, 1.1, 1.2), "cusum.OLDER_KL_POWER": (1.5, 2, 3), "cusum.WITNESSES": (1, 2, 3),
    "cusum.SCORE_FLOOR": (0.005, 0.01, 0.02), "cusum.HALF": (0.4, 0.5, 0.6),
}


def source(name: str) -> str:
    return name.split("_", 1)[0]


def _with(number: str, value, runs: Path) -> list[Outcome]:
    """The bench with one number set (a constant of cusum.py is set on the module and restored)."""
    if not number.startswith("cusum."):
        return bench(LengthSurgeConfig(**{number: value}), runs)
    const = number.removeprefix("cusum.")
    old = getattr(cusum, const)
    setattr(cusum, const, value)
    try:
        return bench(None, runs)
    finally:
        setattr(cusum, const, old)


def _rank(outcomes: list[Outcome]) -> tuple:
    """Higher is better: judged surges in window, then fewer healthy runs firing, then a smaller median lag."""
    s = summarize(outcomes)
    return s.in_window, -s.healthy_fired, -(s.median_lag if s.median_lag is not None else math.inf)


def _default(number: str):
    if number.startswith("cusum."):
        return getattr(cusum, number.removeprefix("cusum."))
    return getattr(LengthSurgeConfig(), number)


def _choose(per_value: dict, default, keep) -> object:
    """The value whose outcomes on the runs ``keep`` selects rank best; a tie keeps the default."""
    ranked = {v: _rank([o for o in outs if keep(o)]) for v, outs in per_value.items()}
    best = max(ranked.values())
    return default if ranked[default] == best else next(v for v, r in ranked.items() if r == best)


def _source_line(outcomes: list[Outcome]) -> str:
    judged = [o for o in outcomes if o.window]
    healthy = [o for o in outcomes if o.expect == "none"]
    parts = []
    if judged:
        parts.append(f"{sum(o.verdict == 'in window' for o in judged)}/{len(judged)} judged in window ("
                     + ", ".join(f"{o.step if o.step is not None else '-'}" for o in judged) + ")")
    if healthy:
        parts.append(f"{sum(o.step is not None for o in healthy)}/{len(healthy)} healthy firing")
    return "; ".join(parts) or "reported only"


def number_grid(runs: Path = RUNS) -> dict:
    """``{number: {value: outcomes}}`` over CANDIDATES (each number alone moved from its default)."""
    return {number: {v: _with(number, v, runs) for v in values}
            for number, values in tqdm(CANDIDATES.items(), desc="numbers", unit="number")}


def _short(outcomes: list[Outcome]) -> str:
    s = summarize(outcomes)
    lag = "-" if s.median_lag is None else f"{s.median_lag:+g}"
    return f"{s.in_window}/{s.judged}, {s.healthy_fired}/{s.healthy}, {lag}"


def numbers_table(grid: dict, markdown: bool = False) -> str:
    """Per number whose candidates differ: each candidate value's headline (judged in window, healthy firing,
    median lag); then one line naming the numbers every candidate of which gives the same headline."""
    head = ("number", "default", "each value: judged in window, healthy firing, median lag")
    moving = {n: per for n, per in grid.items() if len({_short(outs) for outs in per.values()}) > 1}
    cells = [(n, str(_default(n)), "; ".join(f"{v}: {_short(outs)}" for v, outs in per.items()))
             for n, per in moving.items()]
    flat = [f"{n} ({', '.join(str(v) for v in grid[n])})" for n in grid if n not in moving]
    tail = "The same headline at every candidate value: " + ", ".join(flat) + "." if flat else ""
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(f"`{c}`" if i == 0 else c for i, c in enumerate(r)) + " |" for r in cells]
                         + ["", tail])
    return "\n".join([" | ".join(c) for c in (head, *cells)] + [tail])


#: The ways to fire and the holds, each removed alone (a way that never fires, a hold that never holds).
def _removed(piece: str):
    if piece == "hold spike":
        return "_spikes", lambda self: set()
    kind, name = piece.split()
    return f"_{kind}_{name}", (lambda self, *a, **k: False)


def ablate(runs: Path = RUNS) -> list[tuple[str, str]]:
    """``(piece, what changes on the real runs)`` for each way and hold of the rule removed alone."""
    base = {o.name: o for o in bench(None, runs)}
    pieces = [f"way {w}" for w in cusum.WAYS] + [f"hold {h}" for h in cusum.HOLDS if h != "warmup"] + ["hold spike"]
    out = []
    for piece in pieces:
        attr, fn = _removed(piece)
        old = getattr(cusum.CusumDetector, attr)
        setattr(cusum.CusumDetector, attr, fn)
        try:
            outcomes = bench(None, runs)
        finally:
            setattr(cusum.CusumDetector, attr, old)
        moved = [f"{o.name} {_cell(base[o.name].step)} → {_cell(o.step)}" for o in outcomes
                 if o.step != base[o.name].step and o.expect != "any"]
        out.append((piece, f"{_short(outcomes)}" + (f" ({'; '.join(moved)})" if moved else "")))
    return out


def leave_one_source_out(runs: Path = RUNS, grid: Optional[dict] = None) -> list[dict]:
    """One row per source: the numbers whose choice on the other sources differs from their choice on all, and
    the left-out source's outcomes with the defaults and with the numbers chosen without it."""
    grid = grid or number_grid(runs)
    base = bench(None, runs)
    everyone = {n: _choose(per, _default(n), lambda o: True) for n, per in grid.items()}
    rows = []
    for src in sorted({source(o.name) for o in base}):
        chosen = {n: _choose(per, _default(n), lambda o: source(o.name) != src) for n, per in grid.items()}
        moved = {n: v for n, v in chosen.items() if v != everyone[n]}
        config = {n: v for n, v in chosen.items() if not n.startswith("cusum.") and v != _default(n)}
        consts = {n.removeprefix("cusum."): v for n, v in chosen.items() if n.startswith("cusum.") and v != _default(n)}
        saved = {c: getattr(cusum, c) for c in consts}
        for c, v in consts.items():
            setattr(cusum, c, v)
        try:
            without = [o for o in bench(LengthSurgeConfig(**config), runs) if source(o.name) == src]
        finally:
            for c, v in saved.items():
                setattr(cusum, c, v)
        mine = [o for o in base if source(o.name) == src]
        rows.append({"source": src, "runs": len(mine), "moved": moved, "default": _source_line(mine),
                     "without": _source_line(without)})
    return rows + [{"source": "(all)", "runs": len(base), "moved": {n: v for n, v in everyone.items()
                                                                   if v != _default(n)},
                    "default": summarize(base).line(), "without": ""}]


def loso_table(rows: list[dict], markdown: bool = False) -> str:
    head = ("source", "runs", "numbers chosen otherwise without it", "the source, defaults",
            "the source, numbers chosen without it")
    cells = [(r["source"], str(r["runs"]), ", ".join(f"{n}={v}" for n, v in r["moved"].items()) or "none",
              r["default"], r["without"] or "-") for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(c) + " |" for c in cells])
    return "\n".join(" | ".join(c) for c in (head, *cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/detector.md)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a length_surge option for the rule (YAML value), e.g. cusum_span=30; repeatable")
    p.add_argument("--runs", type=Path, default=RUNS, help="the folder of runs and EXPECT.txt (default: %(default)s)")
    p.add_argument("--leave-one-source-out", action="store_true",
                   help="choose each number on all sources but one and decide the left-out source with it; "
                        "also print each number's candidate values with their headlines")
    p.add_argument("--ablate", action="store_true", help="remove each way and hold alone: what changes")
    args = p.parse_args(argv)
    if args.ablate:
        for piece, change in ablate(args.runs):
            print(f"| {piece} | {change} |" if args.markdown else f"{piece}: {change}")
        return 0
    if args.leave_one_source_out:
        grid = number_grid(args.runs)
        print(loso_table(leave_one_source_out(args.runs, grid), args.markdown))
        print()
        print(numbers_table(grid, args.markdown))
        return 0
    options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.option)}
    outcomes = bench(LengthSurgeConfig(**options), args.runs)
    print(table(outcomes, args.markdown))
    print()
    print(summarize(outcomes).line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
