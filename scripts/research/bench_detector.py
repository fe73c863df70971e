#!/usr/bin/env python
"""Surge detectors side by side on labelled runs: detections, false alarms, lead before the crash.

Runs: the seeded class A-T runs (``scripts/research/phenomena.py``, 40 seeds each, with score /
mismatch-k3 / clip-ratio columns; I-T with verl's entropy, grad norm, KL loss and PPO clip
fraction, O and Q with k3 too), each in nine log forms (``FORMS``: dense; the score on every 4th or 10th
row only, or forward-filled from every 10th, or absent; verl's co-signals on every 4th row only or
forward-filled from it; every column logged every 5 or 10 steps), the 34
length-only synthetic traces (``scripts/research/traces``, ``scripts/research/synthetic_traces.py``) and the real
traces of ``--real DIR`` (default ``scripts/research/traces/sparse``, fed as logged). Rules:

- ``cusum``: :func:`verl_lrstab.runs.replay_with_cosignals` (``log_replay.replay`` plus verl's
  co-signals) with the default ``LengthSurgeConfig`` (``detector: cusum``), fed every co-signal
  the run has (the trainer's code path);
- ``cusum, no KL``: the same without the mismatch KL (a verl run without mismatch figures: what
  ``lrstab replay`` finds in most logs);
- ``cusum, length only``: the same without the co-signals (what a run without score sees);
- ``ratio``: ``replay`` with ``detector: ratio`` (the first, simpler rule, default options);
- ``z-score``: rolling z-score of the raw length, previous 50 observations (at least 10), z > 4;
- ``trailing ratio``: mean of the last 5 observations >= 1.5 x the mean of the 50 before them;
- ``3x-first-50``: baseline = mean over the steps <= 50; the first later value > 3x baseline.

A "hit" of A, B, G, I, J, K, O must come in every form; any firing on C, D, E, F, H, L, M, N, P, Q in
any form is a false alarm. Scoring: A, I, J, K, O are detected when the rule fires between the onset and the crash
(the first step from the onset with accuracy below 0.5); lead = crash - detection. B is detected
when it fires between the onset and the step the length reaches the cap (``rise_end``). G is
detected on its 10x excursion (up to 10 steps after it) or on the later surge before its crash.
Writes ``--out`` (default docs/detector_benchmark.md)::

    python scripts/research/bench_detector.py
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "research"))

import phenomena  # noqa: E402
from synthetic_traces import DEFAULT_OUT as SYNTHETIC_DIR  # noqa: E402
from synthetic_traces import read_meta, specs  # noqa: E402
import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from verl_lrstab.config import LengthSurgeConfig  # noqa: E402
from verl_lrstab.decay import decay_period_from_surge, num_decays  # noqa: E402
from verl_lrstab.log_replay import replay  # noqa: E402
from verl_lrstab.runs import load_run, metric_series, replay_with_cosignals  # noqa: E402

SEEDS = range(40)
HEALTHY = "CDEFHLMNPQRS"  # the classes that must never fire
SURGES = "ABIJKOT"  # the classes with a crash a detection must come before
COSIGNAL_SURGES = "IJKOT"  # the surges that carry verl's co-signals
# Real traces: (class, onset, crash, length column, score column, clip column), from their # lines:
# onset = the first logged step at >= 1.5x the first logged value; crash = the collapse step.
REAL = {
    "fleet_negotiation_9b_length_runaway": ("real, 9 rows", 16, 64, "response_length", "you_norm", None),
    "trl_dapo_qwen25vl3b_length_explosion": ("real, 3 rows", 20, 20, "completions_mean_length", "reward",
                                             "completions_clipped_ratio"),
}


OPTIONS: dict = {}  # --set KEY=VALUE: options of the cusum rules (LengthSurgeConfig keys)


def _cusum(run, cosignals=("k3", "score", "clip", "verl")):
    kw = dict(mismatch_kl=run.get("k3"), score=run.get("score"), clip_ratio=run.get("clip"))
    kw = {k: v for k, v in kw.items() if {"mismatch_kl": "k3", "clip_ratio": "clip"}.get(k, k) in cosignals}
    co = run.get("co") if "verl" in cosignals else None  # entropy, grad norm, KL loss, PPO clip fraction
    return replay_with_cosignals(run["steps"], run["length"], LengthSurgeConfig(**OPTIONS), cosignals=co,
                                 **kw).surge_step


def _ratio(run):
    return replay(run["steps"], run["length"], LengthSurgeConfig(detector="ratio")).surge_step


def _zscore(run, window=50, min_history=10, threshold=4.0):
    vals = run["length"]
    for i, s in enumerate(run["steps"]):
        past = vals[max(0, i - window):i]
        if len(past) >= min_history:
            sd = statistics.pstdev(past)
            if sd > 0 and (vals[i] - statistics.fmean(past)) / sd > threshold:
                return s
    return None


def _trailing(run, recent=5, window=50, factor=1.5):
    vals = run["length"]
    for i in range(recent + 10, len(vals)):
        past = vals[max(0, i + 1 - recent - window):i + 1 - recent]
        if statistics.fmean(vals[i + 1 - recent:i + 1]) >= factor * statistics.fmean(past):
            return run["steps"][i]
    return None


def _three_x(run):
    first = [v for s, v in zip(run["steps"], run["length"]) if s <= 50]
    if not first:
        return None
    base = sum(first) / len(first)
    return next((s for s, v in zip(run["steps"], run["length"]) if s > 50 and v > 3 * base), None)


RULES: dict[str, Callable] = {"cusum": _cusum, "cusum, no KL": lambda r: _cusum(r, ("score", "clip", "verl")),
                              "cusum, length only": lambda r: _cusum(r, ()), "ratio": _ratio,
                              "z-score": _zscore, "trailing ratio": _trailing, "3x-first-50": _three_x}


# -- runs -----------------------------------------------------------------------------------------
def phenomena_runs(seeds=SEEDS, every: int = 1, classes=phenomena.CLASSES, score: str = "dense",
                   score_every: int = 10, cosignals: str = "dense", cosignals_every: int = 4) -> list[dict]:
    """The class runs as dicts; ``every``: every column logged every N steps; ``score``: a
    :func:`phenomena.sparse_score` form of the score column (``score_every``: its period);
    ``cosignals``: the same for verl's co-signals of classes I-N (``co``: ``{name: column}``)."""
    runs = []
    for tr in phenomena.traces(seeds=seeds, classes=classes):
        keep = [i for i, s in enumerate(tr.steps) if (s - 1) % every == 0]
        pick = lambda col: [float(col[i]) for i in keep]  # noqa: E731
        co = {name.removeprefix("actor/"): pick(phenomena.sparse_score(col, cosignals, cosignals_every))
              for name, col in tr.cosignals.items()}
        runs.append({"name": tr.name, "cls": tr.cls, "expect": tr.expect, "onset": tr.onset, "crash": tr.crash,
                     "rise_end": tr.rise_end, "excursion": tr.excursion, "steps": [tr.steps[i] for i in keep],
                     "length": pick(tr.length), "score": pick(phenomena.sparse_score(tr.score, score, score_every)),
                     "k3": pick(tr.k3), "clip": pick(tr.clip), "co": co})
    return runs


# The log forms every class is run in: (label, phenomena_runs keyword arguments)
FORMS = {
    "dense": {},
    "score every 4 steps": {"score": "every", "score_every": 4},
    "score every 10 steps": {"score": "every", "score_every": 10},
    "score every 10, forward-filled": {"score": "filled", "score_every": 10},
    "no score": {"score": "none"},
    "co-signals every 4 steps": {"cosignals": "every"},
    "co-signals every 4, forward-filled": {"cosignals": "filled"},
    "logged every 5 steps": {"every": 5},
    "logged every 10 steps": {"every": 10},
}


def synthetic_runs(directory: Path = SYNTHETIC_DIR) -> list[dict]:
    order = {spec.name: i for i, spec in enumerate(specs())}
    runs = []
    for path in sorted(directory.glob("*.csv"), key=lambda p: (order.get(p.stem, len(order)), p.stem)):
        meta = read_meta(path)
        series = metric_series(load_run(path), "response_length/mean")
        runs.append({"name": path.stem, "cls": meta["class"], "expect": meta["expect"],
                     "onset": int(meta["onset"]) if meta.get("onset") else None,
                     "steps": series.index.tolist(), "length": series.tolist()})
    return runs


def real_runs(directory: Path | None) -> list[dict]:
    runs = []
    for path in sorted(directory.glob("*.csv")) if directory and directory.is_dir() else []:
        if path.stem not in REAL:
            continue
        cls, onset, crash, length, score, clip = REAL[path.stem]
        df = load_run(path)
        series = metric_series(df, length)
        run = {"name": path.stem, "cls": cls, "expect": "fire", "onset": onset, "crash": crash,
               "steps": series.index.tolist(), "length": series.tolist()}
        for key, col in (("score", score), ("clip", clip)):
            if col:
                run[key] = metric_series(df, col).reindex(series.index).tolist()
        runs.append(run)
    return runs


# -- scoring --------------------------------------------------------------------------------------
def outcome(run: dict, fired: int | None) -> str:
    """``hit`` | ``miss`` | ``late`` | ``early`` | ``false alarm`` | ``quiet`` | ``-`` (borderline)."""
    if run["expect"] == "no_fire":
        return "quiet" if fired is None else "false alarm"
    if run["cls"] == "G":
        (e0, e1), ok = run["excursion"], fired is not None
        return "hit" if ok and (e0 <= fired <= e1 + 10 or run["onset"] <= fired < run["crash"]) else "miss"
    if fired is None:
        return "miss" if run["expect"] == "fire" else "-"
    if fired < run["onset"]:
        return "early"
    if run["cls"] in "AIJKOT":
        return "hit" if fired < run["crash"] else "late"
    if run["cls"] == "B":
        return "hit" if fired <= run["rise_end"] else "late"
    return "hit"


def score_all(runs: list[dict], desc: str, rules=None) -> None:
    logging.getLogger("verl_lrstab").setLevel(logging.ERROR)  # one line per detection otherwise
    rules = {n: RULES[n] for n in (rules or RULES)}
    for run in tqdm(runs, desc=desc, disable=None, leave=False):
        run["fired"] = {name: rule(run) for name, rule in rules.items()}


def _lead(run, name):
    f = run["fired"][name]
    return None if f is None or run.get("crash") is None else run["crash"] - f


def summary(groups: dict[str, list[dict]]) -> str:
    names = list(RULES)
    lines = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|" + "---|" * (1 + len(names))]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(n) for n in names) + " |")

    def hits(runs, n):
        return sum(outcome(r, r["fired"][n]) == "hit" for r in runs)

    def leads(runs, n):
        vals = [_lead(r, n) for r in runs if outcome(r, r["fired"][n]) == "hit"]
        return f"{statistics.median(vals):g} / {min(vals)}" if vals else "-"

    for key, runs in groups.items():
        by = {c: [r for r in runs if r["cls"] == c] for c in phenomena.CLASSES}
        if not any(by.values()):
            continue
        tag = "" if key == "dense" else f" ({key})"
        row(f"A detected before the crash{tag} (of {len(by['A'])})", lambda n: str(hits(by["A"], n)))
        row(f"A lead, median / min (steps before accuracy < 0.5){tag}", lambda n: leads(by["A"], n))
        row(f"B detected during the rise{tag} (of {len(by['B'])})", lambda n: str(hits(by["B"], n)))
        row(f"B lead, median / min{tag}", lambda n: leads(by["B"], n))
        row(f"G detected (excursion or surge){tag} (of {len(by['G'])})", lambda n: str(hits(by["G"], n)))
        for c in COSIGNAL_SURGES:
            row(f"{c} detected before the crash{tag} (of {len(by[c])})", lambda n, c=c: str(hits(by[c], n)))
            row(f"{c} lead, median / min{tag}", lambda n, c=c: leads(by[c], n))
        for c in HEALTHY:
            row(f"false alarms on {c}{tag} (of {len(by[c])})",
                lambda n, c=c: str(sum(r["fired"][n] is not None for r in by[c])))
    return "\n".join(lines)


def summary_forms(groups: dict[str, list[dict]], rule: str = "cusum") -> str:
    """One rule across the log forms: the table docs/detector.md carries."""
    keys = list(groups)
    lines = ["| class: figure | " + " | ".join(keys) + " |", "|" + "---|" * (1 + len(keys))]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(groups[k]) for k in keys) + " |")

    def of(runs, c):
        return [r for r in runs if r["cls"] == c]

    def hit(runs, c):
        sel = of(runs, c)
        return f"{sum(outcome(r, r['fired'][rule]) == 'hit' for r in sel)} / {len(sel)}"

    def lead(runs, c):
        vals = [_lead(r, rule) for r in of(runs, c) if outcome(r, r["fired"][rule]) == "hit"]
        return f"{statistics.median(vals):g} / {min(vals)}" if vals else "-"

    row("A: detected before the crash", lambda runs: hit(runs, "A"))
    row("A: lead, median / min", lambda runs: lead(runs, "A"))
    row("B: detected during the rise", lambda runs: hit(runs, "B"))
    row("B: lead, median / min", lambda runs: lead(runs, "B"))
    row("G: detected", lambda runs: hit(runs, "G"))
    for c in COSIGNAL_SURGES:
        row(f"{c}: detected before the crash", lambda runs, c=c: hit(runs, c))
        row(f"{c}: lead, median / min", lambda runs, c=c: lead(runs, c))
    row("T: steps after the length alone, max (<= 2 asked)", lambda runs: _after_length_alone(runs, rule))
    for c in HEALTHY:
        row(f"{c}: false alarms", lambda runs, c=c: f"{sum(r['fired'][rule] is not None for r in of(runs, c))} / "
                                                   f"{len(of(runs, c))}")
    return "\n".join(lines)


def _after_length_alone(runs: list[dict], rule: str = "cusum") -> str:
    """T (the surge twin of a two-step excursion): the most steps ``rule`` fires after ``cusum, length only``
    where that fires at or after the onset (a run it misses while the length alone fires counts as ``miss``)."""
    gaps = []
    for r in runs:
        # where the length alone fires before the onset (on the drift), it is no reference
        if r["cls"] != "T" or (r["fired"].get("cusum, length only") or 0) < r["onset"]:
            continue
        if r["fired"][rule] is None:
            return "miss"
        gaps.append(r["fired"][rule] - r["fired"]["cusum, length only"])
    return f"{max(gaps):+d}" if gaps else "-"


def summary_references(groups: dict[str, list[dict]]) -> str:
    """Per class and log form, ``cusum`` against the rolling z-score and the trailing ratio, side by side.

    Cells: detected before the crash (of the class's runs), the median lead, and the median over
    the runs where both fired of (``cusum``'s step - the reference's step): <= 0 is at or before it;
    the last column against ``cusum`` fed the length alone.
    """
    refs = ("z-score", "trailing ratio", "cusum, length only")
    lines = ["| class | form | detected: `cusum` / z-score / trailing | median lead: `cusum` / z-score / trailing "
             "| median step vs z-score | median step vs trailing | median step vs length alone |",
             "|---|---|---|---|---|---|---|"]

    def med(vals):
        return f"{statistics.median(vals):+g}" if vals else "-"

    for c in SURGES:
        for key, runs in groups.items():
            sel = [r for r in runs if r["cls"] == c]
            if not sel:
                continue
            hits, leads, vs = [], [], []
            for n in ("cusum", *refs[:2]):
                ok = [r for r in sel if outcome(r, r["fired"][n]) == "hit"]
                hits.append(str(len(ok)))
                vals = [_lead(r, n) for r in ok]
                leads.append(f"{statistics.median(vals):g}" if vals else "-")
            for n in refs:
                vs.append(med([r["fired"]["cusum"] - r["fired"][n] for r in sel
                               if r["fired"]["cusum"] is not None and r["fired"][n] is not None]))
            lines.append(f"| {c} | {key} | {' / '.join(hits)} of {len(sel)} | {' / '.join(leads)} | {vs[0]} | {vs[1]} "
                         f"| {vs[2]} |")
    return "\n".join(lines)


def first_cut(trigger: int, origin: str, config: LengthSurgeConfig) -> int:
    """The first update whose LR is cut after a detection at ``trigger``, with ``origin``
    (:func:`verl_lrstab.decay.num_decays` and :func:`~verl_lrstab.decay.decay_period_from_surge`)."""
    period = config.decay_period or decay_period_from_surge(trigger, config.period_factor)
    return next(u for u in range(1, trigger + 2 * period + 2) if num_decays(u, period, origin, trigger) >= 1)


def summary_origins(runs: list[dict]) -> str:
    """Per class, does the first LR cut of the default ``cusum`` land before the crash, per ``origin``?"""
    cfg = LengthSurgeConfig(**OPTIONS)
    lines = ["| class | detected | first cut before the crash, `origin: start` | `origin: surge` | "
             "median first cut - crash, start / surge |", "|---|---|---|---|---|"]
    for c in "ABGIJKO":
        sel = [r for r in runs if r["cls"] == c and r.get("crash") and r["fired"]["cusum"] is not None]
        cells, gaps = [], []
        for origin in ("start", "surge"):
            cuts = [(first_cut(r["fired"]["cusum"], origin, cfg), r["crash"]) for r in sel]
            cells.append(f"{sum(cut < crash for cut, crash in cuts)} / {len(sel)}")
            gaps.append(f"{statistics.median(cut - crash for cut, crash in cuts):+g}" if cuts else "-")
        n = sum(r["cls"] == c for r in runs)
        lines.append(f"| {c} | {len(sel)} of {n} | {cells[0]} | {cells[1]} | {gaps[0]} / {gaps[1]} |")
    return "\n".join(lines)


def summary_synthetic(runs: list[dict], real: list[dict]) -> str:
    names = list(RULES)
    lines = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|" + "---|" * (1 + len(names))]
    must = [r for r in runs if r["expect"] == "fire"]
    calm = [r for r in runs if r["expect"] == "no_fire"]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(n) for n in names) + " |")

    def delays(n):
        return [r["fired"][n] - r["onset"] for r in must if outcome(r, r["fired"][n]) == "hit"]

    row(f"34 traces: surges detected at or after the onset (of {len(must)})", lambda n: str(len(delays(n))))
    row("34 traces: fired before the onset", lambda n: str(sum(outcome(r, r["fired"][n]) == "early" for r in must)))
    row("34 traces: median / max delay after the onset",
        lambda n: f"{statistics.median(delays(n)):g} / {max(delays(n))}" if delays(n) else "-")
    row(f"34 traces: false alarms on no-surge traces (of {len(calm)})",
        lambda n: str(sum(r["fired"][n] is not None for r in calm)))
    for r in real:
        row(f"{r['name']} (onset {r['onset']}, crash {r['crash']}): step (lead)",
            lambda n, r=r: "miss" if r["fired"][n] is None else f"{r['fired'][n]} ({_lead(r, n):+d})")
    return "\n".join(lines)


def per_run_table(runs: list[dict]) -> str:
    names = list(RULES)
    lines = ["| run | class | onset | crash | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|" + "---|" * (4 + len(names))]
    for r in runs:
        cells = []
        for n in names:
            f, o = r["fired"][n], outcome(r, r["fired"][n])
            cell = "-" if f is None else str(f)
            if o in ("miss", "late", "early", "false alarm"):
                cell = f"**{cell} {o}**" if f is not None else f"**{o}**"
            cells.append(cell)
        lines.append(f"| {r['name']} | {r['cls']} | {r.get('onset') or ''} | {r.get('crash') or ''} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


BACK_LINK = "[README](../README.md) · [the surge detector](detector.md)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, default=ROOT / "scripts" / "research" / "traces" / "sparse")
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"seeds per class (default {len(SEEDS)})")
    parser.add_argument("--out", type=lambda text: Path(text) if text else None, default=ROOT / "docs" / "detector_benchmark.md",
                        help="the report to write ('': print only)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the cusum rules, e.g. cusum_score_z=3.0 (repeatable; implies --out '')")
    parser.add_argument("--classes", default=phenomena.CLASSES, help="classes to run, e.g. OPQ (default: all)")
    args = parser.parse_args()
    for item in args.set:
        key, _, value = item.partition("=")
        OPTIONS[key] = yaml.safe_load(value)
    LengthSurgeConfig(**OPTIONS)  # a bad key or value stops here, named
    if OPTIONS:
        args.out = None  # the committed report is the defaults'
    seeds = range(args.seeds)
    groups = {key: phenomena_runs(seeds, classes=args.classes, **kw) for key, kw in FORMS.items()}
    for key, runs in groups.items():
        score_all(runs, key)
    synthetic, real = synthetic_runs(), real_runs(args.real)
    score_all(synthetic + real, "34 traces + real")
    forms = summary_forms(groups)
    versus = summary_references(groups)
    origins = summary_origins(groups["dense"])
    head = summary(groups)
    tail = summary_synthetic(synthetic, real)
    print(forms + "\n\n" + versus + "\n\n" + origins + "\n\n" + head + "\n\n" + tail)
    if args.out:
        defaults = LengthSurgeConfig()
        cfg = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)
               if f.name.startswith("cusum_") or f.name in ("skip_first_steps", "max_surges")}
        args.out.write_text(
            "# Detector benchmark\n" + BACK_LINK + "\n\n" + __doc__.split("\n\n", 1)[1].split("Writes ``--out``")[0].strip()
            + f"\n\nGenerated by `python scripts/research/bench_detector.py` ({args.seeds} seeds per class). "
            f"`cusum` defaults: {', '.join(f'{k}={v}' for k, v in cfg.items())}.\n\n"
            "## `cusum` in every log form\n\n" + forms
            + "\n\n## Against the references, per class and form\n\n" + summary_references.__doc__.split("\n\n")[1]
            .strip().replace("\n    ", " ") + "\n\n" + versus
            + "\n\n## The first LR cut and the crash, per `origin`\n\nDense logs, the default `cusum`; the "
            "first cut is the first update whose LR is decayed (`decay.num_decays`), the period "
            "`decay_period_from_surge` of the detection step.\n\n" + origins
            + "\n\n## Every rule, every class and the 34 traces\n\n" + head + "\n\n" + tail
            + "\n\n## Every run (dense logs)\n\nCells: detection step; **miss** / **late** / **early** / "
            "**false alarm** in bold.\n\n" + per_run_table(groups["dense"])
            + "\n\n## The 34 length-only traces and the real traces\n\n" + per_run_table(synthetic + real) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
