"""``lrstab calibrate RUN``: a fixed ``decay_period`` from a constant-LR run (the two-run workflow)."""

from __future__ import annotations

import sys

from verl_lrstab.cli.common import (
    EXIT_NO_SURGE,
    METRIC_HELP,
    RUN_HELP,
    add_scheduler_options,
    fmt,
    scheduler_config,
)
from verl_lrstab.cli.replay import KL_HELP, print_head, replay_run, replayed_length
from verl_lrstab.config import OPTIM_KEY, OPTIONS_KEY
from verl_lrstab.decay import decay_scale
from verl_lrstab.runs import RunError, load_run


def cmd_calibrate(args) -> int:
    config = scheduler_config(args)
    if config.decay_period is not None:
        raise RunError("calibrate computes decay_period from the run: do not pass --decay-period")
    if config.monitor_only:
        raise RunError("--monitor-only=True is invalid for calibrate: it computes decay_period from the surge the "
                       "detector finds; allowed values are false (the default)")
    df = load_run(args.run)
    metric, length_read = replayed_length(df, args.metric, config)
    result, values = replay_run(df, metric, config, args.warmup_steps, args.kl_metric, args.score_metric,
                                args.clip_metric)
    print_head(args.run, metric, values, result, config, length_read)
    if result.decay_period is None:
        print("lrstab: no surge found: nothing to calibrate (a constant-LR run that surges is needed)",
              file=sys.stderr)
        return EXIT_NO_SURGE
    p, f = result.decay_period, config
    # The LR multiplier at each period boundary, from the schedule's own rule, down to the floor.
    scales = []
    for k in range(1, 20):
        scales.append(f"x{fmt(decay_scale(k * p, p, f.gamma, f.min_lr_ratio))} from {k * p}")
        if decay_scale(k * p, p, f.gamma, f.min_lr_ratio) <= f.min_lr_ratio:
            break
    print(f"recommended decay_period: {p} = round({f.period_factor} x {result.trigger_step}); LR "
          + ", ".join(scales))
    print("\n# paste into the arm's YAML (under the config root):")
    print("actor_rollout_ref:\n  actor:\n    optim:\n      lr_scheduler_type: length_surge\n"
          f"      length_surge:\n        decay_period: {p}")
    print("\n# or as Hydra overrides of verl's ppo_trainer:")
    print(f"{OPTIM_KEY}.lr_scheduler_type=length_surge +{OPTIONS_KEY}.decay_period={p}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fixed decay_period from a constant-LR run (the two-run workflow)")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--metric", help=METRIC_HELP)
    p.add_argument("--kl-metric", help=KL_HELP)
    add_scheduler_options(p)
    p.set_defaults(func=cmd_calibrate)
