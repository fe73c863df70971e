"""``lrstab compare RUN [RUN ...]``: curves side by side and a summary table (collapse, surge, crash)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

from verl_lrstab.cli.common import (
    KL_METRICS,
    LENGTH_METRICS,
    RUN_HELP,
    SCORE_METRICS,
    add_scheduler_options,
    decay_steps,
    fmt,
    scheduler_config,
)
from verl_lrstab.cli.replay import KL_HELP, replay_run, replayed_length
from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.plot_extra import load_plots
from verl_lrstab.reward_crash import CRASH_WINDOW, DEFAULT_FRACTION, reward_crash, score_floor
from verl_lrstab.runs import MissingMetricError, RunError, find_metric, load_run, metric_series

# figure key -> (title, candidates, log-scale y)
FIGURES = {
    "length": ("mean response length", LENGTH_METRICS, False),
    "val": ("validation score", ("val-core/*/acc/mean@*", "val-core/*/reward/mean@*", "val-core/*/mean@*",
                                 "val-core/*"), False),
    "mismatch": ("training-inference mismatch KL", KL_METRICS, True),
    "grad_norm": ("grad norm", ("actor/grad_norm", "grad_norm"), True),
    "entropy": ("entropy", ("actor/entropy", "entropy"), False),
    "lr": ("learning rate", ("actor/lr", "learning_rate", "lr"), False),
    "score": ("training score", SCORE_METRICS, False),
}
SCORE_MIN = "critic/score/min"  # the floor of verl's critic/score/mean (the worst response's score)


def _stays_from(condition) -> int | None:
    """The first step from which ``condition`` (a boolean Series by step) holds to the end."""
    if not condition.iloc[-1]:
        return None
    falses = condition.index[~condition.to_numpy()]
    later = condition.index[condition.index > falses[-1]] if len(falses) else condition.index
    return int(later[0])


def _val_collapse(val, keep_fraction: float) -> int | None:
    """First validation step after the peak from which the score stays below keep_fraction x peak."""
    if val.max() <= 0:
        return None
    return _stays_from(val.loc[val.idxmax():] < keep_fraction * val.max())


def _cap_collapse(length, cap: int | None, fraction: float) -> int | None:
    """First step from which the mean response length stays at or above fraction x cap."""
    return _stays_from(length >= fraction * cap) if cap else None


def score_crash(score, fraction: float = DEFAULT_FRACTION, window: int = CRASH_WINDOW,
                score_min=None) -> int | None:
    """The reward crash's step (:func:`verl_lrstab.reward_crash.reward_crash`, the rule the guard rolls
    back on): the rolling median of the last ``window`` logged scores below ``fraction`` of its
    earlier peak's height above the score's floor (the lowest ``score_min``, verl's
    ``critic/score/min``, when given; else min(0, the lowest score)). None if it never is."""
    found = reward_crash(score, fraction, score_floor(score, score_min), window=window)
    return found[0] if found else None


def _labels(runs: list[str], given: list[str]) -> list[str]:
    """The runs' legend labels: ``--label`` in order, then what tells the rest apart.

    verl's file logger names every run's file the same (``metrics.jsonl``): a file label is its
    stem, widened to as many parent folders as it takes to make the labels distinct
    (``a/metrics`` and ``b/metrics``, not ``metrics`` and ``metrics#2``).
    """
    rest = [Path(r) for r in runs[len(given):]]

    def label(p: Path, depth: int) -> str:
        parts = list(p.with_suffix("").parts) if p.suffix else list(p.parts)
        return "/".join(parts[-depth:])

    depth = 1
    while depth < 8 and len({label(p, depth) for p in rest}) < len(rest):
        depth += 1
    labels = list(given) + [label(p, depth) for p in rest]
    seen: dict[str, int] = {}
    for i, lab in enumerate(labels):
        seen[lab] = seen.get(lab, 0) + 1
        if seen[lab] > 1:
            labels[i] = f"{lab}#{seen[lab]}"
    return labels


def _summary_row(label: str, df, config: LengthSurgeConfig, overrides: dict, args) -> tuple[dict, tuple]:
    """One run's line of the compare table, and its (surge step, decay steps) marks."""
    row: dict[str, Any] = {"run": label, "last_step": int(df.index.max())}
    # the replay reads the length the trainer reads (an agentic run: the model's own tokens); the cap bounds
    # every response token, so the collapse to the cap is looked for on verl's length
    length_name = overrides.get("length") or find_metric(df, LENGTH_METRICS)
    try:
        replayed, _ = replayed_length(df, overrides.get("length"), config)
    except MissingMetricError as err:
        print(f"lrstab: {label}: not replayed, its surge_step and decay_period stay empty: {err}", file=sys.stderr)
        replayed = None
    marks: tuple[Optional[int], list[int]] = (None, [])
    collapses: list[tuple[int, str]] = []
    if replayed is not None and replayed in df.columns:
        result, _ = replay_run(df, replayed, config, args.warmup_steps, args.kl_metric, args.score_metric,
                               args.clip_metric)
        row.update(surge_step=result.surge_step, decay_period=result.decay_period, length_metric=replayed)
        marks = (result.surge_step, decay_steps(result))
    elif replayed is not None:
        print(f"lrstab: {label}: not replayed, its surge_step and decay_period stay empty: it logs no {replayed}",
              file=sys.stderr)
    if length_name is not None and length_name in df.columns:
        step = _cap_collapse(metric_series(df, length_name), args.max_response_length, args.cap_fraction)
        if step is not None:
            collapses.append((step, f"length >= {args.cap_fraction:g} x cap"))
    logged = find_metric(df, ("actor/lrstab/surge_step", "lrstab/surge_step"))
    if logged and metric_series(df, logged).iloc[-1] >= 0:  # -1: no surge yet
        row["logged_surge_step"] = int(metric_series(df, logged).iloc[-1])
        lr_name = find_metric(df, ("actor/lr",))
        if lr_name:  # a run that ran the scheduler: mark what it did, not the replay
            lr = metric_series(df, lr_name)
            marks = (row["logged_surge_step"], [int(t) for t in lr.index[1:][lr.values[1:] < lr.values[:-1]]])
    val_name = overrides.get("val") or find_metric(df, FIGURES["val"][1])
    if val_name is not None and val_name in df.columns:
        val = metric_series(df, val_name)
        row.update(val_metric=val_name, peak_val=float(val.max()), peak_val_step=int(val.idxmax()),
                   final_val=float(val.iloc[-1]))
        step = _val_collapse(val, args.collapse_fraction)
        if step is not None:
            collapses.append((step, f"val < {args.collapse_fraction:g} x peak"))
    if collapses:
        row["collapse_step"], row["collapse_rule"] = min(collapses)
    score_name = overrides.get("score") or find_metric(df, SCORE_METRICS)
    if score_name is not None and score_name in df.columns:
        low = SCORE_MIN if score_name == "critic/score/mean" and SCORE_MIN in df.columns else None
        crash = score_crash(metric_series(df, score_name), args.crash_fraction,
                            score_min=metric_series(df, low) if low else None)
        detected = row.get("logged_surge_step", row.get("surge_step"))
        if crash is not None:
            row["crash_step"] = crash
            if detected is not None and not (isinstance(detected, float) and math.isnan(detected)):
                row["lead"] = crash - int(detected)
    return row, marks


def cmd_compare(args) -> int:
    import pandas as pd

    config = scheduler_config(args)
    # a crash at 1 x the peak would be any dip below it: (0, 1), as the guard's rollback rule
    for key, one_in in (("collapse_fraction", True), ("cap_fraction", True), ("crash_fraction", False)):
        value = getattr(args, key)
        allowed = "(0, 1]" if one_in else "(0, 1)"
        if not (0 < value <= 1 if one_in else 0 < value < 1):
            raise RunError(f"--{key.replace('_', '-')}={value!r} is invalid: allowed values are a number in {allowed}")
    if args.max_response_length is not None and args.max_response_length < 1:
        raise RunError(f"--max-response-length={args.max_response_length!r} is invalid: allowed values are an "
                       "integer >= 1")
    overrides = {}
    for item in args.metric or []:
        key, sep, name = item.partition("=")
        if not sep or key not in FIGURES:
            raise RunError(f"--metric {item!r}: expected FIGURE=NAME with FIGURE one of {list(FIGURES)}")
        overrides[key] = name
    given = args.label or []
    if len(given) > len(args.runs) or not all(lab.strip() for lab in given):
        raise RunError(f"--label given {len(given)} time(s) for {len(args.runs)} run(s)" if len(given) > len(args.runs)
                       else "--label='' is invalid: allowed values are a non-empty name")
    labels = _labels(args.runs, given)
    guarded = [_guard_run(r) for r in args.runs]  # (final metrics, abandoned frames, rollback steps) or None
    runs = [g[0] if g else load_run(r) for r, g in zip(args.runs, guarded)]
    rows, marks = zip(*(_summary_row(label, df, config, overrides, args) for label, df in zip(labels, runs)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    for key, (title, candidates, logy) in FIGURES.items():
        curves, names = [], []
        for label, df, (surge, decays), g in zip(labels, runs, marks, guarded):
            name = overrides.get(key) or find_metric(df, candidates)
            if name is not None and name in df.columns:
                abandoned = [metric_series(a, name) for a in g[1] if name in a.columns] if g else []
                curves.append((label, metric_series(df, name), surge, decays, abandoned, g[2] if g else []))
                names.append(name)
            elif key in overrides:
                print(f"lrstab: {label} has no metric {overrides[key]} ({key} figure)", file=sys.stderr)
        if not curves:
            print(f"lrstab: figure {key} skipped: no run logs "
                  + (overrides[key] if key in overrides else f"any of {list(candidates)}"), file=sys.stderr)
            continue
        plots = load_plots(f"figure {out / f'{key}.png'}")
        if plots is not None:
            path = plots.plot_curves([plots.Curve(*c) for c in curves], title,
                                     " | ".join(dict.fromkeys(names)), out / f"{key}.png", logy=logy)
            print(f"figure: {path}", file=sys.stderr)

    columns = ["run", "last_step", "peak_val", "peak_val_step", "final_val", "collapse_step", "collapse_rule",
               "surge_step", "decay_period", "logged_surge_step", "crash_step", "lead", "val_metric", "length_metric"]
    table = pd.DataFrame(list(rows)).reindex(columns=columns)
    table.to_csv(out / "summary.csv", index=False)
    md = _markdown(table)
    (out / "summary.md").write_text(md + "\n")
    print(md)
    no_val = table.loc[table["val_metric"].isna(), "run"].tolist()
    if no_val:
        print(f"lrstab: {', '.join(map(str, no_val))}: no validation metric logged, so peak_val and final_val stay "
              "empty and no accuracy collapse is looked for (--metric val=NAME names one)", file=sys.stderr)
    print(f"summary: {out / 'summary.csv'}, {out / 'summary.md'}", file=sys.stderr)
    return 0


def _guard_run(path: str):
    """An ``lrstab guard`` run directory: (final metrics, abandoned segments, rollback steps); else None."""
    from verl_lrstab.guard.supervisor import EVENTS
    from verl_lrstab.runs import read_events

    events_path = Path(path) / EVENTS
    if not events_path.is_file():
        return None
    events = read_events(events_path)
    rollbacks = [e for e in events if e.get("event") == "rollback" and isinstance(e.get("abandoned_metrics"), str)
                 and isinstance(e.get("checkpoint_step"), int)]
    final = Path(path) / "metrics.jsonl"
    if not final.exists():
        raise RunError(f"{path}: an lrstab guard run without metrics.jsonl (still running, or stopped before its end)")
    abandoned = [load_run(e["abandoned_metrics"]) for e in rollbacks if Path(e["abandoned_metrics"]).exists()]
    return load_run(final), abandoned, [int(e["checkpoint_step"]) for e in rollbacks]


def _markdown(table) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return fmt(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.astype(object).itertuples(index=False)]
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="curves side by side and a summary table",
                       description="Collapse rule: a run collapsed at the first validation step after its peak "
                                   "from which the score stays below COLLAPSE_FRACTION x peak, or (with "
                                   "--max-response-length) the first step from which the mean length stays at "
                                   "or above CAP_FRACTION x the cap; the earlier of the two.")
    p.add_argument("runs", nargs="+", metavar="RUN", help=RUN_HELP)
    p.add_argument("--out", default="lrstab_compare", help="output directory (default: lrstab_compare)")
    p.add_argument("--label", action="append", help="legend label of each run, in order (default: file name)")
    p.add_argument("--metric", action="append", metavar="FIGURE=NAME",
                   help=f"metric of a figure, FIGURE one of {list(FIGURES)}; repeatable")
    p.add_argument("--collapse-fraction", type=float, default=0.5, help="default 0.5")
    p.add_argument("--max-response-length", type=int, help="data.max_response_length of the runs")
    p.add_argument("--cap-fraction", type=float, default=0.9, help="default 0.9")
    p.add_argument("--crash-fraction", type=float, default=0.6,
                   help="reward crash: the first step whose 5-point rolling median score is below this x its "
                        "earlier peak; lead = crash step - detection step. Default 0.6")
    p.add_argument("--kl-metric", help=KL_HELP)
    add_scheduler_options(p)
    p.set_defaults(func=cmd_compare)
