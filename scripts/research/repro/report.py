#!/usr/bin/env python
"""Table and plots of the reproduction runs, from verl's file-logger JSONL.

Usage: python scripts/research/repro/report.py [--runs outputs/repro/runs] [--out outputs/repro/report]

Per run: the surge step (the detector's own ``actor/lrstab/surge_step``, logged by every arm
since the constant arms run it with ``monitor_only``), the step the LR decay started
(``actor/lrstab/trigger_step``: a length surge or the mismatch trigger), the collapse step (rule below), peak
and final validation accuracy, the mean of the last ``LATE_POINTS`` validations, the mismatch
KL (``actor/mismatch/k3``) early and late. Per arm: the same, mean +- std over seeds. Figures:
``overview.png`` and one PNG per series, one line per arm (mean over seeds, band min..max).

Collapse rule (:func:`collapse_step`): the first validation step after the peak from which
the validation accuracy stays below ``COLLAPSE_FRACTION`` (0.5) x peak to the end of the run,
for at least ``MIN_POINTS`` (2) validations, provided the peak is at least ``MIN_PEAK`` (0.05):
a run that never learned cannot collapse, and one low last point is not a collapse.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

from verl_lrstab_cpu.launch import REPO_ROOT, read_metrics

VAL_KEY = "val-core/lrstab_repro_add/acc/mean@1"  # greedy validation; sampled (n=4) logs mean@4
FP32_VAL_KEY = "val-fp32/acc"  # the trainer's weights sampled in fp32 (evaluate.py's fp32_val.json), bypass recipe


def val_key(metrics: dict[int, dict]) -> str:
    """The validation key of this run: the fp32 one if evaluate.py scored it, else verl's ``val-core/<source>/acc/mean@<n>``."""
    if any(FP32_VAL_KEY in d for d in metrics.values()):
        return FP32_VAL_KEY
    return sampler_val_key(metrics)


def sampler_val_key(metrics: dict[int, dict]) -> str:
    """verl's own validation key (through the rollout server), VAL_KEY if none."""
    keys = sorted({k for d in metrics.values() for k in d if k.startswith("val-core/") and "/acc/mean@" in k})
    return keys[0] if keys else VAL_KEY


def add_fp32_val(metrics: dict[int, dict], run_dir: Path) -> dict[int, dict]:
    """Merge ``run_dir/fp32_val.json`` (evaluate.py) into ``metrics`` as :data:`FP32_VAL_KEY` (+ its length)."""
    path = run_dir / "fp32_val.json"
    if path.exists():
        for step, rec in json.loads(path.read_text()).items():
            row = metrics.setdefault(int(step), {})
            row[FP32_VAL_KEY] = rec["acc"]
            row["val-fp32/mean_length"] = rec["mean_length"]
    return dict(sorted(metrics.items()))
COLLAPSE_FRACTION = 0.5
MIN_PEAK = 0.05
MIN_POINTS = 2
LINESTYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 1, 3, 1))]
LATE_POINTS = 5  # late_val: mean of the last 5 validations (one point of 256 samples is noisy)
SERIES = {  # figure -> (metric, title, log y)
    "length": ("response_length/mean", "mean response length (tokens)", False),
    "val": (VAL_KEY, "validation accuracy (fp32 if scored, else via the sampler)", False),
    "score": ("critic/score/mean", "training reward (sampled)", False),
    "mismatch": ("actor/mismatch/k3", "mismatch KL k3 (rollout vs trainer)", True),
    "clipfrac": ("actor/pg_clipfrac", "share of tokens the PPO clip cut", False),
    "lr": ("actor/lr", "actor LR", False),
}


def series(metrics: dict[int, dict], key: str) -> dict[int, float]:
    return {s: float(d[key]) for s, d in sorted(metrics.items()) if key in d and d[key] is not None}


def collapse_step(val: dict[int, float], fraction: float = COLLAPSE_FRACTION, min_peak: float = MIN_PEAK,
                  min_points: int = MIN_POINTS) -> Optional[int]:
    """First step after the peak from which ``val`` stays below ``fraction x peak``; None if it never does.

    Args:
        val: validation accuracy by step.
        fraction: share of the peak under which the run counts as collapsed.
        min_peak: a peak under this means the run never learned: no collapse is called.
        min_points: validations the final low stretch must span.

    Returns:
        The collapse step or None.
    """
    if not val:
        return None
    steps = sorted(val)
    peak_step = max(steps, key=lambda s: (val[s], -s))
    peak = val[peak_step]
    if peak < min_peak:
        return None
    after = [s for s in steps if s > peak_step]
    start, n = None, 0
    for s in after:
        if val[s] < fraction * peak:
            start, n = (s if start is None else start), n + 1
        else:
            start, n = None, 0
    return start if n >= min_points else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize_run(metrics: dict[int, dict]) -> dict:
    """The table row of one run (see the module docstring)."""
    val, length, k3 = series(metrics, val_key(metrics)), series(metrics, "response_length/mean"), series(metrics, "actor/mismatch/k3")
    sampler_val = series(metrics, sampler_val_key(metrics))
    surge = [int(v) for v in series(metrics, "actor/lrstab/surge_step").values() if v >= 0]
    decay = [int(v) for v in series(metrics, "actor/lrstab/trigger_step").values() if v >= 0]
    lsteps = sorted(length)
    collapse = collapse_step(val)
    return {
        "last_step": max(metrics, default=0),
        "val_source": "fp32" if val_key(metrics) == FP32_VAL_KEY else "sampler",
        "surge_step": surge[0] if surge else None,
        "decay_step": decay[0] if decay else None,  # the LR decay's start (length surge or mismatch trigger)
        "collapse_step": collapse,
        # detection lead: steps from the detected surge to the collapse (negative: detected after it)
        "lead": collapse - surge[0] if surge and collapse is not None else None,
        "start_val": val.get(min(val)) if val else math.nan,  # before any update: the mismatch arms' gap here is eval noise only
        "peak_val": max(val.values()) if val else math.nan,
        "peak_val_step": max(val, key=lambda s: (val[s], -s)) if val else None,
        "final_val": val[max(val)] if val else math.nan,
        "late_val": _mean([val[s] for s in sorted(val)[-LATE_POINTS:]]),
        "sampler_final_val": sampler_val[max(sampler_val)] if sampler_val else math.nan,
        "len_first10": _mean([length[s] for s in lsteps[:10]]),
        "len_max10": max((_mean([length[t] for t in lsteps[i:i + 10]]) for i in range(max(1, len(lsteps) - 9))),
                         default=math.nan),
        "len_last10": _mean([length[s] for s in lsteps[-10:]]),
        "k3_first10": _mean([k3[s] for s in sorted(k3)[:10]]),
        "k3_last10": _mean([k3[s] for s in sorted(k3)[-10:]]),
    }


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _spread(values: list) -> str:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "-"
    if len(vals) == 1:
        return _fmt(float(vals[0]))
    return f"{_fmt(statistics.mean(vals))} ± {_fmt(statistics.stdev(vals))}"


def arm_table(rows: list[dict]) -> str:
    """Markdown: one line per arm, mean ± std over its seeds; surge/collapse as the list of steps."""
    arms: dict[str, list[dict]] = {}
    for r in rows:
        arms.setdefault(r["arm"], []).append(r)
    lines = ["| arm | seeds | length surge step | LR decay from | collapsed (step) | lead (collapse - surge) | start val | "
             "peak val | final val | late val | len first/peak/last 10 | k3 first/last 10 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in arms.items():
        surges = ", ".join(_fmt(r["surge_step"]) for r in rs)
        decays = ", ".join(_fmt(r["decay_step"]) for r in rs)
        coll = [r["collapse_step"] for r in rs]
        coll_txt = f"{sum(c is not None for c in coll)}/{len(rs)} (" + ", ".join(_fmt(c) for c in coll) + ")"
        lens = " / ".join(_spread([r[k] for r in rs]) for k in ("len_first10", "len_max10", "len_last10"))
        k3 = " / ".join(_spread([r[k] for r in rs]) for k in ("k3_first10", "k3_last10"))
        leads = ", ".join(_fmt(r.get("lead")) for r in rs)
        lines.append(f"| {arm} | {len(rs)} | {surges} | {decays} | {coll_txt} | {leads} | {_spread([r['start_val'] for r in rs])} | "
                     f"{_spread([r['peak_val'] for r in rs])} | "
                     f"{_spread([r['final_val'] for r in rs])} | {_spread([r['late_val'] for r in rs])} | {lens} | {k3} |")
    return "\n".join(lines)


def run_table(rows: list[dict]) -> str:
    keys = ["run", "arm", "seed", "last_step", "surge_step", "decay_step", "collapse_step", "lead", "val_source", "start_val", "peak_val", "peak_val_step", "final_val", "late_val", "sampler_final_val",
            "len_first10", "len_max10", "len_last10", "k3_first10", "k3_last10", "wall_s"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _arm_band(runs: list[tuple[dict, dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every run of the arm logged ``key`` at, with the mean, min and max over the runs."""
    per_run = [series(m, val_key(m) if key == VAL_KEY else key) for _, m in runs]
    per_run = [s for s in per_run if s]
    if not per_run:
        return [], [], [], []
    steps = sorted(set.intersection(*(set(s) for s in per_run)))
    cols = [[s[t] for s in per_run] for t in steps]
    return steps, [_mean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def plot(runs: list[tuple[dict, dict]], out: Path) -> list[Path]:
    """``overview.png`` (length, validation, mismatch, LR) and one PNG per :data:`SERIES` entry.

    One line per arm: the mean over its seeds, the band from min to max; a tick on the x axis
    at each run's detected surge.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, list] = {}
    for row, metrics in runs:
        by_arm.setdefault(row["arm"], []).append((row, metrics))
    color = {a: f"C{i % 10}" for i, a in enumerate(by_arm)}

    def draw(ax, key, title, logy):
        for i, (arm, rs) in enumerate(by_arm.items()):
            style = dict(color=color[arm], ls=LINESTYLES[i % len(LINESTYLES)], lw=1.2)  # arms can coincide exactly
            if key == "actor/lr":  # a mean of step functions is no run's LR: one line per run
                for j, (_, m) in enumerate(rs):
                    s = series(m, key)
                    ax.plot(list(s), list(s.values()), label=f"{arm} (n={len(rs)})" if j == 0 else None, **style)
                continue
            steps, mean, lo, hi = _arm_band(rs, key)
            if not steps:
                continue
            ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, ms=3, label=f"{arm} (n={len(rs)})", **style)
            if len(rs) > 1:
                ax.fill_between(steps, lo, hi, color=color[arm], alpha=0.12, lw=0)
            for r, _ in rs:
                if r["surge_step"] is not None:
                    ax.axvline(r["surge_step"], ymax=0.08, color=color[arm], lw=2)
                if r["decay_step"] is not None and r["decay_step"] != r["surge_step"]:
                    ax.axvline(r["decay_step"], ymin=0.92, color=color[arm], lw=2)
        if logy:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)

    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, name in zip(axes.flat, ("length", "val", "mismatch", "lr")):
        draw(ax, *SERIES[name])
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("mean over seeds, band min..max; short bars: detected length surges (bottom), other LR decay starts (top)")
    fig.tight_layout()
    paths.append(out / "overview.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for name, (key, title, logy) in SERIES.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        draw(ax, key, title, logy)
        ax.legend(fontsize=8)
        ax.set_ylabel(key)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


SETTING_KEYS = ("recipe", "steps", "lr", "sampler", "sampler_temperature", "grader", "noise")


def setting_line(rows: list[dict]) -> str:
    """The runs' setting (from their run.json), each key with every value it takes."""
    values = {k: sorted({str(r["setting"][k]) for r in rows if k in r.get("setting", {})}) for k in SETTING_KEYS}
    return "Setting: " + (", ".join(f"{k} {'/'.join(v)}" for k, v in values.items() if v) or "unknown (no run.json)")


def collect(runs_dir: Path) -> list[tuple[dict, dict]]:
    """Every ``<runs_dir>/*/metrics.jsonl`` with its ``run.json`` (arm, seed, wall time)."""
    out = []
    for path in sorted(runs_dir.glob("*/metrics.jsonl")):
        metrics = add_fp32_val(read_metrics(path), path.parent)
        if not metrics:
            continue
        info_path = path.parent / "run.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        row = {"run": path.parent.name, "arm": info.get("arm", path.parent.name.rsplit("-s", 1)[0]),
               "seed": info.get("seed"), "wall_s": info.get("wall_s"),
               "setting": {k: info[k] for k in SETTING_KEYS if k in info}, **summarize_run(metrics)}
        out.append((row, metrics))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=REPO_ROOT / "outputs" / "repro" / "runs")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "repro" / "report")
    p.add_argument("--only", nargs="*", default=None, help="run directory names to include (default all)")
    args = p.parse_args(argv)
    runs = [r for r in collect(args.runs) if not args.only or r[0]["run"] in args.only]
    if not runs:
        print(f"no runs with a metrics.jsonl under {args.runs}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for r, _ in runs]
    text = setting_line(rows) + "\n\n## Per arm\n\n" + arm_table(rows) + "\n\n## Per run\n\n" + run_table(rows) + "\n"
    (args.out / "summary.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    paths = plot(runs, args.out)
    print(text)
    print("figures: " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
