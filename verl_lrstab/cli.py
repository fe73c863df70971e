"""``lrstab``: what the length-surge scheduler would do (or did) on logged runs.

    lrstab replay RUN [--metric response_length/mean] [scheduler options] [--plot out.png] [--json]
    lrstab calibrate RUN [scheduler options]
    lrstab compare RUN [RUN ...] [--out DIR]

RUN is verl's file-logger JSONL, a TensorBoard log directory or a CSV with a step column
(:mod:`verl_lrstab.runs`). The detector and the schedule are
:func:`verl_lrstab.schedule.replay`, the code the trainer runs. Exit status: 0 done,
1 unreadable run / missing metric / invalid option value, 2 usage error, 3 ``calibrate``
found no surge.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.runs import (
    MissingMetricError,
    RunError,
    find_metric,
    load_run,
    metric_series,
)
from verl_lrstab.schedule import ReplayResult, decay_scale, replay

# Metric names as verl (and the peers whose exports people compare against) log them.
LENGTH_METRICS = ("response_length/mean", "response_length", "completions/mean_length", "completions_mean_length")
KL_METRICS = ("mismatch/k3", "actor/mismatch/k3", "mismatch/k1", "actor/mismatch/k1", "rollout_corr/k3_kl",
              "rollout_corr/kl")
# Co-signals of detector: cusum in a run logged without length_surge (TRL and wandb exports too).
SCORE_METRICS = ("critic/score/mean", "critic/rewards/mean", "reward", "train/reward")
CLIP_METRICS = ("response_length/clip_ratio", "completions/clipped_ratio", "completions_clipped_ratio")
# What a length_surge run's trainer consumed, logged under actor/lrstab/*: replayed as is.
CONSUMED = {"kl": "actor/lrstab/mismatch_kl", "score": "actor/lrstab/score", "clip": "actor/lrstab/clip_ratio"}
# compare: figure key -> (title, candidates, log-scale y)
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
CRASH_WINDOW = 5  # logged points in the rolling median of the crash rule
EXIT_ERROR, EXIT_NO_SURGE = 1, 3

if TYPE_CHECKING:
    import pandas as pd


# -- scheduler options, generated from LengthSurgeConfig ------------------------------------------
def _field_docs() -> dict[str, tuple[str, str]]:
    """``name -> (type, text)`` from the ``Args:`` section of LengthSurgeConfig's docstring."""
    docs, name = {}, None
    for line in (LengthSurgeConfig.__doc__ or "").splitlines():
        m = re.match(r"\s+(\w+) \(([^)]*)\): (.*)", line)
        if m:
            name = m.group(1)
            docs[name] = (m.group(2), m.group(3).strip())
        elif name and line.strip():
            docs[name] = (docs[name][0], docs[name][1] + " " + line.strip())
    return docs


def _option_value(text: str):
    # YAML scalars, as in a verl config: 1.8, 198, null, start. LengthSurgeConfig checks types.
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 3e-4 as text; a verl config would say 3.0e-4
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "scheduler options", "as under actor_rollout_ref.actor.optim.length_surge; unset ones keep their defaults")
    docs = _field_docs()
    for f in fields(LengthSurgeConfig):
        typ, text = docs.get(f.name, ("", ""))
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=_option_value,
                           default=argparse.SUPPRESS, metavar=typ.split(" ")[0].upper() or "VALUE",
                           help=text.replace("``", "").replace("%", "%%"))
    group.add_argument("--warmup-steps", type=_option_value, default=0, metavar="INT",
                       help="verl's optim.lr_warmup_steps. Default 0.")
    group.add_argument("--score-metric", metavar="NAME",
                       help="co-signal of detector cusum: the score/reward metric, or none (default: what a "
                            f"length_surge run consumed, actor/lrstab/score, else the first of {list(SCORE_METRICS)})")
    group.add_argument("--clip-metric", metavar="NAME",
                       help="co-signal of detector cusum: the clip-ratio metric, or none (default: "
                            f"actor/lrstab/clip_ratio, else the first of {list(CLIP_METRICS)})")


def _config(args: argparse.Namespace) -> LengthSurgeConfig:
    options = {f.name: getattr(args, f.name) for f in fields(LengthSurgeConfig) if hasattr(args, f.name)}
    warmup = args.warmup_steps
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise RunError(f"--warmup-steps={warmup!r} is invalid: allowed values are an integer >= 0")
    try:
        return LengthSurgeConfig.from_dict(options)
    except (ValueError, TypeError) as err:
        raise RunError(re.sub(r"actor_rollout_ref\.actor\.optim\.length_surge\.(\w+)",
                              lambda m: "--" + m.group(1).replace("_", "-"), str(err))) from None


# -- the shared replay ----------------------------------------------------------------------------
def _length_metric(df, name: str | None) -> str:
    if name:
        return name
    found = find_metric(df, LENGTH_METRICS)
    if found is None:
        raise MissingMetricError(LENGTH_METRICS, df.columns, df.attrs.get("source", "run"))
    return found


def _cosignal(df, given: str | None, consumed: str, candidates) -> str | None:
    """The column of a co-signal: ``given`` (``none``: no column); in a length_surge run what its
    trainer consumed (``actor/lrstab/...``, nothing if it logged none); else the first candidate."""
    if given is not None:
        return None if given.lower() == "none" else given
    if find_metric(df, ("actor/lrstab/*", "lrstab/*")) is not None:
        return find_metric(df, (consumed, consumed.removeprefix("actor/")))
    return find_metric(df, candidates)


def cosignal_names(df, config: LengthSurgeConfig, kl_metric=None, score_metric=None, clip_metric=None) -> dict:
    """``{"kl": name|None, "score": ..., "clip": ...}``: the co-signal columns a replay feeds."""
    kl_candidates = (f"mismatch/{config.mismatch_metric}", f"actor/mismatch/{config.mismatch_metric}") + KL_METRICS
    names = {"kl": _cosignal(df, kl_metric, CONSUMED["kl"], kl_candidates), "score": None, "clip": None}
    if config.trigger != "length" and names["kl"] is None and (kl_metric or "").lower() != "none":
        names["kl"] = find_metric(df, kl_candidates)  # a run from before lrstab/mismatch_kl was logged
        if names["kl"] is None:
            raise MissingMetricError(KL_METRICS, df.columns, df.attrs.get("source", "run"))
    if config.detector == "cusum":
        names["score"] = _cosignal(df, score_metric, CONSUMED["score"], SCORE_METRICS)
        names["clip"] = _cosignal(df, clip_metric, CONSUMED["clip"], CLIP_METRICS)
    elif config.trigger == "length":
        names["kl"] = None  # the ratio detector reads the length only
    return names


def _replay_run(df, metric: str, config: LengthSurgeConfig, warmup_steps: int = 0, kl_metric: str | None = None,
                score_metric: str | None = None, clip_metric: str | None = None) -> tuple[ReplayResult, pd.Series]:
    """Replay the run's length metric with its co-signals (see :func:`cosignal_names`); also return the series."""
    values = metric_series(df, metric)
    names = cosignal_names(df, config, kl_metric, score_metric, clip_metric)
    cols = {key: metric_series(df, name).reindex(values.index).tolist() if name else None
            for key, name in names.items()}
    result = replay(values.index.tolist(), values.tolist(), config, warmup_steps=warmup_steps,
                    mismatch_kl=cols["kl"], score=cols["score"], clip_ratio=cols["clip"])
    result.cosignals = {key: name for key, name in names.items() if name}
    return result, values


def _plots():
    try:
        from verl_lrstab import plots
    except ImportError as err:  # matplotlib is an extra: verl does not bring it
        raise RunError(f"figures need matplotlib ({err}): pip install 'verl-lrstab[plot]'") from None
    return plots


def _decay_steps(result: ReplayResult) -> list[int]:
    return [s for s, a, b in zip(result.steps[1:], result.lr_scale, result.lr_scale[1:]) if b < a]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# -- commands -------------------------------------------------------------------------------------
def cmd_replay(args) -> int:
    config = _config(args)
    df = load_run(args.run)
    metric = _length_metric(df, args.metric)
    result, values = _replay_run(df, metric, config, args.warmup_steps, args.kl_metric, args.score_metric,
                                 args.clip_metric)
    if args.plot:
        _plots().plot_replay(values, result.steps, result.lr_scale, result.baseline, result.surge_step, metric,
                             args.plot, title=f"lrstab replay: {Path(args.run).name}")
    if args.json:
        out = {"surge_step": result.surge_step, "decay_period": result.decay_period,
               "steps": result.steps, "lr_scale": result.lr_scale}
        print(json.dumps(out, allow_nan=False))
        return 0
    _print_head(args.run, metric, values, result, config)
    if result.decay_period is not None:
        how = "fixed (--decay-period)" if config.decay_period is not None else \
            f"round({config.period_factor} x {result.trigger_step})"
        print(f"decay period: {result.decay_period} = {how}, origin {config.origin}")
    changes = [f"{_fmt(result.lr_scale[0])} from step {result.steps[0]}"]
    changes += [f"{_fmt(result.lr_scale[result.steps.index(s)])} from {s}" for s in _decay_steps(result)]
    print("LR scale: " + "; ".join(changes))
    if result.decay_period is not None and not _decay_steps(result) and config.origin == "start":
        print(f"(origin start: the first halving is due at step {result.decay_period}, after the run's last step "
              f"{result.steps[-1]}; --origin surge halves right after the surge)")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _print_head(run, metric: str, values, result: ReplayResult, config: LengthSurgeConfig) -> None:
    print(f"run:    {run}")
    print(f"metric: {metric} ({len(values)} values, steps {result.steps[0]}..{result.steps[-1]})")
    if config.detector == "cusum" or result.cosignals:
        print("co-signals: " + (", ".join(result.cosignals.values()) or "none (length only)"))
    line = _surge_line(result)
    if (config.detector == "cusum" and result.surge_step is not None
            and result.ratio[result.steps.index(result.surge_step)] < config.cusum_min_rise):
        line += (f"; below cusum_min_rise {config.cusum_min_rise:g}: the early rule, half the length evidence "
                 "with a co-signal confirming")
    print(line)


def _surge_line(result: ReplayResult) -> str:
    ratios = [(r, s) for r, s in zip(result.ratio, result.steps) if isinstance(r, float) and math.isfinite(r)]
    if result.surge_step is not None:
        i = result.steps.index(result.surge_step)
        ratio, base = _fmt(result.ratio[i]), _fmt(result.baseline[i])
        return f"surge: step {result.surge_step} (level = {ratio} x baseline {base})"
    if not ratios:
        return "surge: none (too few steps after skip_first_steps to form a baseline)"
    r, s = max(ratios)
    return f"surge: none (highest level/baseline ratio {_fmt(r)} at step {s})"


def cmd_calibrate(args) -> int:
    config = _config(args)
    if config.decay_period is not None:
        raise RunError("calibrate computes decay_period from the run: do not pass --decay-period")
    df = load_run(args.run)
    metric = _length_metric(df, args.metric)
    result, values = _replay_run(df, metric, config, args.warmup_steps, args.kl_metric, args.score_metric,
                                 args.clip_metric)
    _print_head(args.run, metric, values, result, config)
    if result.decay_period is None:
        print("lrstab: no surge found: nothing to calibrate (a constant-LR run that surges is needed)",
              file=sys.stderr)
        return EXIT_NO_SURGE
    p, f = result.decay_period, config
    # The LR multiplier at each period boundary, from the schedule's own rule, down to the floor.
    scales = []
    for k in range(1, 20):
        scales.append(f"x{_fmt(decay_scale(k * p, p, f.gamma, f.min_lr_ratio))} from {k * p}")
        if decay_scale(k * p, p, f.gamma, f.min_lr_ratio) <= f.min_lr_ratio:
            break
    print(f"recommended decay_period: {p} = round({f.period_factor} x {result.trigger_step}); LR "
          + ", ".join(scales))
    print("\n# paste into the arm's YAML (under the config root):")
    print("actor_rollout_ref:\n  actor:\n    optim:\n      lr_scheduler_type: length_surge\n"
          f"      length_surge:\n        decay_period: {p}")
    print("\n# or as Hydra overrides of verl's ppo_trainer:")
    print(f"actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge "
          f"+actor_rollout_ref.actor.optim.length_surge.decay_period={p}")
    return 0


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


def score_crash(score, fraction: float = 0.6, window: int = CRASH_WINDOW) -> int | None:
    """The reward crash: the first logged step at which the rolling median of the last ``window``
    logged scores is below ``fraction`` x the highest such median before it. None if it never is,
    or if the scores are never positive (the rule is for accuracies and 0/1 rewards)."""
    rolling = score.rolling(window, min_periods=1).median()
    peak = rolling.cummax().shift(1)
    crashed = (peak > 0) & (rolling < fraction * peak)
    return int(crashed.idxmax()) if crashed.any() else None


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
    row = {"run": label, "last_step": int(df.index.max())}
    length_name = overrides.get("length") or find_metric(df, LENGTH_METRICS)
    marks, collapses = (None, []), []
    if length_name in df.columns:
        result, length = _replay_run(df, length_name, config, args.warmup_steps, args.kl_metric, args.score_metric,
                                     args.clip_metric)
        row.update(surge_step=result.surge_step, decay_period=result.decay_period)
        marks = (result.surge_step, _decay_steps(result))
        step = _cap_collapse(length, args.max_response_length, args.cap_fraction)
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
    if val_name in df.columns:
        val = metric_series(df, val_name)
        row.update(val_metric=val_name, peak_val=float(val.max()), peak_val_step=int(val.idxmax()),
                   final_val=float(val.iloc[-1]))
        step = _val_collapse(val, args.collapse_fraction)
        if step is not None:
            collapses.append((step, f"val < {args.collapse_fraction:g} x peak"))
    if collapses:
        row["collapse_step"], row["collapse_rule"] = min(collapses)
    score_name = overrides.get("score") or find_metric(df, SCORE_METRICS)
    if score_name in df.columns:
        crash = score_crash(metric_series(df, score_name), args.crash_fraction)
        detected = row.get("logged_surge_step", row.get("surge_step"))
        if crash is not None:
            row["crash_step"] = crash
            if detected is not None and not (isinstance(detected, float) and math.isnan(detected)):
                row["lead"] = crash - int(detected)
    return row, marks


def cmd_compare(args) -> int:
    import pandas as pd

    plots = _plots()
    config = _config(args)
    for key in ("collapse_fraction", "cap_fraction", "crash_fraction"):
        value = getattr(args, key)
        if not 0 < value <= 1:
            raise RunError(f"--{key.replace('_', '-')}={value!r} is invalid: allowed values are a number in (0, 1]")
    if args.max_response_length is not None and args.max_response_length < 1:
        raise RunError(f"--max-response-length={args.max_response_length!r} is invalid: allowed values are an "
                       "integer >= 1")
    overrides = {}
    for item in args.metric or []:
        key, sep, name = item.partition("=")
        if not sep or key not in FIGURES:
            raise RunError(f"--metric {item!r}: expected FIGURE=NAME with FIGURE one of {list(FIGURES)}")
        overrides[key] = name
    labels = _labels(args.runs, args.label or [])
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
                curves.append(plots.Curve(label, metric_series(df, name), surge, decays, abandoned,
                                          g[2] if g else []))
                names.append(name)
            elif key in overrides:
                print(f"lrstab: {label} has no metric {overrides[key]} ({key} figure)", file=sys.stderr)
        if not curves:
            print(f"lrstab: figure {key} skipped: no run logs any of {list(candidates)}", file=sys.stderr)
            continue
        path = plots.plot_curves(curves, title, " | ".join(dict.fromkeys(names)), out / f"{key}.png", logy=logy)
        print(f"figure: {path}", file=sys.stderr)

    columns = ["run", "last_step", "peak_val", "peak_val_step", "final_val", "collapse_step", "collapse_rule",
               "surge_step", "decay_period", "logged_surge_step", "crash_step", "lead", "val_metric"]
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

    events_path = Path(path) / EVENTS
    if not events_path.is_file():
        return None
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    final = Path(path) / "metrics.jsonl"
    if not final.exists():
        raise RunError(f"{path}: an lrstab guard run without metrics.jsonl (still running, or stopped before its end)")
    abandoned = [load_run(e["abandoned_metrics"]) for e in rollbacks if Path(e["abandoned_metrics"]).exists()]
    return load_run(final), abandoned, [int(e["checkpoint_step"]) for e in rollbacks]


def _markdown(table) -> str:
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        return _fmt(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.astype(object).itertuples(index=False)]
    return "\n".join(lines)


# -- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lrstab", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the detector's log lines")
    sub = parser.add_subparsers(dest="command", required=True)
    run_help = "verl file-logger JSONL, TensorBoard log directory, or CSV with a step column"

    p = sub.add_parser("replay", help="what the scheduler would do on a logged run")
    p.add_argument("run", help=run_help)
    p.add_argument("--metric", help=f"the response-length metric (default: first of {list(LENGTH_METRICS)})")
    p.add_argument("--kl-metric", help="mismatch KL metric for trigger mismatch|either (default: auto)")
    p.add_argument("--plot", metavar="PNG", help="save the length, baseline and LR scale to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object: surge_step, decay_period, "
                                                       "steps, lr_scale")
    _add_scheduler_options(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("calibrate", help="fixed decay_period from a constant-LR run (the two-run workflow)")
    p.add_argument("run", help=run_help)
    p.add_argument("--metric", help=f"the response-length metric (default: first of {list(LENGTH_METRICS)})")
    p.add_argument("--kl-metric", help="mismatch KL metric for trigger mismatch|either (default: auto)")
    _add_scheduler_options(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("compare", help="curves side by side and a summary table",
                       description="Collapse rule: a run collapsed at the first validation step after its peak "
                                   "from which the score stays below COLLAPSE_FRACTION x peak, or (with "
                                   "--max-response-length) the first step from which the mean length stays at "
                                   "or above CAP_FRACTION x the cap; the earlier of the two.")
    p.add_argument("runs", nargs="+", metavar="RUN", help=run_help)
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
    p.add_argument("--kl-metric", help="mismatch KL metric (default: auto)")
    _add_scheduler_options(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("guard", help="run verl's main_ppo; on a surge, reward crash or NaN, roll back and continue",
                       usage="lrstab guard [options] -- python -m verl.trainer.main_ppo [verl overrides]",
                       description="Supervise verl's own entry point: on trouble, stop it, keep the abandoned "
                                   "segment, resume from the newest checkpoint at or before the onset (verl's "
                                   "resume_mode=resume_path) with the LR halved from there and every P steps after "
                                   "(P = period_factor x the surge step, or x the onset step for a reward crash or a NaN), at most "
                                   "--max-rollbacks times. Exit "
                                   "status: 0 finished, 3 gave up (too many rollbacks or no checkpoint), 4 verl "
                                   "failed, 2 a bad command or option.")
    p.add_argument("--run-dir", help="events, segments and the final metrics (default: next to verl's checkpoints, "
                                     "<trainer.default_local_dir>/../lrstab_guard)")
    p.add_argument("--max-rollbacks", type=int, default=2, help="default 2")
    p.add_argument("--margin", type=int, default=2,
                   help="roll back to the newest checkpoint at or before onset - MARGIN steps (default 2)")
    p.add_argument("--crash-fraction", type=float, default=0.6,
                   help="reward crash: 5-point rolling median score below this x its earlier peak (default 0.6)")
    for name, what in (("surge", "the detector's surge"), ("reward-crash", "a reward crash"),
                       ("non-finite", "a NaN/inf loss or grad norm")):
        p.add_argument(f"--no-{name}", action="store_true", help=f"do not roll back on {what}")
    p.add_argument("--reseed", action="store_true", help="change the rollout seed on each rollback")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m verl.trainer.main_ppo ...")
    p.set_defaults(func=cmd_guard)

    p = sub.add_parser("admit", help="screen rollout configurations' mismatch at LR 0 against a budget",
                       usage="lrstab admit --candidate NAME=\"overrides\" [...] [options] -- python -m "
                             "verl.trainer.main_ppo [verl overrides]",
                       description="Each candidate runs verl's main_ppo for --steps steps at LR 0 (no parameter "
                                   "update: the trainer scores what the rollout sampled); its median "
                                   "actor/mismatch/k3 is judged against the budget (default 5e-4, below the public "
                                   "collapsing runs' 6e-4..1.2e-3), a k3 that grows at LR 0 is a system mismatch, "
                                   "and configurations known to bias the figures are named. Writes admit.json, "
                                   "admit.md and admit.png (each candidate's per-token |d| distribution); the last "
                                   "line printed is the JSON's path.")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME=OVERRIDES",
                   help="a name and its verl overrides, space-separated, env:VAR=VALUE for an environment variable "
                        "(repeatable; NAME= alone: the base command)")
    p.add_argument("--steps", type=int, default=4, help="no-update steps per candidate (default 4)")
    p.add_argument("--budget", type=float, help="a fixed budget on the median k3")
    p.add_argument("--reference", help="calibrate the budget: this candidate's median k3 x --budget-factor")
    p.add_argument("--budget-factor", type=float, default=4.0, help="default 4 (as the mismatch trigger's)")
    p.add_argument("--out", default="lrstab_admit", help="report folder (default lrstab_admit)")
    p.add_argument("--ray-address", help="a running Ray cluster every candidate joins (e.g. auto; default: each "
                                         "candidate starts its own)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m verl.trainer.main_ppo ...")
    p.set_defaults(func=cmd_admit)
    return parser


def cmd_admit(args) -> int:
    from verl_lrstab.admit import Budget
    from verl_lrstab.admit_runner import parse_candidate, print_report, run_candidates
    from verl_lrstab.guard.plan import GuardError

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.budget is not None and args.reference is not None:
            raise ValueError("--budget and --reference are alternatives: give one")
        candidates = [parse_candidate(c) for c in args.candidate]
        budget = Budget(args.budget, "fixed") if args.budget is not None else None
        data = run_candidates(command, candidates, args.steps, Path(args.out), budget=budget,
                              reference=args.reference, factor=args.budget_factor, ray_address=args.ray_address,
                              progress=lambda line: print(f"lrstab admit {line}", file=sys.stderr, flush=True))
    except (ValueError, GuardError) as err:
        print(f"lrstab admit: error: {err}", file=sys.stderr)
        return 2
    print_report(data, Path(args.out))
    print(Path(args.out).resolve() / "admit.json")
    return 0


def cmd_guard(args) -> int:
    from verl_lrstab.guard.plan import GuardError, GuardOptions
    from verl_lrstab.guard.supervisor import Guard

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        options = GuardOptions(max_rollbacks=args.max_rollbacks, margin=args.margin, on_surge=not args.no_surge,
                               on_reward_crash=not args.no_reward_crash, on_non_finite=not args.no_non_finite,
                               crash_fraction=args.crash_fraction, reseed=args.reseed)
        guard = Guard(command, run_dir=Path(args.run_dir) if args.run_dir else None, options=options)
    except GuardError as err:
        print(f"lrstab guard: error: {err}", file=sys.stderr)
        return 2
    logging.getLogger("verl_lrstab").setLevel(logging.WARNING)
    status = guard.run()
    print(guard.run_dir)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lrstab`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("verl_lrstab").setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        return args.func(args)
    except (RunError, OSError) as err:
        print(f"lrstab: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
