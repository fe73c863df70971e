"""Offline replay: the trainer's own schedule over a logged run (pure Python).

Each logged step becomes one :class:`~verl_lrstab.detectors.UpdateFigures` handed to
:meth:`LengthSurgeSchedule.observe <verl_lrstab.detectors.LengthSurgeSchedule.observe>`, the way in
the trainer's figures take, so a replay decides as the run's trainer did from the same figures.
``lrstab replay``, ``calibrate`` and ``compare`` read the run (:mod:`verl_lrstab.runs`) and call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.decay import warmup_scale
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures


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
    """Feed a logged series (step numbers as logged) through :class:`~verl_lrstab.detectors.LengthSurgeSchedule`.

    ``mismatch_kl``, ``score`` and ``clip_ratio`` are aligned with ``steps`` (None/NaN where a
    step did not log them); left out, they are unavailable. ``cosignals`` (``{name: column}``,
    the detector's: ``entropy``, ``grad_norm``, ``kl_loss``, ``pg_clipfrac``) are read after each
    step's own decision, as the trainer reads them (it has an update's figures only after the
    update); ``detector: ratio`` reads the length only.
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
        schedule.observe(step, UpdateFigures(response_length=value, mismatch_kl=kl, score=sc, clip_ratio=clip,
                                             cosignals=dict(zip(cosignals, extra))))
        result.baseline.append(schedule.detector.baseline)
        result.ratio.append(schedule.detector.ratio)
        result.cusum.append(getattr(schedule.detector, "cusum", math.nan))
    result.surge_step = schedule.surge_step
    result.fired_by = next(iter(getattr(schedule.detector, "fired_by", [])), None)
    result.trigger_step = schedule.trigger_step
    result.decay_period = schedule.decay_period
    return result
