"""What the guard decides, as pure functions: the run's checkpoint plan, the trouble, the rollback.

No process is started here (:mod:`.supervisor` does that); everything is a function of verl's
config tree, the logged metrics and the checkpoint folder, so it is tested on its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from verl_lrstab.config import OPTIM_KEY, LengthSurgeConfig
from verl_lrstab.mismatch_checks import config_value
from verl_lrstab.guard.errors import GuardError
from verl_lrstab.guard.files import write_atomic
from verl_lrstab.guard.overrides import override
from verl_lrstab.reward_crash import reward_crash
from verl_lrstab.reward_crash import score_floor as _floor
from verl_lrstab.runs import MissingMetricError, length_column
from verl_lrstab.decay import decay_period_from_surge, num_decays
from verl_lrstab.log_replay import replay

logger = logging.getLogger("verl_lrstab")

OPTIM = OPTIM_KEY
REASONS = ("surge", "reward_crash", "non_finite")
LENGTH, SCORE, SCORE_MIN = "response_length/mean", "critic/score/mean", "critic/score/min"
KL, CLIP = "actor/lrstab/mismatch_kl", "actor/lrstab/clip_ratio"
NON_FINITE_KEYS = ("actor/grad_norm", "actor/pg_loss", "actor/loss")
# verl's directory_format "global_step_{}" of an int, matched whole: no leading zero (a user's global_step_011
# is not step 11, whose folder is global_step_11)
_STEP_DIR = re.compile(r"global_step_(0|[1-9]\d*)")


def step_of(name: str) -> Optional[int]:
    """N of a folder named exactly ``global_step_N`` (as verl names its checkpoints), else None:
    ``best_global_step_60``, ``global_step_60.bak`` or ``global_step_060`` are a user's, not verl's."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


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
        non_finite_steps (int): a NaN/inf figure must repeat on this many consecutive logged steps
            before it rolls back (verl itself skips one bad optimizer step). Default 2.
        max_restarts (int): a verl crash outside a rollback (OOM, NCCL, preemption) is retried from
            the newest complete checkpoint at most this many times. Default 1.
        max_resume_tries (int): checkpoints tried, newest first, when verl fails to resume. Default 3.
        skip_batches (int): after a rollback, move verl's dataloader this many batches past the
            checkpoint's position (the batches of the trouble window are not replayed). Default 0.
        from_scratch (bool): the first launch trains from step 0 even though verl's checkpoint
            folder holds ``global_step_N`` folders (they are moved aside first, never overwritten;
            without it such a launch is refused). Default False.
    """

    max_rollbacks: int = 2
    margin: int = 2
    on_surge: bool = True
    on_reward_crash: bool = True
    on_non_finite: bool = True
    crash_fraction: float = 0.6
    reseed: bool = False
    non_finite_steps: int = 2
    max_restarts: int = 1
    max_resume_tries: int = 3
    skip_batches: int = 0
    from_scratch: bool = False

    def __post_init__(self):
        for name in ("on_surge", "on_reward_crash", "on_non_finite", "reseed", "from_scratch"):
            if not isinstance(getattr(self, name), bool):
                raise GuardError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.crash_fraction, (int, float)) or isinstance(self.crash_fraction, bool):
            raise GuardError(f"--crash-fraction must be a number in (0, 1), got {self.crash_fraction!r}")
        if isinstance(self.max_rollbacks, bool) or not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            raise GuardError(f"--max-rollbacks must be an integer >= 0, got {self.max_rollbacks!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise GuardError(f"--margin must be an integer >= 0, got {self.margin!r}")
        if not 0 < self.crash_fraction < 1:
            raise GuardError(f"--crash-fraction must be in (0, 1), got {self.crash_fraction!r}")
        for name, value, low in (("non-finite-steps", self.non_finite_steps, 1), ("max-restarts", self.max_restarts, 0),
                                 ("max-resume-tries", self.max_resume_tries, 1), ("skip-batches", self.skip_batches, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GuardError(f"--{name} must be an integer >= {low}, got {value!r}")


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
    resume_mode: str = "auto"
    lr: Optional[float] = None
    async_save: bool = False
    save_contents: tuple = ("model", "optimizer", "extra")
    batch_size: Optional[int] = None


def _whole(cfg, key: str, default=None) -> Optional[int]:
    """The integer at ``key`` of verl's config (None stays None); a value verl could not count with
    (``abc``, ``2.5``, ``true``, a list) is a :class:`GuardError` naming the key."""
    value = config_value(cfg, key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise GuardError(f"{key}={value}: expected a whole number (verl counts steps and sizes with it)")
    return int(value)


def _number(cfg, key: str) -> Optional[float]:
    value = config_value(cfg, key)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise GuardError(f"{key}={value}: expected a number") from None


def plan_run(cfg, cwd: Path) -> RunPlan:
    """Check the checkpoint settings of verl's composed config; refuse what can never roll back.

    Args:
        cfg: the composed ``ppo_trainer`` config (OmegaConf) of the guarded command.
        cwd: the directory the command runs in (verl's relative ``default_local_dir`` is under it).
    """
    save_freq = _whole(cfg, "trainer.save_freq", -1)
    save_freq = -1 if save_freq is None else save_freq
    total = _whole(cfg, "trainer.total_training_steps")
    if save_freq <= 0:
        raise GuardError(f"trainer.save_freq={save_freq}: verl saves no checkpoint, so no rollback could ever find "
                         "one. Set trainer.save_freq to a number of steps (e.g. 10; a rollback costs up to that many)")
    if total is not None and save_freq >= total:
        raise GuardError(f"trainer.save_freq={save_freq} with trainer.total_training_steps={total}: the only "
                         "checkpoint is the last step, so no rollback could ever use one. Set trainer.save_freq "
                         f"below {total}")
    keep = _whole(cfg, "trainer.max_actor_ckpt_to_keep")
    contents = config_value(cfg, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer", "extra"])
    contents = [contents] if isinstance(contents, str) else list(contents or [])
    missing = [c for c in ("model", "optimizer", "extra") if c not in contents]
    if missing:
        raise GuardError(f"actor_rollout_ref.actor.checkpoint.save_contents={contents} lacks {missing}: verl cannot "
                         "resume from such a checkpoint. Add them (verl's default is [model, optimizer, extra])")
    hdfs = config_value(cfg, "trainer.default_hdfs_dir")
    if hdfs not in (None, "", "null"):
        raise GuardError(f"trainer.default_hdfs_dir={hdfs}: verl 0.9.1 cannot resume from a remote checkpoint "
                         "(its _load_checkpoint raises NotImplementedError), so no rollback could load one. Unset it "
                         "(trainer.default_hdfs_dir=null) and copy the local checkpoints out yourself")
    resume_mode = str(config_value(cfg, "trainer.resume_mode", "auto"))
    if resume_mode not in ("auto", "disable", "resume_path"):
        raise GuardError(f"trainer.resume_mode={resume_mode}: allowed values are auto, disable, resume_path")
    warnings = []
    if keep is not None and keep >= 1 and keep * save_freq < 50:
        warnings.append(f"trainer.max_actor_ckpt_to_keep={keep} with trainer.save_freq={save_freq}: verl keeps the "
                        f"last {keep * save_freq} steps of checkpoints; a trouble whose onset lies further back "
                        "than that cannot be rolled back to before it")
    if save_freq > 50:
        warnings.append(f"trainer.save_freq={save_freq}: a rollback costs up to {save_freq} steps")
    options = config_value(cfg, f"{OPTIM}.length_surge", {}) or {}
    from verl_lrstab.glue.optimizer_subclasses import plain

    ls = LengthSurgeConfig.from_dict({k: v for k, v in plain(options).items() if k != "_target_"})
    checkpoint_dir = Path(str(config_value(cfg, "trainer.default_local_dir", "checkpoints")))
    if not checkpoint_dir.is_absolute():
        checkpoint_dir = cwd / checkpoint_dir
    return RunPlan(checkpoint_dir=checkpoint_dir, save_freq=save_freq, total_steps=total, keep=keep,
                   length_surge=ls, scheduler=str(config_value(cfg, f"{OPTIM}.lr_scheduler_type", "constant")),
                   rollout_seed=_whole(cfg, "actor_rollout_ref.rollout.seed"), warnings=warnings,
                   resume_mode=resume_mode, lr=_number(cfg, f"{OPTIM}.lr"),
                   async_save=bool(config_value(cfg, "actor_rollout_ref.actor.checkpoint.async_save", False)),
                   save_contents=tuple(contents), batch_size=_batch_size(cfg))


def _batch_size(cfg) -> Optional[int]:
    """verl's dataloader batch (``data.gen_batch_size`` or ``data.train_batch_size``, as RayPPOTrainer builds it)."""
    for key in ("data.gen_batch_size", "data.train_batch_size"):
        try:
            value = config_value(cfg, key)
            if value is not None and int(value) > 0:
                return int(value)
        except (TypeError, ValueError):
            continue
    return None


# -- checkpoints ----------------------------------------------------------------------------------
TRACKER = "latest_checkpointed_iteration.txt"  # verl's checkpoint_manager.get_checkpoint_tracker_filename
_SHARD_PREFIX = {"model": "model", "optimizer": "optim", "extra": "extra_state"}


def read_tracker(checkpoint_dir: Path) -> Optional[int]:
    """The step in verl's tracker file (None when it is missing or being written)."""
    try:
        return int((checkpoint_dir / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def write_tracker(checkpoint_dir: Path, step: int) -> None:
    """Rewrite verl's tracker atomically (write + rename): a guard killed in between leaves the old one,
    never an empty file (with which verl's ``auto`` resume would silently train from scratch); a
    failed write (a full or read-only disk) leaves the old one and no temporary file. A tracker that is
    a symlink (a shared tracker kept elsewhere) stays one: the file it points to is rewritten."""
    path = checkpoint_dir / TRACKER
    write_atomic(Path(os.path.realpath(path)) if path.is_symlink() else path, str(step))


def checkpoint_complete(folder: Path, contents=("model", "optimizer", "extra"), tracker: Optional[int] = None,
                        check_tracker: bool = True) -> bool:
    """Whether verl finished writing the checkpoint ``folder`` (``global_step_N``).

    verl 0.9.1's ``RayPPOTrainer._save_checkpoint`` writes, in order: every rank's actor shards
    (``actor/{model,optim,extra_state}_world_size_W_rank_R.pt``, then rank 0's
    ``actor/fsdp_config.json`` with W, behind a barrier), then ``data.pt`` (the dataloader), then
    the tracker. So a checkpoint counts when the tracker is at or past its step (it was written
    after ``data.pt``; skipped with ``async_save``), ``data.pt`` is there, and, for FSDP, each of the
    W ranks' shards of the saved contents. (Megatron writes ``actor/model/``: that folder is asked for.)
    """
    step = step_of(folder.name)
    actor = folder / "actor"
    if step is None or not actor.is_dir() or not (folder / "data.pt").is_file():
        return False
    if check_tracker and (tracker is None or tracker < step):
        return False
    fsdp = actor / "fsdp_config.json"
    if fsdp.is_file():
        try:
            world = int(json.loads(fsdp.read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        need = [_SHARD_PREFIX[c] for c in contents if c in _SHARD_PREFIX]
        return all((actor / f"{p}_world_size_{world}_rank_{r}.pt").is_file() for p in need for r in range(world))
    # Megatron: actor/model/ (dist_ckpt/ or the HF tree) beside the optimizer's; no FSDP shard without
    # rank 0's fsdp_config.json counts (a node-local folder whose rank 0 wrote elsewhere)
    return (actor / "model").is_dir() and not any(actor.glob("*_world_size_*_rank_*.pt"))


def checkpoint_steps(checkpoint_dir: Path, contents=("model", "optimizer", "extra"), check_tracker: bool = True,
                     exclude=()) -> list[int]:
    """Steps of the complete verl checkpoints (:func:`checkpoint_complete`), without ``exclude``."""
    if not checkpoint_dir.is_dir():
        return []
    tracker = read_tracker(checkpoint_dir)
    unread = check_tracker and tracker is None  # verl's own tracker write (not atomic) was cut off: the
    steps = sorted(s for d in checkpoint_dir.iterdir()  # newest save is then not trusted
                   if (s := step_of(d.name)) is not None and s not in exclude
                   and checkpoint_complete(d, contents, tracker, check_tracker and not unread))
    return steps[:-1] if unread and (checkpoint_dir / TRACKER).exists() else steps


def step_folders(checkpoint_dir: Path) -> list[int]:
    """Steps of every ``global_step_N`` folder, complete or not."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(s for d in checkpoint_dir.iterdir() if (s := step_of(d.name)) is not None)


def choose_checkpoint(steps: list[int], onset: int, margin: int) -> Optional[int]:
    """The newest checkpoint at or before ``onset - margin`` (None if there is none)."""
    usable = [s for s in steps if s <= onset - margin]
    return max(usable) if usable else None


def stale_tracker(checkpoint_dir: Path, contents=("model", "optimizer", "extra")) -> Optional[tuple[int, int]]:
    """``(tracker step, newest checkpoint)`` when verl's tracker names a step older than the newest
    checkpoint whose shards and ``data.pt`` are all there (verl writes the tracker last: a save cut
    off just before it, or a tracker edited by hand); else None. The guard trusts the tracker (it is
    verl's own mark of a finished save) and says so, naming both steps."""
    tracker = read_tracker(checkpoint_dir)
    if tracker is None:
        return None
    newer = [s for s in checkpoint_steps(checkpoint_dir, contents, check_tracker=False) if s > tracker]
    return (tracker, max(newer)) if newer else None


def no_checkpoint_reason(complete: list[int], bad: list[int], onset: int, margin: int) -> str:
    """Why no checkpoint answers a trouble with onset ``onset``, in words (the give-up message).

    Args:
        complete: the steps of the complete checkpoints (bad ones included).
        bad: the steps that failed to load.
    """
    limit = onset - margin
    if not complete:
        return "there is no complete checkpoint at all (verl has not finished a save yet)"
    at_or_before = [s for s in complete if s <= limit]
    if at_or_before:  # all of them failed to load
        return (f"the checkpoints at or before step {limit} (onset {onset} - --margin {margin}), steps "
                f"{at_or_before}, failed to load")
    return (f"no checkpoint at or before step {limit} (onset {onset} - --margin {margin}): the oldest is at step "
            f"{min(complete)}, the newest at step {max(complete)}"
            + (f" ({sorted(set(bad))} failed to load)" if bad else "")
            + ("; a smaller --margin would use it" if min(complete) <= onset else ""))


# What verl 0.9.1 prints around a checkpoint's load (recorded from its real main_ppo on CPU, a damaged
# model shard: tests/standin/verl_logs/). Before the load: V0 (RayPPOTrainer._load_checkpoint) prints
# "Load from checkpoint folder: <folder>"; V1 (trainer_base._load_checkpoint, the default) logs
# "Resuming from <folder>, setting global step to N" (its logger is at INFO unless VERL_LOGGING_LEVEL
# says otherwise). A worker's failed torch.load comes back as a Ray traceback through
# "in _load_checkpoint" (both). After the load, fit() logs "Initial validation metrics" (when it
# validates first) and tqdm's "Training Progress" bar.
LOAD_BEGINS = ("Load from checkpoint folder:", ", setting global step to ")
LOADED = ("Training Progress", "Initial validation metrics")
_LOAD_FAILED = re.compile(r"in _?load_checkpoint\b|in load_state_dict\b|SchedulerStateError|"
                          r"ckpt must specify|resume ckpt must")


def checkpoint_failed_to_load(log: str) -> bool:
    """Whether verl's output ``log`` of a launch that logged no step says the checkpoint did not load:
    a traceback through the load (``_load_checkpoint``, a worker's ``load_checkpoint``, a
    ``load_state_dict``), or a death after the load began (:data:`LOAD_BEGINS`) and before it
    ended (:data:`LOADED`) with no traceback (killed while loading). A launch that died before the
    load began, or after it ended (at the first step), does not blame the checkpoint."""
    return _blames(_load_marks(log))


def log_failed_to_load(path: Path, block: int = 1 << 20) -> bool:
    """:func:`checkpoint_failed_to_load` of verl's output file ``path``, read ``block`` characters at a
    time (a long run's output is hundreds of MB: never held whole; a line cut between two blocks is
    read across them). An unreadable file blames nothing."""
    marks: set = set()
    tail = ""
    try:
        with open(path, errors="replace") as f:
            while chunk := f.read(block):
                text = tail + chunk
                marks |= _load_marks(text)
                tail = text[-512:]
    except OSError:
        return False
    return _blames(marks)


def _load_marks(text: str) -> set:
    return ({"loaded"} if any(m in text for m in LOADED) else set()) \
        | ({"failed"} if _LOAD_FAILED.search(text) else set()) \
        | ({"begins"} if any(m in text for m in LOAD_BEGINS) else set()) \
        | ({"traceback"} if "Traceback" in text else set())


def _blames(marks: set) -> bool:
    if "loaded" in marks:
        return False
    return "failed" in marks or ("begins" in marks and "traceback" not in marks)


# -- trouble ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trouble:
    """What a rollback answers: ``reason`` (one of :data:`REASONS`), the step it was seen at,
    the step where the guard judges it began, and the surge step (for the decay period)."""

    reason: str
    step: int
    onset: int
    surge_step: Optional[int] = None


def _as_float(value) -> Optional[float]:
    """``float(value)``, or None where it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _finite(value) -> bool:
    number = _as_float(value)
    return number is not None and math.isfinite(number)


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
    Reward crash: the first step whose rolling median score fell below ``crash_fraction`` of its
    earlier peak's height above the score's floor (:func:`_reward_crash`); onset: the step of that
    peak. Non-finite: a logged NaN/inf loss or grad norm on ``non_finite_steps`` consecutive steps
    (a step that does not log the key breaks the streak); onset: the streak's first step.
    """
    found: list[Trouble] = []
    df = trajectory_frame(records)
    if options.on_non_finite:
        streak: list[int] = []
        for step in sorted(s for s in records if s > after):
            bad = [k for k in NON_FINITE_KEYS if k in records[step] and not _finite(records[step][k])]
            consecutive = bool(streak) and step == streak[-1] + 1
            streak = (streak if consecutive else []) + [step] if bad else []
            if len(streak) >= options.non_finite_steps:  # one bad step is verl's skipped update, not trouble
                found.append(Trouble("non_finite", step, streak[0]))
                break
    if options.on_reward_crash:
        crash = _reward_crash(df, options.crash_fraction, after)
        if crash is not None:
            found.append(crash)
    if options.on_surge:
        surge = _surge(df, config)
        if surge is not None and surge[0] > after:
            found.append(Trouble("surge", surge[0], surge[1], surge_step=surge[0]))
    return min(found, key=lambda t: (t.step, REASONS.index(t.reason))) if found else None


def score_floor(df: pd.DataFrame) -> Optional[float]:
    """The score's floor in the logged trajectory (:func:`verl_lrstab.reward_crash.score_floor`)."""
    return _floor(_series(df, SCORE), _series(df, SCORE_MIN))


def _reward_crash(df: pd.DataFrame, fraction: float, after: int) -> Optional[Trouble]:
    """The reward crash (:func:`verl_lrstab.reward_crash.reward_crash`, the rule `lrstab compare`
    reports) after step ``after``; onset: the step of the peak it fell from."""
    found = reward_crash(_series(df, SCORE), fraction, score_floor(df), after=after)
    return Trouble("reward_crash", found[0], found[1]) if found else None


def _surge(df: pd.DataFrame, config: LengthSurgeConfig) -> Optional[tuple[int, int]]:
    """``(surge step, onset)`` of the detector on the logged trajectory, or None. The length is the one the
    trainer's detector reads (``length_tokens``: the model's own tokens where tools wrote part of a response)."""
    try:
        column, _ = length_column(df, None, config.length_tokens, (LENGTH,))
    except MissingMetricError:
        return None
    length = _series(df, column)
    if length.dropna().empty:
        return None
    def column_of(*names: str) -> Optional[list]:
        name = next((n for n in names if n in df), None)
        return _series(df, name).reindex(length.index).tolist() if name else None

    detector = LengthSurgeConfig.from_dict({**config.to_dict(), "monitor_only": True, "decay_from_step": None,
                                            "decay_period": None})
    result = replay(length.index.tolist(), length.tolist(), detector, score=column_of("actor/lrstab/score", SCORE),
                    mismatch_kl=column_of(KL), clip_ratio=column_of(CLIP))
    if result.surge_step is None:
        return None
    steps, cusum, base = result.steps, result.cusum or [], result.baseline or []
    values = dict(zip(length.index.tolist(), length.tolist()))

    def rising(i: int) -> bool:
        """Step ``i`` belongs to the rise: its CUSUM holds evidence, or its length is above its baseline (a
        batch at or below the baseline resets the CUSUM inside a noisy rise)."""
        above = i < len(base) and math.isfinite(base[i]) and values.get(steps[i], -math.inf) > base[i]
        return (i < len(cusum) and cusum[i] > 0) or above

    i = steps.index(result.surge_step)
    while i > 0 and rising(i - 1):
        i -= 1
    return result.surge_step, steps[i]


# -- the rollback ------------------------------------------------------------------------------------
def decay_period_for(trouble: Trouble, config: LengthSurgeConfig) -> int:
    """The calibrated period of the resumed run: ``period_factor`` x the surge step (the paper's
    second run), or x the onset for a trouble without a surge step."""
    return decay_period_from_surge(trouble.surge_step or trouble.onset, config.period_factor)


LR_SCALE = "actor/lrstab/lr_scale"


def halvings_in_force(step: int, records: dict[int, dict], rule: Optional[tuple[int, int]],
                      gamma: float = 0.5) -> int:
    """How many ``gamma`` decays the LR of update ``step`` carried: the larger of the guard's rule in
    force there (``(decay_from_step, decay_period)`` or None) and the ``actor/lrstab/lr_scale`` the
    trainer logged at that step (the run's own decay; absent when the schedule is not length_surge)."""
    n_rule = 0 if rule is None else num_decays(step, rule[1], "surge", rule[0])
    scale = _as_float((records.get(step) or {}).get(LR_SCALE))
    n_logged = 0
    if scale is not None and math.isfinite(scale) and 0 < scale < 1:
        n_logged = max(0, int(math.floor(math.log(scale) / math.log(gamma) + 0.5)))
    return max(n_rule, n_logged)


def compounded_rule(checkpoint_step: int, period: int, halvings: int) -> tuple[int, int]:
    """``(decay_from_step, decay_period)`` whose first update after the checkpoint runs at
    ``gamma ** (halvings + 1)``: one more decay than the LR in force at the checkpoint (a second
    rollback never raises the LR). The decay's origin moves back ``halvings`` periods; when the
    checkpoint is too early for that (origin < 0), the period shortens to ``checkpoint // halvings``."""
    if halvings <= 0:
        return checkpoint_step, period
    if checkpoint_step - halvings * period < 0:
        period = max(1, checkpoint_step // halvings)
    return max(0, checkpoint_step - halvings * period), period


def rollback_overrides(checkpoint_dir: Path, checkpoint_step: int, period: int, attempt: int,
                       options: GuardOptions, plan: RunPlan, decay_from_step: Optional[int] = None) -> list[str]:
    """The Hydra overrides the guard appends to the user's command for a rollback.

    verl resumes from the chosen checkpoint (its own ``resume_mode=resume_path``); the LR schedule
    becomes ``length_surge`` (if it was not) with the decay started at the checkpoint's step
    (``decay_from_step``: the first halving on the first update after it, then every ``period``),
    which wins over the scheduler state the checkpoint restores. Each is written in Hydra's grammar
    and checked to read back as meant (:func:`.overrides.override`).
    """
    out = resume_overrides(checkpoint_dir, checkpoint_step) + [
        override(f"{OPTIM}.lr_scheduler_type", "length_surge"),
        override(f"++{OPTIM}.length_surge.decay_from_step",
                 checkpoint_step if decay_from_step is None else decay_from_step),
        override(f"++{OPTIM}.length_surge.decay_period", period),
        override(f"++{OPTIM}.length_surge.monitor_only", False),
        override(f"++{OPTIM}.length_surge.guard_rollbacks", attempt),
    ]
    if options.reseed:
        out.append(override("actor_rollout_ref.rollout.seed", (plan.rollout_seed or 0) + 1000 * attempt))
    return out


def resume_overrides(checkpoint_dir: Path, checkpoint_step: int) -> list[str]:
    """verl's own resume from ``global_step_<checkpoint_step>`` (the path quoted as Hydra needs it)."""
    from verl_lrstab.guard.overrides import override

    return [override("trainer.resume_mode", "resume_path"),
            override("trainer.resume_from_path", str(checkpoint_dir / f"global_step_{checkpoint_step}"))]
