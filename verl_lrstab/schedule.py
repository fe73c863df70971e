"""The paper's decay rule: small pure functions and the schedule's state (pure Python).

Conventions (the same as verl's): ``u`` is the 1-based index of an actor update
(verl's global step when every step updates the actor). The torch scheduler's
``last_epoch`` counts completed updates, so while update ``u`` runs,
``last_epoch == u - 1`` and the LR in force is::

    lr0 * warmup_scale(u - 1, W) * decay_scale(u, ...)

verl logs ``actor/lr`` after stepping the scheduler, i.e. the LR of the next update.
The torch scheduler that wraps this lives in :mod:`verl_lrstab.scheduler`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from verl_lrstab._numbers import finite_float
from verl_lrstab.config import OPTIONS_KEY, LengthSurgeConfig
from verl_lrstab.cusum import CusumDetector, CusumState
from verl_lrstab.detector import RatioState, SurgeDetector
from verl_lrstab.mismatch_trigger import MismatchTrigger, MismatchTriggerState
from verl_lrstab.dataclass_reader import from_state, is_integer, require

#: The detectors by ``length_surge.detector`` (one interface: ``update``, ``observe``, ``metrics``, ``reads``,
#: ``state_dict``), and the dataclasses their states are.
DETECTORS: "dict[str, type[CusumDetector | SurgeDetector]]" = {"cusum": CusumDetector, "ratio": SurgeDetector}
DETECTOR_STATES = {"cusum": CusumState, "ratio": RatioState}
#: What started the decay: the length detector, the mismatch trigger, the guard's ``decay_from_step``.
TRIGGER_SOURCES = ("length", "mismatch", "guard")


@dataclass
class ScheduleState:
    """:meth:`LengthSurgeSchedule.state_dict` as a dataclass (saved as plain types: ``dataclasses.asdict``)."""

    detector_kind: str  # length_surge.detector
    detector: dict  # the detector's state (DETECTOR_STATES[detector_kind], read as such)
    trigger_step: Optional[int]  # the update that started the decay
    trigger_source: Optional[str]  # TRIGGER_SOURCES
    # the last update's figures as consumed (NaN: not fed), logged until the next update's
    response_length: float
    mismatch_kl: float
    score: float
    clip_ratio: float
    mismatch_trigger: Optional[dict]  # the mismatch trigger's (MismatchTriggerState, read as such); None with trigger: length

    def __post_init__(self):
        require(self.detector_kind in DETECTORS, "detector_kind", self.detector_kind, f"one of {list(DETECTORS)}")
        if self.detector_kind in DETECTORS:  # the detector's own fields, read as its state dataclass
            from_state(DETECTOR_STATES[self.detector_kind], self.detector, "detector")
        if self.mismatch_trigger is not None:
            from_state(MismatchTriggerState, self.mismatch_trigger, "mismatch_trigger")
        require(self.trigger_step is None or self.trigger_step >= 0, "trigger_step", self.trigger_step,
                "null or an integer >= 0")
        require(self.trigger_source is None or self.trigger_source in TRIGGER_SOURCES, "trigger_source",
                self.trigger_source, f"null or one of {list(TRIGGER_SOURCES)}")

    @classmethod
    def from_state(cls, state) -> "ScheduleState":
        return from_state(cls, state)

logger = logging.getLogger("verl_lrstab")


# -- the rule as small pure functions (cf. transformers/optimization.py) ----------------------
def decay_period_from_surge(surge_step: int, period_factor: float = 1.8) -> int:
    """``P = round(period_factor * surge_step)`` (half up), at least 1. Paper: 110 -> 198."""
    return max(1, int(math.floor(period_factor * surge_step + 0.5)))


def num_decays(update: int, period: Optional[int], origin: str = "start", surge_step: Optional[int] = None) -> int:
    """How many times the LR has been multiplied by ``gamma`` when update ``update`` runs.

    ``origin="start"``: ``update // period``. ``origin="surge"``: 0 up to the surge's own
    update, 1 from the next update on, then one more every ``period`` updates.
    """
    if period is None:
        return 0
    if origin == "surge" and surge_step is not None:
        return 0 if update <= surge_step else 1 + (update - surge_step - 1) // period
    return max(0, update) // period


def decay_scale(update: int, period: Optional[int], gamma: float = 0.5, min_lr_ratio: float = 0.1,
                origin: str = "start", surge_step: Optional[int] = None) -> float:
    """``max(min_lr_ratio, gamma ** n)`` with ``n = num_decays(...)``; 1.0 before any decay."""
    n = num_decays(update, period, origin, surge_step)
    return 1.0 if n == 0 else max(min_lr_ratio, gamma**n)


def warmup_scale(completed_updates: int, warmup_steps: int) -> float:
    """verl's constant-with-warmup factor (``get_constant_schedule_with_warmup``)."""
    if completed_updates < warmup_steps:
        return float(completed_updates) / float(max(1, warmup_steps))
    return 1.0


# -- the schedule's state, pure (shared by the trainer and `lrstab replay`) -------------------
class LengthSurgeSchedule:
    """Detector(s) + decay rule. One ``observe`` per actor update, then ``scale(...)``.

    Args:
        config (LengthSurgeConfig | Mapping | None): options; None gives the paper's defaults.
        warmup_steps (int): verl's LR warmup (``optim.lr_warmup_steps``, resolved). Default 0.
    """

    def __init__(self, config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None, warmup_steps: int = 0):
        self.config = LengthSurgeConfig.from_dict(config)
        if not is_integer(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.detector = DETECTORS[self.config.detector](self.config)
        self.mismatch_trigger = _make_mismatch_trigger(self.config)
        self.trigger_step: Optional[int] = None  # the update that started the decay
        self.trigger_source: Optional[str] = None  # TRIGGER_SOURCES: what started the decay (logged on resume)
        self.response_length = math.nan  # last values consumed
        self.mismatch_kl = math.nan
        self.score = math.nan
        self.clip_ratio = math.nan
        self.cosignals: dict = {}  # the last update's own figures the detector read (logged with the step)
        self._force_decay()

    def _force_decay(self) -> None:
        """``decay_from_step`` (the guard's rollback) wins over the detector and over a checkpoint."""
        if self.config.decay_from_step is not None:
            self.trigger_step, self.trigger_source = self.config.decay_from_step, "guard"

    @property
    def surge_step(self) -> Optional[int]:
        return self.detector.surge_step

    @property
    def decay_period(self) -> Optional[int]:
        if self.config.monitor_only:
            return None
        if self.config.decay_period is not None:
            return self.config.decay_period
        if self.trigger_step is None:
            return None
        return decay_period_from_surge(self.trigger_step, self.config.period_factor)

    def observe(self, update: int, response_length: Optional[float] = None,
                mismatch_kl: Optional[float] = None, score: Optional[float] = None,
                clip_ratio: Optional[float] = None) -> bool:
        """Feed the figures of update ``update``; return True if the decay is triggered now.

        ``score`` (verl's ``critic/score/mean``) and ``clip_ratio`` (``response_length/clip_ratio``)
        are co-signals of ``detector: cusum``, as is ``mismatch_kl``; None (or NaN) means
        unavailable. ``detector: ratio`` reads the length only. An ``update`` at or before the last
        one fed (a counter that went backwards) is not fed: a warning names both.
        """
        last = self.detector.last_step
        if last is not None and update <= last:
            logger.warning("verl_lrstab: the update counter went back from %s to %s: the figures of update %s are "
                           "not fed to the surge detector (its history is ordered by update)", last, update, update)
            return False
        self.response_length = _or_nan(finite_float(response_length))
        self.mismatch_kl = _or_nan(finite_float(mismatch_kl))
        self.score = _or_nan(finite_float(score))
        self.clip_ratio = _or_nan(finite_float(clip_ratio))
        self.cosignals = {}
        length_fired = self.detector.update(update, response_length, score=score, kl=mismatch_kl, clip_ratio=clip_ratio)
        mismatch_fired = False
        if self.mismatch_trigger is not None and mismatch_kl is not None:
            mismatch_fired = self.mismatch_trigger.update(update, mismatch_kl)
        if self.trigger_step is not None or self.config.monitor_only:
            return False
        source = None
        if length_fired and self.config.trigger in ("length", "either"):
            source = "length"
        elif mismatch_fired and self.config.trigger in ("mismatch", "either"):
            source = "mismatch"
        if source is None:
            return False
        self.trigger_step, self.trigger_source = update, source
        logger.warning("verl_lrstab: %s surge at update %d; decay period %s, origin %s", source, update,
                       self.decay_period, self.config.origin)
        return True

    def observe_cosignals(self, cosignals: Mapping[str, float], update: Optional[int] = None) -> None:
        """Feed an update's own figures (verl's ``grad_norm``, ``kl_loss``, ``pg_clipfrac``, entropy) after its
        decision: the detector reads them from the next decision on. ``update`` defaults to the update last
        observed; before any, nothing is fed. The ones the detector reads are logged with the update."""
        self.cosignals = {}
        update = self.detector.last_step if update is None else update
        if update is None or not cosignals:
            return
        self.detector.observe(update, **cosignals)
        self.cosignals = {name: value for name, value in cosignals.items() if name in self.detector.reads}

    def decay_scale(self, update: int) -> float:
        """The decay multiplier in force while update ``update`` runs."""
        cfg = self.config
        origin = "surge" if cfg.decay_from_step is not None else "start" if cfg.decay_period is not None else cfg.origin
        return decay_scale(update, self.decay_period, cfg.gamma, cfg.min_lr_ratio, origin, self.trigger_step)

    def scale(self, completed_updates: int) -> float:
        """LR / initial LR once ``completed_updates`` updates are done (for the next update)."""
        return warmup_scale(completed_updates, self.warmup_steps) * self.decay_scale(completed_updates + 1)

    def state_dict(self) -> dict:
        """The state, :class:`ScheduleState` as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        return dataclasses.asdict(ScheduleState(
            detector_kind=self.config.detector, detector=self.detector.state_dict(), trigger_step=self.trigger_step,
            trigger_source=self.trigger_source, response_length=self.response_length, mismatch_kl=self.mismatch_kl,
            score=self.score, clip_ratio=self.clip_ratio,
            mismatch_trigger=None if self.mismatch_trigger is None else self.mismatch_trigger.state_dict()))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (read as :class:`ScheduleState`: a field missing, unknown or of another type
        raises :class:`~verl_lrstab.dataclass_reader.StateFieldError` naming it). A checkpoint without the mismatch
        trigger's state (written with ``trigger: length``) leaves this run's trigger to calibrate afresh."""
        saved = ScheduleState.from_state(state)
        if saved.detector_kind != self.config.detector:
            raise ValueError(f"the checkpoint's length-surge state was written by detector {saved.detector_kind!r}, "
                             f"the config says {OPTIONS_KEY}.detector={self.config.detector!r}: "
                             f"set detector: {saved.detector_kind} to resume this run")
        self.detector.load_state_dict(state["detector"])
        self.trigger_step, self.trigger_source = saved.trigger_step, saved.trigger_source
        if saved.trigger_step is not None:
            logger.info("verl_lrstab: resumed with the LR decay started at update %d by the %s trigger",
                        saved.trigger_step, saved.trigger_source)
        self.response_length, self.mismatch_kl = saved.response_length, saved.mismatch_kl
        self.score, self.clip_ratio = saved.score, saved.clip_ratio
        if self.mismatch_trigger is not None and saved.mismatch_trigger is not None:
            self.mismatch_trigger.load_state_dict(state["mismatch_trigger"])
        self._force_decay()

    def metrics(self, completed_updates: int) -> dict:
        """Figures for verl's logger (keys documented in docs/metrics.md); no value is invented."""
        out = {
            "lrstab/surge_step": -1 if self.surge_step is None else self.surge_step,
            "lrstab/trigger_step": -1 if self.trigger_step is None else self.trigger_step,
            "lrstab/decay_period": -1 if self.decay_period is None else self.decay_period,
            "lrstab/lr_scale": self.scale(completed_updates),
            "lrstab/skipped_steps": self.detector.num_skipped,
        }
        # the score is logged whichever detector runs: it is what the glue fed (verl's critic/score/mean);
        # the mismatch KL and the clip ratio when the detector reads them
        fed = [("response_length", self.response_length), ("score", self.score)]
        fed += [(k, v) for k, v in (("mismatch_kl", self.mismatch_kl), ("clip_ratio", self.clip_ratio))
                if k in self.detector.reads]
        for key, value in fed:
            if math.isfinite(value):
                out[f"lrstab/{key}"] = value
        for key, value in {**self.detector.metrics(), **self.cosignals}.items():
            out[f"lrstab/{key}"] = value
        if self.mismatch_trigger is not None and self.mismatch_trigger.budget is not None:
            out["lrstab/mismatch_budget"] = self.mismatch_trigger.budget
        if self.config.guard_rollbacks:
            out["lrstab/rollbacks"] = self.config.guard_rollbacks
        return out


def _make_mismatch_trigger(config: LengthSurgeConfig):
    return None if config.trigger == "length" else MismatchTrigger(config)


def _or_nan(value: Optional[float]) -> float:
    return math.nan if value is None else value


# -- the torch and megatron-core schedulers around it -----------------------------------------
@dataclass(frozen=True)
class UpdateFigures:
    """The figures of one trainer step's actor update(s), as the scheduler is fed them (None: unavailable).

    The batch's figures, measured before the update: ``response_length`` (verl's
    ``response_length/mean``), ``mismatch_kl`` (the trigger's and cusum's mismatch figure),
    ``score`` (``critic/score/mean``) and ``clip_ratio`` (the share of responses at the cap).
    ``cosignals``: what the update itself logged (``grad_norm``, ``kl_loss``, ``pg_clipfrac``,
    ``entropy``), which exists only after it. ``updates_per_step``: the actor updates of the
    trainer step (verl's ``separate_async``: several; None: unchanged), see
    :meth:`FedSchedule.set_updates_per_step`.
    """

    response_length: Optional[float] = None
    mismatch_kl: Optional[float] = None
    score: Optional[float] = None
    clip_ratio: Optional[float] = None
    cosignals: Mapping[str, float] = field(default_factory=dict)
    updates_per_step: Optional[int] = None

    @property
    def has_batch_figures(self) -> bool:
        return any(v is not None for v in (self.response_length, self.mismatch_kl, self.score, self.clip_ratio))


def cosignal_figures(**figures: Optional[float]) -> dict:
    """The update's own figures given (``entropy=..., grad_norm=...``), the None ones left out."""
    return {name: value for name, value in figures.items() if value is not None}


class FedSchedule:
    """What the torch (``LengthSurgeLR``) and megatron-core schedulers share: a ``schedule``
    (:class:`LengthSurgeSchedule`) fed through :meth:`observe_update` (the verl glue's one way in)
    before verl's engine steps the scheduler without arguments; explicit ``step()`` arguments win."""

    schedule: LengthSurgeSchedule
    _held: bool = False
    _waiting: Optional[UpdateFigures] = None  # handed by observe_update, consumed by the next step
    _updates_per_step: int = 1
    _warmup_in_updates: Optional[int] = None  # the warmup as configured (in actor updates)

    def metrics(self) -> dict:
        """The ``lrstab/*`` figures of the last step: each scheduler's own (the glue logs them)."""
        raise NotImplementedError

    def observe_update(self, figures: UpdateFigures) -> None:
        """Hand the scheduler one trainer step's figures.

        The batch's figures wait for the next ``step()``, which feeds them to the schedule once
        (handed again before that step, they replace the waiting ones). The co-signals exist
        only once the update ran, after its step: they are observed at once, under the update
        last stepped (the detector reads them from its next decision on).
        """
        if figures.updates_per_step is not None:
            self.set_updates_per_step(figures.updates_per_step)
        if figures.has_batch_figures:
            self._waiting = figures
        if figures.cosignals or not figures.has_batch_figures:
            self.schedule.observe_cosignals(figures.cosignals)

    @property
    def figures_waiting(self) -> bool:
        """Batch figures were handed and no step has consumed them yet."""
        return self._waiting is not None

    def set_updates_per_step(self, count: int) -> None:
        """Run ``count`` actor updates per trainer step (verl's ``separate_async``), the LR held within a step.

        verl resolves the warmup in actor updates (V1 multiplies its total by the updates per
        step); the scheduler steps once per trainer step, so its warmup becomes
        ``ceil(warmup / count)`` trainer steps.
        """
        if count > 1 and count != self._updates_per_step:
            if self._warmup_in_updates is None:
                self._warmup_in_updates = self.schedule.warmup_steps
            self._updates_per_step = count
            self.schedule.warmup_steps = -(-self._warmup_in_updates // count)

    @property
    def updates_per_step(self) -> int:
        return self._updates_per_step

    @contextlib.contextmanager
    def holding(self):
        """Within the block ``step()`` keeps the LR and feeds nothing: the actor updates of one
        trainer step (verl's ``separate_async``) share one LR, and the step's figures are fed once."""
        self._held = True
        try:
            yield self
        finally:
            self._held = False

    def _observe_waiting(self, update: int, given: UpdateFigures) -> None:
        """Feed update ``update`` to the schedule, consuming the waiting figures (never reused); the ones
        ``given`` to ``step()`` win, figure by figure. Its ``cosignals`` (the update's own figures) are
        observed under ``update`` after its decision, as :meth:`observe_update` does once the update ran:
        both ways in decide alike."""
        waiting, self._waiting = self._waiting or UpdateFigures(), None
        pick = lambda name: getattr(waiting if getattr(given, name) is None else given, name)  # noqa: E731
        self.schedule.observe(update, pick("response_length"), pick("mismatch_kl"), score=pick("score"),
                              clip_ratio=pick("clip_ratio"))
        if given.cosignals:
            self.schedule.observe_cosignals(given.cosignals, update)

    def _restore_schedule(self, own: Optional[dict], step) -> None:
        """Restore the schedule's state from a checkpoint (one behaviour for both engines).

        Args:
            own: ``{"schedule": ..., "options": ...}`` as saved, or None for a checkpoint saved by
                another LR schedule (``constant``, ``cosine``, Megatron's styles): the length_surge
                state then starts afresh, with a warning naming the checkpoint's step.
            step: the checkpoint's update counter (for the messages).
        """
        if own is None or own.get("schedule") is None:
            logger.warning("verl_lrstab: the checkpoint at update %s was saved by another LR schedule (it has no "
                           "length_surge state): the surge detector starts afresh from there", step)
            return
        saved = own["options"]  # every option (checked with the state: verl_lrstab.scheduler_state_checks)
        if saved["origin"] != self.config.origin and not self.config.is_given("origin"):
            # origin left unset: a running schedule keeps the rule it was started with
            logger.warning("verl_lrstab: the checkpoint at update %s was written with origin %r; this run's "
                           "default is origin %r. Keeping the checkpoint's origin %r so the running LR schedule "
                           "does not change; set %s.origin explicitly to switch", step, saved["origin"],
                           self.config.origin, saved["origin"], OPTIONS_KEY)
            self.schedule.config = _with_origin(self.config, saved["origin"])
        changed = {k: (saved[k], v) for k, v in self.config.to_dict().items() if saved[k] != v}
        if changed:
            logger.warning("verl_lrstab: length_surge options changed since the checkpoint at update %s "
                           "(key: (checkpoint, now)) %s; the configured ones apply from now on, so the decay "
                           "period and the LR may change at once", step, changed)
        self.schedule.load_state_dict(own["schedule"])
        dismissed = self.config.dismiss_trigger_step
        if dismissed is not None and self.schedule.trigger_step == dismissed:
            logger.warning("verl_lrstab: the decay that started at update %s is dismissed (%s.dismiss_trigger_step): "
                           "resuming from update %s at the initial LR, the surge detector re-armed from there",
                           dismissed, OPTIONS_KEY, step)
            self.rearm()

    def rearm(self) -> None:
        """Clear a fired decay: the LR returns to the initial LR (warmup as configured) from the next
        update, and the surge detector starts afresh from the current update, as in a new run."""
        self.schedule = LengthSurgeSchedule(self.config, warmup_steps=self.schedule.warmup_steps)
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Put the LR the schedule gives for the next update into the optimizer (the engine's own override)."""

    @property
    def config(self) -> LengthSurgeConfig:
        return self.schedule.config

    @property
    def surge_step(self) -> Optional[int]:
        return self.schedule.surge_step

    @property
    def decay_period(self) -> Optional[int]:
        return self.schedule.decay_period


def _with_origin(config: LengthSurgeConfig, origin: str) -> LengthSurgeConfig:
    kept = dataclasses.replace(config, origin=origin)
    return kept._with_given(config.given_keys or ()) if config.given_keys is not None else kept


# -- offline replay: the same code over a logged run ------------------------------------------
@dataclass
class ReplayResult:
    """What the scheduler would have done on a logged run.

    ``lr_scale[i]`` is the multiplier of the initial LR in force at ``steps[i]`` (used by the
    update of that step); ``surge_step`` is the logged step at which the detector fired.
    """

    surge_step: Optional[int]
    decay_period: Optional[int]
    steps: list = field(default_factory=list)
    lr_scale: list = field(default_factory=list)
    baseline: list = field(default_factory=list)
    ratio: list = field(default_factory=list)
    trigger_step: Optional[int] = None
    cusum: list = field(default_factory=list)  # detector: cusum only
    fired_by: Optional[str] = None  # detector: cusum: the way the surge fired (verl_lrstab.cusum.WAYS)
    cosignals: dict = field(default_factory=dict)  # lrstab replay: each co-signal fed -> the metric it was read from


def replay(steps: Iterable[int], values: Iterable[Optional[float]],
           config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None, warmup_steps: int = 0,
           mismatch_kl: Optional[Iterable[Optional[float]]] = None, score: Optional[Iterable[Optional[float]]] = None,
           clip_ratio: Optional[Iterable[Optional[float]]] = None,
           cosignals: Optional[Mapping[str, Iterable[Optional[float]]]] = None) -> ReplayResult:
    """Feed a logged series (step numbers as logged) through :class:`LengthSurgeSchedule`.

    ``mismatch_kl``, ``score`` and ``clip_ratio`` are aligned with ``steps`` (None/NaN where a
    step did not log them); left out, they are unavailable. ``cosignals`` (``{name: column}``,
    the detector's: ``entropy``, ``grad_norm``, ``kl_loss``, ``pg_clipfrac``) are handed to the
    detector after each step's own decision, as the trainer does (it has an update's figures
    only after the update); ``detector: ratio`` reads the length only.
    """
    steps = [int(s) for s in steps]
    values = list(values)
    columns = []
    cosignals = {k: v for k, v in (cosignals or {}).items() if v is not None}
    for name, col in (("values", values), ("mismatch_kl", mismatch_kl), ("score", score), ("clip_ratio", clip_ratio),
                      *cosignals.items()):
        col = list(col) if col is not None else [None] * len(steps)
        if len(col) != len(steps):
            raise ValueError(f"steps and {name} differ in length: {len(steps)} != {len(col)}")
        columns.append(col)
    schedule = LengthSurgeSchedule(config, warmup_steps=warmup_steps)
    result = ReplayResult(surge_step=None, decay_period=None)
    for step, value, kl, sc, clip, *extra in zip(steps, *columns):
        result.steps.append(step)
        # In force at `step`: decided before this step's own figures are seen.
        result.lr_scale.append(warmup_scale(step - 1, warmup_steps) * schedule.decay_scale(step))
        schedule.observe(step, value, kl, score=sc, clip_ratio=clip)
        if cosignals:  # the trainer's own path for an update's figures (after its decision)
            schedule.observe_cosignals(dict(zip(cosignals, extra)), update=step)
        result.baseline.append(schedule.detector.baseline)
        result.ratio.append(schedule.detector.ratio)
        result.cusum.append(getattr(schedule.detector, "cusum", math.nan))
    result.surge_step = schedule.surge_step
    result.fired_by = next(iter(getattr(schedule.detector, "fired_by", [])), None)
    result.trigger_step = schedule.trigger_step
    result.decay_period = schedule.decay_period
    return result
