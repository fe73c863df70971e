"""The detectors wired to the decay rule: one :class:`UpdateFigures` record an actor update, one ``observe`` (pure Python).

:meth:`LengthSurgeSchedule.observe` is the one way in for an update's figures, whoever hands them:
verl's engines through the scheduler they step (:mod:`verl_lrstab.feeding`, under
:mod:`verl_lrstab.scheduler` and :mod:`verl_lrstab.megatron`), a training loop of one's own through
those schedulers' ``step(...)``, and the replay of a logged run (:mod:`verl_lrstab.log_replay`). It
feeds the length detector (``length_surge.detector``: :class:`~verl_lrstab.cusum.CusumDetector`,
the default, or :class:`~verl_lrstab.ratio.RatioDetector`) and the mismatch trigger, and makes the
first alarm the ``trigger`` option admits (or the guard's ``decay_from_step``) the update that starts
the decay; the LR it gives follows :mod:`verl_lrstab.decay`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from verl_lrstab._numbers import finite_float
from verl_lrstab.config import OPTIONS_KEY, LengthSurgeConfig
from verl_lrstab.cusum import CusumDetector, CusumState
from verl_lrstab.decay import decay_period_from_surge, decay_scale, warmup_scale
from verl_lrstab.mismatch_trigger import MismatchTrigger, MismatchTriggerState
from verl_lrstab.ratio import RatioDetector, RatioState
from verl_lrstab.dataclass_reader import from_state, is_integer, require

logger = logging.getLogger("verl_lrstab")

#: The detectors by ``length_surge.detector`` (one interface: ``update``, ``add_cosignals``, ``metrics``, ``reads``,
#: ``state_dict``), and the dataclasses their states are.
DETECTORS: "dict[str, type[CusumDetector | RatioDetector]]" = {"cusum": CusumDetector, "ratio": RatioDetector}
DETECTOR_STATES = {"cusum": CusumState, "ratio": RatioState}
#: What started the decay: the length detector, the mismatch trigger, the guard's ``decay_from_step``.
TRIGGER_SOURCES = ("length", "mismatch", "guard")
#: The batch's figures of :class:`UpdateFigures`: what an update's decision reads.
BATCH_FIGURES = ("response_length", "mismatch_kl", "score", "clip_ratio")


@dataclass(frozen=True)
class UpdateFigures:
    """The figures of one actor update (under verl's ``separate_async``: of one trainer step's updates), the record
    :meth:`LengthSurgeSchedule.observe` takes. None: unavailable.

    Args:
        response_length (float | None): the batch's mean response length (verl's ``response_length/mean``),
            measured before the update, as the next three.
        mismatch_kl (float | None): the batch's mismatch figure (the mismatch trigger's, and a witness of
            ``detector: cusum``).
        score (float | None): the batch's mean score (verl's ``critic/score/mean``).
        clip_ratio (float | None): the share of the batch's responses at the response cap.
        cosignals (Mapping[str, float | None]): the update's own figures (``grad_norm``, ``kl_loss``,
            ``pg_clipfrac``, ``entropy``), which exist only once it ran: read from the next decision on.
        updates_per_step (int | None): the actor updates of the trainer step (verl's ``separate_async``:
            several; None: unchanged), read by the engine schedulers
            (:meth:`verl_lrstab.feeding.FedSchedule.set_updates_per_step`), not by the schedule.
    """

    response_length: Optional[float] = None
    mismatch_kl: Optional[float] = None
    score: Optional[float] = None
    clip_ratio: Optional[float] = None
    cosignals: Mapping[str, Optional[float]] = field(default_factory=dict)
    updates_per_step: Optional[int] = None

    @property
    def has_batch_figures(self) -> bool:
        return any(getattr(self, name) is not None for name in BATCH_FIGURES)

    def overridden_by(self, given: "UpdateFigures") -> "UpdateFigures":
        """These batch figures, each replaced by ``given``'s where that is not None, with ``given``'s co-signals."""
        pick = lambda name: getattr(self if getattr(given, name) is None else given, name)  # noqa: E731
        return UpdateFigures(response_length=pick("response_length"), mismatch_kl=pick("mismatch_kl"),
                             score=pick("score"), clip_ratio=pick("clip_ratio"), cosignals=given.cosignals)


def cosignal_figures(**figures: Optional[float]) -> dict:
    """The update's own figures given (``entropy=..., grad_norm=...``), the None ones left out."""
    return {name: value for name, value in figures.items() if value is not None}


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


class LengthSurgeSchedule:
    """Detector(s) + decay rule. One :meth:`observe` per actor update, then ``scale(...)``.

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
    def last_update(self) -> Optional[int]:
        """The update last decided (None: none yet)."""
        return self.detector.last_step

    @property
    def decay_period(self) -> Optional[int]:
        if self.config.monitor_only:
            return None
        if self.config.decay_period is not None:
            return self.config.decay_period
        if self.trigger_step is None:
            return None
        return decay_period_from_surge(self.trigger_step, self.config.period_factor)

    def observe(self, update: int, figures: UpdateFigures) -> bool:
        """Feed the figures of actor update ``update``; return True if the decay is triggered now.

        An update is decided once, by its first record, from its batch figures: ``score`` and
        ``clip_ratio`` are co-signals of ``detector: cusum``, as is ``mismatch_kl``; ``detector:
        ratio`` reads the length only (None or NaN: unavailable). The record's ``cosignals`` are then
        added under ``update``: the detector reads them from its next decision on. A record for an
        update already decided adds its co-signals only: verl's update logs them once it ran, after
        its decision, and the glue hands them then (:meth:`verl_lrstab.feeding.FedSchedule.observe_update`).
        Batch figures for an update at or before the last one decided (a counter that went back) are
        not fed: a warning names both.
        """
        last = self.detector.last_step
        fired = False
        if last is None or update > last:
            fired = self._decide(update, figures)
        elif figures.has_batch_figures or update < last:
            logger.warning("verl_lrstab: the update counter went back from %s to %s: the figures of update %s are "
                           "not fed to the surge detector (its history is ordered by update)", last, update, update)
        self.cosignals = {}
        if figures.cosignals:
            self.detector.add_cosignals(update, **figures.cosignals)
            self.cosignals = {name: value for name, value in figures.cosignals.items() if name in self.detector.reads}
        return fired

    def _decide(self, update: int, figures: UpdateFigures) -> bool:
        """The decision of update ``update`` from its batch figures: the length detector's and the mismatch
        trigger's, and whether the first alarm the ``trigger`` option admits starts the decay now."""
        response_length, mismatch_kl = figures.response_length, figures.mismatch_kl
        score, clip_ratio = figures.score, figures.clip_ratio
        self.response_length = _or_nan(finite_float(response_length))
        self.mismatch_kl = _or_nan(finite_float(mismatch_kl))
        self.score = _or_nan(finite_float(score))
        self.clip_ratio = _or_nan(finite_float(clip_ratio))
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
