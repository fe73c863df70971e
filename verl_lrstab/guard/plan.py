"""What the guard decides, as pure functions: the run's checkpoint plan, the trouble, the rollback.

No process is started here (:mod:`.supervisor` does that); everything is a function of verl's
config tree, the logged metrics and the checkpoint folder, so it is tested on its own.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.config_checks import config_value
from verl_lrstab.schedule import decay_period_from_surge, replay

logger = logging.getLogger("verl_lrstab")

OPTIM = "actor_rollout_ref.actor.optim"
REASONS = ("surge", "reward_crash", "non_finite")
LENGTH, SCORE = "response_length/mean", "critic/score/mean"
KL, CLIP = "actor/lrstab/mismatch_kl", "actor/lrstab/clip_ratio"
NON_FINITE_KEYS = ("actor/grad_norm", "actor/pg_loss", "actor/loss")
CRASH_WINDOW = 5  # points of the rolling median (as `lrstab compare`)
_STEP_DIR = re.compile(r"global_step_(\d+)$")


class GuardError(ValueError):
    """A guarded launch that cannot work as given (the message names the key and what to set)."""


@dataclass(frozen=True)
class GuardOptions:
    """The guard's options (``lrstab guard --help``).

    Args:
        max_rollbacks (int): rollbacks at most, then the guard stops with status 3. Default 2.
        margin (int): the checkpoint is the newest at or before ``onset - margin`` steps. Default 2.
        on_surge (bool): roll back on the detector's surge. Default True.
        on_reward_crash (bool): roll back when the 5-point rolling median of the score falls
            below ``crash_fraction`` x its earlier peak. Default True.
        on_non_finite (bool): roll back on a NaN/inf loss or grad norm. Default True.
        crash_fraction (float): see ``on_reward_crash``. Default 0.6 (`lrstab compare`'s).
        reseed (bool): change the rollout seed on each rollback (a fresh draw of samples). Default False.
    """

    max_rollbacks: int = 2
    margin: int = 2
    on_surge: bool = True
    on_reward_crash: bool = True
    on_non_finite: bool = True
    crash_fraction: float = 0.6
    reseed: bool = False

    def __post_init__(self):
        if not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            raise GuardError(f"--max-rollbacks must be an integer >= 0, got {self.max_rollbacks!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise GuardError(f"--margin must be an integer >= 0, got {self.margin!r}")
        if not 0 < self.crash_fraction < 1:
            raise GuardError(f"--crash-fraction must be in (0, 1), got {self.crash_fraction!r}")


@dataclass
class RunPlan:
    """What the guard needs from verl's composed config."""

    checkpoint_dir: Path
    save_freq: int
    total_steps: Optional[int]
    keep: Optional[int]
    length_surge: LengthSurgeConfig
    scheduler: str
    rollout_seed: Optional[int]
    warnings: list = field(default_factory=list)


def plan_run(cfg, cwd: Path) -> RunPlan:
    """Check the checkpoint settings of verl's composed config; refuse what can never roll back.

    Args:
        cfg: the composed ``ppo_trainer`` config (OmegaConf) of the guarded command.
        cwd: the directory the command runs in (verl's relative ``default_local_dir`` is under it).
    """
    save_freq = int(config_value(cfg, "trainer.save_freq", -1))
    total = config_value(cfg, "trainer.total_training_steps")
    total = int(total) if total is not None else None
    if save_freq <= 0:
        raise GuardError(f"trainer.save_freq={save_freq}: verl saves no checkpoint, so no rollback could ever find "
                         "one. Set trainer.save_freq to a number of steps (e.g. 10; a rollback costs up to that many)")
    if total is not None and save_freq >= total:
        raise GuardError(f"trainer.save_freq={save_freq} with trainer.total_training_steps={total}: the only "
                         "checkpoint is the last step, so no rollback could ever use one. Set trainer.save_freq "
                         f"below {total}")
    keep = config_value(cfg, "trainer.max_actor_ckpt_to_keep")
    keep = int(keep) if keep is not None else None
    contents = list(config_value(cfg, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer", "extra"]))
    missing = [c for c in ("model", "optimizer", "extra") if c not in contents]
    if missing:
        raise GuardError(f"actor_rollout_ref.actor.checkpoint.save_contents={contents} lacks {missing}: verl cannot "
                         "resume from such a checkpoint. Add them (verl's default is [model, optimizer, extra])")
    warnings = []
    if keep is not None and keep >= 1 and keep * save_freq < 50:
        warnings.append(f"trainer.max_actor_ckpt_to_keep={keep} with trainer.save_freq={save_freq}: verl keeps the "
                        f"last {keep * save_freq} steps of checkpoints; a trouble whose onset lies further back "
                        "than that cannot be rolled back to before it")
    if save_freq > 50:
        warnings.append(f"trainer.save_freq={save_freq}: a rollback costs up to {save_freq} steps")
    options = config_value(cfg, f"{OPTIM}.length_surge", {}) or {}
    from verl_lrstab.glue.configs import plain

    ls = LengthSurgeConfig.from_dict({k: v for k, v in plain(options).items() if k != "_target_"})
    checkpoint_dir = Path(str(config_value(cfg, "trainer.default_local_dir", "checkpoints")))
    if not checkpoint_dir.is_absolute():
        checkpoint_dir = cwd / checkpoint_dir
    seed = config_value(cfg, "actor_rollout_ref.rollout.seed")
    return RunPlan(checkpoint_dir=checkpoint_dir, save_freq=save_freq, total_steps=total, keep=keep,
                   length_surge=ls, scheduler=str(config_value(cfg, f"{OPTIM}.lr_scheduler_type", "constant")),
                   rollout_seed=int(seed) if seed is not None else None, warnings=warnings)


# -- checkpoints ----------------------------------------------------------------------------------
def checkpoint_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the complete verl checkpoints (``global_step_N`` with an ``actor`` folder)."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for d in checkpoint_dir.iterdir()
                  if (m := _STEP_DIR.search(d.name)) and (d / "actor").is_dir())


def choose_checkpoint(steps: list[int], onset: int, margin: int) -> Optional[int]:
    """The newest checkpoint at or before ``onset - margin`` (None if there is none)."""
    usable = [s for s in steps if s <= onset - margin]
    return max(usable) if usable else None


# -- trouble ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trouble:
    """What a rollback answers: ``reason`` (one of :data:`REASONS`), the step it was seen at,
    the step where the guard judges it began, and the surge step (for the decay period)."""

    reason: str
    step: int
    onset: int
    surge_step: Optional[int] = None


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _series(df: pd.DataFrame, key: str) -> pd.Series:
    return pd.to_numeric(df[key], errors="coerce") if key in df else pd.Series(dtype=float)


def trajectory_frame(records: dict[int, dict]) -> pd.DataFrame:
    """verl's logged metrics (``{step: {key: value}}``) as a frame indexed by step."""
    return pd.DataFrame.from_dict(records, orient="index").sort_index()


def find_trouble(records: dict[int, dict], options: GuardOptions, config: LengthSurgeConfig,
                 after: int = 0) -> Optional[Trouble]:
    """The first trouble in the trajectory ``records`` (``{step: metrics}``) seen after step ``after``.

    Surge: the package's detector replayed on the logged length with the co-signals the trainer
    consumed (``actor/lrstab/*``, else verl's score), as ``lrstab replay`` does; its onset is the
    first step of the CUSUM run that led to the alarm (the length left its baseline there).
    Reward crash: the first step whose rolling median score is below ``crash_fraction`` x its
    earlier peak; onset: the step of that peak. Non-finite: a logged NaN/inf loss or grad norm
    (a step that does not log the key is not one); onset: that step.
    """
    found: list[Trouble] = []
    df = trajectory_frame(records)
    if options.on_non_finite:
        for step in sorted(s for s in records if s > after):
            bad = [k for k in NON_FINITE_KEYS if k in records[step] and not _finite(records[step][k])]
            if bad:
                found.append(Trouble("non_finite", step, step))
                break
    if options.on_reward_crash:
        score = _series(df, SCORE).dropna()
        if len(score):
            rolling = score.rolling(CRASH_WINDOW, min_periods=1).median()
            peak = rolling.cummax().shift(1)
            crashed = (peak > 0) & (rolling < options.crash_fraction * peak) & (rolling.index > after)
            if crashed.any():
                step = int(crashed.idxmax())
                before = rolling.loc[:step].iloc[:-1]
                found.append(Trouble("reward_crash", step, int(before.idxmax())))
    if options.on_surge:
        surge = _surge(df, config)
        if surge is not None and surge[0] > after:
            found.append(Trouble("surge", surge[0], surge[1], surge_step=surge[0]))
    return min(found, key=lambda t: (t.step, REASONS.index(t.reason))) if found else None


def _surge(df: pd.DataFrame, config: LengthSurgeConfig) -> Optional[tuple[int, int]]:
    """``(surge step, onset)`` of the detector on the logged trajectory, or None."""
    length = _series(df, LENGTH)
    if length.dropna().empty:
        return None
    cols = {}
    for key, names in (("score", ("actor/lrstab/score", SCORE)), ("mismatch_kl", (KL,)), ("clip_ratio", (CLIP,))):
        name = next((n for n in names if n in df), None)
        cols[key] = _series(df, name).reindex(length.index).tolist() if name else None
    detector = LengthSurgeConfig.from_dict({**config.to_dict(), "monitor_only": True, "decay_from_step": None,
                                            "decay_period": None})
    result = replay(length.index.tolist(), length.tolist(), detector, **cols)
    if result.surge_step is None:
        return None
    steps, cusum = result.steps, result.cusum or []
    onset = result.surge_step
    if cusum:
        i = steps.index(result.surge_step)
        while i > 0 and cusum[i - 1] > 0:
            i -= 1
        onset = steps[i]
    return result.surge_step, onset


# -- the rollback ------------------------------------------------------------------------------------
def decay_period_for(trouble: Trouble, config: LengthSurgeConfig) -> int:
    """The calibrated period of the resumed run: ``period_factor`` x the surge step (the paper's
    second run), or x the onset for a trouble without a surge step."""
    return decay_period_from_surge(trouble.surge_step or trouble.onset, config.period_factor)


def rollback_overrides(checkpoint_dir: Path, checkpoint_step: int, period: int, attempt: int,
                       options: GuardOptions, plan: RunPlan) -> list[str]:
    """The Hydra overrides the guard appends to the user's command for a rollback.

    verl resumes from the chosen checkpoint (its own ``resume_mode=resume_path``); the LR schedule
    becomes ``length_surge`` (if it was not) with the decay started at the checkpoint's step
    (``decay_from_step``: the first halving on the first update after it, then every ``period``),
    which wins over the scheduler state the checkpoint restores.
    """
    out = [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={checkpoint_dir / f'global_step_{checkpoint_step}'}",
        f"{OPTIM}.lr_scheduler_type=length_surge",
        f"++{OPTIM}.length_surge.decay_from_step={checkpoint_step}",
        f"++{OPTIM}.length_surge.decay_period={period}",
        f"++{OPTIM}.length_surge.monitor_only=false",
        f"++{OPTIM}.length_surge.guard_rollbacks={attempt}",
    ]
    if options.reseed:
        out.append(f"actor_rollout_ref.rollout.seed={(plan.rollout_seed or 0) + 1000 * attempt}")
    return out
