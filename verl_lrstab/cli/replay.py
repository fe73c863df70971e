"""``lrstab replay RUN``: what the scheduler would do on a logged run; also the replay (with its
co-signals) that ``calibrate`` and ``compare`` run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from verl_lrstab.cli.common import (
    CLIP_METRICS,
    KL_METRICS,
    METRIC_HELP,
    RUN_HELP,
    SCORE_METRICS,
    add_scheduler_options,
    decay_steps,
    figure_path,
    fmt,
    LENGTH_METRICS,
    scheduler_config,
)
from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.log_replay import ReplayResult
from verl_lrstab.plot_extra import load_plots
from verl_lrstab.runs import (MissingMetricError, RunError, cosignal_columns, find_metric, length_column, load_run,
                              metric_series, replay_with_cosignals)

if TYPE_CHECKING:
    import pandas as pd

# What a length_surge run's trainer consumed, logged under actor/lrstab/*: replayed as is.
CONSUMED = {"kl": "actor/lrstab/mismatch_kl", "score": "actor/lrstab/score", "clip": "actor/lrstab/clip_ratio"}
KL_HELP = ("the mismatch KL metric (a witness of detector cusum; the trigger of mismatch|either), or none (default: "
           "what a length_surge run consumed, actor/lrstab/mismatch_kl, else mismatch/<mismatch_metric>, else the "
           f"first of {list(KL_METRICS)})")


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
    if config.trigger != "length" and (kl_metric or "").lower() == "none":
        raise RunError(f"--kl-metric none is invalid with --trigger {config.trigger}: that trigger reads the mismatch "
                       "KL; allowed values are a KL column of the run (or leave --kl-metric unset), or --trigger "
                       "length")
    names = {"kl": _cosignal(df, kl_metric, CONSUMED["kl"], kl_candidates), "score": None, "clip": None}
    if config.trigger != "length" and names["kl"] is None and (kl_metric or "").lower() != "none":
        names["kl"] = find_metric(df, kl_candidates)  # a run from before lrstab/mismatch_kl was logged
        if names["kl"] is None:
            raise MissingMetricError.in_run(kl_candidates, df)
    if config.detector == "cusum":
        names["score"] = _cosignal(df, score_metric, CONSUMED["score"], SCORE_METRICS)
        names["clip"] = _cosignal(df, clip_metric, CONSUMED["clip"], CLIP_METRICS)
    elif config.trigger == "length":
        names["kl"] = None  # the ratio detector reads the length only
    return names


def replay_run(df, metric: str, config: LengthSurgeConfig, warmup_steps: int = 0, kl_metric: str | None = None,
               score_metric: str | None = None, clip_metric: str | None = None) -> tuple[ReplayResult, pd.Series]:
    """Replay the run's length metric with its co-signals (see :func:`cosignal_names`); also return the series."""
    values = metric_series(df, metric)
    negative = [int(s) for s in values.index if s < 0]
    if negative:
        raise RunError(f"{df.attrs.get('source', 'run')}: {len(negative)} negative step number(s) (first: "
                       f"{negative[0]}) for {metric}: a step counts the optimizer updates from 0; fix the step "
                       "column (a CSV's step, a JSONL's \"step\")")
    names = cosignal_names(df, config, kl_metric, score_metric, clip_metric)
    cols = {key: metric_series(df, name).reindex(values.index).tolist() if name else None
            for key, name in names.items()}
    verl = cosignal_columns(df) if config.detector == "cusum" else {}  # entropy, grad norm, KL loss, PPO clip
    result = replay_with_cosignals(values.index.tolist(), values.tolist(), config, warmup_steps=warmup_steps,
                                   mismatch_kl=cols["kl"], score=cols["score"], clip_ratio=cols["clip"],
                                   cosignals={k: metric_series(df, c).reindex(values.index).tolist()
                                              for k, c in verl.items()})
    result.cosignals = {**{key: name for key, name in names.items() if name}, **verl}
    return result, values


#: What each way to fire of ``detector: cusum`` says (docs/detector.md tables them).
FIRED_BY = {"score": "the score fell with the length up", "witnesses": "two witnesses rose with the length",
            "length": "the length alone: no witness logged", "runaway": "the length ran away",
            "return": "a return to an earlier high collapsed"}


def replayed_length(df, metric: str | None, config: LengthSurgeConfig) -> tuple[str, str]:
    """``(column, what it counts)`` of the length a replay reads (:func:`verl_lrstab.runs.length_column`)."""
    return length_column(df, metric, config.length_tokens, LENGTH_METRICS)


def print_head(run, metric: str, values, result: ReplayResult, config: LengthSurgeConfig,
               length_read: str | None = None) -> None:
    """The run, its metric (and what it counts), the co-signals fed and the surge line (replay and calibrate)."""
    print(f"run:    {run}")
    print(f"metric: {metric} ({len(values)} values, steps {result.steps[0]}..{result.steps[-1]})")
    if length_read:
        print(f"length: {length_read} [length_tokens: {config.length_tokens}]")
    if config.detector == "cusum" or result.cosignals:
        print("co-signals: " + (", ".join(result.cosignals.values()) or "none (length only)"))
    line = _surge_line(result)
    if result.fired_by is not None:
        line += f"; fired by: {result.fired_by} ({FIRED_BY[result.fired_by]})"
    print(line)


def _surge_line(result: ReplayResult) -> str:
    ratios = [(r, s) for r, s in zip(result.ratio, result.steps) if isinstance(r, float) and math.isfinite(r)]
    if result.surge_step is not None:
        i = result.steps.index(result.surge_step)
        ratio, base = fmt(result.ratio[i]), fmt(result.baseline[i])
        return f"surge: step {result.surge_step} (level = {ratio} x baseline {base})"
    if not ratios:
        return "surge: none (too few steps after skip_first_steps to form a baseline)"
    r, s = max(ratios)
    return f"surge: none (highest level/baseline ratio {fmt(r)} at step {s})"


def cmd_replay(args) -> int:
    config = scheduler_config(args)
    if args.plot:
        figure_path(args.plot)
    df = load_run(args.run)
    metric, length_read = replayed_length(df, args.metric, config)
    result, values = replay_run(df, metric, config, args.warmup_steps, args.kl_metric, args.score_metric,
                                args.clip_metric)
    plots = load_plots(f"figure {args.plot}") if args.plot else None
    if plots is not None:
        plots.plot_replay(values, result.steps, result.lr_scale, result.baseline, result.surge_step,
                          metric, args.plot, title=f"lrstab replay: {Path(args.run).name}")
    if args.json:
        out = {"surge_step": result.surge_step, "decay_period": result.decay_period,
               "steps": result.steps, "lr_scale": result.lr_scale}
        print(json.dumps(out, allow_nan=False))
        return 0
    print_head(args.run, metric, values, result, config, length_read)
    if result.decay_period is not None:
        how = "fixed (--decay-period)" if config.decay_period is not None else \
            f"round({config.period_factor} x {result.trigger_step})"
        print(f"decay period: {result.decay_period} = {how}, origin {config.origin}")
    changes = [f"{fmt(result.lr_scale[0])} from step {result.steps[0]}"]
    changes += [f"{fmt(result.lr_scale[result.steps.index(s)])} from {s}" for s in decay_steps(result)]
    print("LR scale: " + "; ".join(changes))
    if result.decay_period is not None and not decay_steps(result) and config.origin == "start":
        print(f"(origin start: the first halving is due at step {result.decay_period}, after the run's last step "
              f"{result.steps[-1]}; --origin surge halves right after the surge)")
    if plots is not None:
        print(f"plot: {args.plot}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="what the scheduler would do on a logged run")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--metric", help=METRIC_HELP)
    p.add_argument("--kl-metric", help=KL_HELP)
    p.add_argument("--plot", metavar="PNG",
                   help="save the length, baseline and LR scale to this figure (.png, .pdf, .svg, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object: surge_step, decay_period, "
                                                       "steps, lr_scale")
    add_scheduler_options(p)
    p.set_defaults(func=cmd_replay)
