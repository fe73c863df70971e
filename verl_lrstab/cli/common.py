"""What every ``lrstab`` subcommand shares: the metric names, the scheduler options (generated from
:class:`~verl_lrstab.config.LengthSurgeConfig`) and the exit statuses."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import yaml

from verl_lrstab.config import OPTIONS_KEY, LengthSurgeConfig, option_docs, options
from verl_lrstab.log_replay import ReplayResult
from verl_lrstab.runs import RunError
from verl_lrstab.dataclass_reader import is_integer

# Metric names as verl (and the peers whose exports people compare against) log them.
LENGTH_METRICS = ("response_length/mean", "response_length", "completions/mean_length", "completions_mean_length")
KL_METRICS = ("mismatch/k3", "actor/mismatch/k3", "mismatch/k1", "actor/mismatch/k1", "rollout_corr/k3_kl",
              "rollout_corr/kl")
# Co-signals of detector: cusum in a run logged without length_surge (TRL and wandb exports too).
SCORE_METRICS = ("critic/score/mean", "critic/rewards/mean", "reward", "train/reward")
CLIP_METRICS = ("response_length/clip_ratio", "completions/clipped_ratio", "completions_clipped_ratio")
RUN_HELP = "verl file-logger JSONL, TensorBoard log directory, or CSV with a step column"
METRIC_HELP = (f"the response-length metric (default: as --length-tokens says, the model-token column where the "
               f"log shows tool output, else the first of {list(LENGTH_METRICS)})")
EXIT_ERROR, EXIT_NO_SURGE = 1, 3


# -- scheduler options, generated from LengthSurgeConfig ------------------------------------------
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


def add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "scheduler options", f"as under {OPTIONS_KEY}; unset ones keep their defaults")
    docs = option_docs()
    for key, spec in options().items():
        typ, text = docs[key]
        # every option is accepted (a guarded or resumed run's options replay); --help lists a user's that
        # replay reads, not those lrstab guard sets on each relaunch nor those read on loading a checkpoint
        group.add_argument(f"--{key.replace('_', '-')}", dest=key, type=_option_value,
                           default=argparse.SUPPRESS, metavar=typ.split(" ")[0].upper(),
                           help=argparse.SUPPRESS if spec.set_by != "user" or not spec.replayed
                           else text.replace("``", "").replace("%", "%%"))
    group.add_argument("--warmup-steps", type=_option_value, default=0, metavar="INT",
                       help="verl's optim.lr_warmup_steps. Default 0.")
    group.add_argument("--score-metric", metavar="NAME",
                       help="co-signal of detector cusum: the score/reward metric, or none (default: what a "
                            f"length_surge run consumed, actor/lrstab/score, else the first of {list(SCORE_METRICS)})")
    group.add_argument("--clip-metric", metavar="NAME",
                       help="co-signal of detector cusum: the clip-ratio metric, or none (default: "
                            f"actor/lrstab/clip_ratio, else the first of {list(CLIP_METRICS)})")


def scheduler_config(args: argparse.Namespace) -> LengthSurgeConfig:
    """The LengthSurgeConfig the options name; a bad value is a RunError naming the option."""
    options = {f.name: getattr(args, f.name) for f in fields(LengthSurgeConfig) if hasattr(args, f.name)}
    warmup = args.warmup_steps
    if not is_integer(warmup) or warmup < 0:
        raise RunError(f"--warmup-steps={warmup!r} is invalid: allowed values are an integer >= 0")
    try:
        # what training refuses, a replay refuses too: it shows what the run's scheduler would do
        return LengthSurgeConfig.from_dict(options).check_training()
    except (ValueError, TypeError) as err:
        raise RunError(re.sub(r"actor_rollout_ref\.actor\.optim\.length_surge\.(\w+)",
                              lambda m: "--" + m.group(1).replace("_", "-"), str(err))) from None


# -- small helpers --------------------------------------------------------------------------------
#: The figure formats matplotlib's Agg canvas writes (``savefig`` picks the format from the suffix).
FIGURE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf")


def figure_path(path: str, flag: str = "--plot") -> str:
    """``path`` if a figure can be written there (a known suffix, an existing folder); else a RunError naming
    ``flag``, raised before any work, so a bad path never costs the result it would have drawn."""
    target = Path(path)
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in FIGURE_FORMATS:
        raise RunError(f"{flag}={path!r} is invalid: allowed values are a file name ending in one of "
                       f"{', '.join('.' + f for f in FIGURE_FORMATS)}")
    if target.is_dir():
        raise RunError(f"{flag}={path!r} is invalid: it is a folder (a file name expected)")
    if not target.parent.is_dir():
        raise RunError(f"{flag}={path!r} is invalid: the folder {str(target.parent)!r} does not exist")
    return path


def decay_steps(result: ReplayResult) -> list[int]:
    """The steps at which the replayed LR scale drops."""
    return [s for s, a, b in zip(result.steps[1:], result.lr_scale, result.lr_scale[1:]) if b < a]


def fmt(x: float) -> str:
    return f"{x:.4g}"
