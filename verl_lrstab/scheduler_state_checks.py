"""Validation of a loaded scheduler state, before anything of it is restored.

A checkpoint's scheduler state that would resume a wrong LR (``base_lrs`` NaN, inf or negative), a
counter before the start (``last_epoch`` -5) or a detector that would fail later (a missing key,
a malformed row) is refused with one :class:`SchedulerStateError` naming the checkpoint's step
and the bad field, instead of being taken silently or failing with a bare ``KeyError``.

Pure: plain Python (the state is what ``torch.load(weights_only=True)`` gives).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.detectors import ScheduleState
from verl_lrstab.dataclass_reader import MISSING, StateFieldError, is_finite, is_integer, shown


class SchedulerStateError(ValueError):
    """A checkpoint's scheduler state that cannot be resumed (the message names the step and the field)."""


class _Checker:
    def __init__(self, step, where: str):
        self.step, self.where = step, where

    def fail(self, field: str, value: Any, expected: str):
        raise SchedulerStateError(f"the checkpoint at update {self.step}: its {self.where} has {field}={shown(value)}, "
                                  f"expected {expected}; the checkpoint is damaged or not a length_surge one "
                                  "(resume from another checkpoint)")

    def need(self, state: dict, field: str, prefix: str = ""):
        if field not in state:
            self.fail(prefix + field, MISSING, "the key to be present")
        return state[field]


def check_lr_scheduler_state(state: Any, step_key: str = "last_epoch", param_groups: Optional[int] = None) -> None:
    """A torch LR scheduler's state (``LengthSurgeLR``, or a stock one verl saved): ``base_lrs``
    finite and >= 0 (one per optimizer param group when ``param_groups`` is given), ``last_epoch``
    an integer >= -1, ``_step_count`` >= 0, ``_last_lr`` finite >= 0, ``options`` null or a mapping,
    and the length_surge schedule's state when there is one (:func:`check_schedule_state`)."""
    step = state.get(step_key, "?") if isinstance(state, dict) else "?"
    c = _Checker(step, "scheduler state")
    if not isinstance(state, dict):
        c.fail("state", type(state).__name__, "a mapping")
    if "last_epoch" in state or "schedule" in state:
        last = c.need(state, "last_epoch")
        if not is_integer(last) or last < -1:
            c.fail("last_epoch", last, "an integer >= -1")
    if "_step_count" in state or "schedule" in state:
        count = c.need(state, "_step_count")
        if not is_integer(count) or count < 0:
            c.fail("_step_count", count, "an integer >= 0")
    for key in ("base_lrs", "_last_lr"):  # 0 is a run that never moves (lrstab admit's lr=0 candidates)
        if key not in state and "schedule" not in state:
            continue
        lrs = c.need(state, key)
        if not isinstance(lrs, (list, tuple)) or not lrs:
            c.fail(key, lrs, "a non-empty list of learning rates")
        for i, lr in enumerate(lrs):
            if not is_finite(lr) or lr < 0:
                c.fail(f"{key}[{i}]", lr, "a finite number >= 0")
        if param_groups is not None and len(lrs) != param_groups:
            c.fail(key, lrs, f"{param_groups} learning rate(s), one per param group of the optimizer it is loaded "
                             "into (the checkpoint's optimizer had another number of param groups)")
    if "updates_per_step" in state:
        count = state["updates_per_step"]
        if not is_integer(count) or count < 1:
            c.fail("updates_per_step", count, "an integer >= 1")
    if "schedule" in state:
        _check_options(c, state, "options")
        check_schedule_state(state["schedule"], step)


def check_megatron_scheduler_state(state: Any, own_key: str = "length_surge") -> None:
    """megatron-core's ``OptimizerParamScheduler`` state: ``max_lr`` finite > 0, ``min_lr`` finite
    >= 0, ``num_steps`` an integer >= 0 (when present), and ours under ``own_key`` (when present)."""
    step = state.get("num_steps", "?") if isinstance(state, dict) else "?"
    c = _Checker(step, "scheduler state")
    if not isinstance(state, dict):
        c.fail("state", type(state).__name__, "a mapping")
    if "max_lr" in state and (not is_finite(state["max_lr"]) or state["max_lr"] <= 0):
        c.fail("max_lr", state["max_lr"], "a finite number > 0")
    if "min_lr" in state and (not is_finite(state["min_lr"]) or state["min_lr"] < 0):
        c.fail("min_lr", state["min_lr"], "a finite number >= 0")
    if "num_steps" in state and (not is_integer(state["num_steps"]) or state["num_steps"] < 0):
        c.fail("num_steps", state["num_steps"], "an integer >= 0")
    own = state.get(own_key)
    if own is not None:
        if not isinstance(own, dict):
            c.fail(own_key, own, "a mapping")
        if own.get("schedule") is not None:
            _check_options(c, own, f"{own_key}.options")
            check_schedule_state(own["schedule"], step)


def _check_options(c: "_Checker", state: dict, name: str) -> None:
    """The options the schedule was written with: a mapping of every ``LengthSurgeConfig`` key."""
    options = c.need(state, "options", name.removesuffix("options"))
    keys = {f.name for f in fields(LengthSurgeConfig)}
    if not isinstance(options, dict):
        c.fail(name, options, "a mapping of the length_surge options")
    for key in sorted(set(options) ^ keys, key=str):
        c.fail(f"{name}.{key}", options.get(key, MISSING),
               "the key to be present" if key in keys else "absent (not a length_surge option)")


def check_schedule_state(state: Any, step: Any = None) -> None:  # step: a label, "?" when unknown
    """``LengthSurgeSchedule.state_dict()``, read as :class:`verl_lrstab.detectors.ScheduleState` (every field of
    it and of the detector's and trigger's states present, known and of its type; rows ``[step, finite value]``)."""
    c = _Checker(step, "length_surge state")
    try:
        ScheduleState.from_state(state)
    except StateFieldError as err:
        c.fail(err.field, err.value, err.expected)
