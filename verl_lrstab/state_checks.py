"""Validation of a loaded scheduler state, before anything of it is restored.

A checkpoint's scheduler state that would resume a wrong LR (``base_lrs`` NaN, inf or negative), a
counter before the start (``last_epoch`` -5) or a detector that would fail later (a missing key,
a malformed row) is refused with one :class:`SchedulerStateError` naming the checkpoint's step
and the bad field, instead of being taken silently or failing with a bare ``KeyError``.

Pure: plain Python (the state is what ``torch.load(weights_only=True)`` gives).
"""

from __future__ import annotations

import math
from typing import Any, Optional


class SchedulerStateError(ValueError):
    """A checkpoint's scheduler state that cannot be resumed (the message names the step and the field)."""


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class _Checker:
    def __init__(self, step, where: str):
        self.step, self.where = step, where

    def fail(self, field: str, value: Any, expected: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise SchedulerStateError(f"the checkpoint at update {self.step}: its {self.where} has {field}={shown}, "
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
        if not _integer(last) or last < -1:
            c.fail("last_epoch", last, "an integer >= -1")
    if "_step_count" in state or "schedule" in state:
        count = c.need(state, "_step_count")
        if not _integer(count) or count < 0:
            c.fail("_step_count", count, "an integer >= 0")
    for key in ("base_lrs", "_last_lr"):  # 0 is a run that never moves (lrstab admit's lr=0 candidates)
        if key not in state and "schedule" not in state:
            continue
        lrs = c.need(state, key)
        if not isinstance(lrs, (list, tuple)) or not lrs:
            c.fail(key, lrs, "a non-empty list of learning rates")
        for i, lr in enumerate(lrs):
            if not _finite(lr) or lr < 0:
                c.fail(f"{key}[{i}]", lr, "a finite number >= 0")
        if param_groups is not None and len(lrs) != param_groups:
            c.fail(key, lrs, f"{param_groups} learning rate(s), one per param group of the optimizer it is loaded "
                             "into (the checkpoint's optimizer had another number of param groups)")
    if state.get("options") is not None and not isinstance(state["options"], dict):
        c.fail("options", state["options"], "null or a mapping of the length_surge options")
    if "schedule" in state:
        check_schedule_state(state["schedule"], step)


def check_megatron_scheduler_state(state: Any, own_key: str = "length_surge") -> None:
    """megatron-core's ``OptimizerParamScheduler`` state: ``max_lr`` finite > 0, ``min_lr`` finite
    >= 0, ``num_steps`` an integer >= 0 (when present), and ours under ``own_key`` (when present)."""
    step = state.get("num_steps", "?") if isinstance(state, dict) else "?"
    c = _Checker(step, "scheduler state")
    if not isinstance(state, dict):
        c.fail("state", type(state).__name__, "a mapping")
    if "max_lr" in state and (not _finite(state["max_lr"]) or state["max_lr"] <= 0):
        c.fail("max_lr", state["max_lr"], "a finite number > 0")
    if "min_lr" in state and (not _finite(state["min_lr"]) or state["min_lr"] < 0):
        c.fail("min_lr", state["min_lr"], "a finite number >= 0")
    if "num_steps" in state and (not _integer(state["num_steps"]) or state["num_steps"] < 0):
        c.fail("num_steps", state["num_steps"], "an integer >= 0")
    own = state.get(own_key)
    if own is not None:
        if not isinstance(own, dict):
            c.fail(own_key, own, "a mapping")
        if own.get("schedule") is not None:
            check_schedule_state(own["schedule"], step)


def _check_rows(c, name: str, value) -> None:
    if not isinstance(value, (list, tuple)):
        c.fail(name, value, "a list of [step, value] rows")
    for i, row in enumerate(value):
        if not isinstance(row, (list, tuple)) or len(row) != 2 or not _integer(row[0]) or not _finite(row[1]):
            c.fail(f"{name}[{i}]", row, "a row [integer step, finite value]")


def check_schedule_state(state: Any, step: Optional[int] = None) -> None:
    """``LengthSurgeSchedule.state_dict()``: the trigger and the detector's fields (every key a
    fresh detector of the saved kind saves, each of its type; rows ``[step, finite value]``)."""
    from verl_lrstab.cusum import CusumDetector
    from verl_lrstab.detector import SurgeDetector

    c = _Checker(step, "length_surge state")
    if not isinstance(state, dict):
        c.fail("schedule", type(state).__name__, "a mapping")
    kind = state.get("detector_kind", "ratio")
    if kind not in ("cusum", "ratio"):
        c.fail("detector_kind", kind, "'cusum' or 'ratio'")
    trigger = c.need(state, "trigger_step")
    if trigger is not None and (not _integer(trigger) or trigger < 0):
        c.fail("trigger_step", trigger, "null or an integer >= 0")
    detector = c.need(state, "detector")
    if not isinstance(detector, dict):
        c.fail("detector", detector, "a mapping")
    cls = CusumDetector if kind == "cusum" else SurgeDetector
    fresh = cls().state_dict()
    for key in sorted(set(detector) - set(fresh), key=str):  # no older state format is read
        c.fail(f"detector.{key}", detector[key], f"absent (not a field of the {kind} detector's state)")
    for key, empty in fresh.items():
        name = f"detector.{key}"
        if key not in detector:
            c.fail(name, MISSING, "the key to be present")
        value = detector[key]
        if key == "rows":
            if not isinstance(value, dict) or set(value) != set(empty):
                c.fail(name, value, f"a mapping of {sorted(empty)}")
            columns = {f"rows.{k}": v for k, v in value.items() if k != "co"}
            if not isinstance(value["co"], dict) or set(value["co"]) != set(empty["co"]):
                c.fail(f"{name}.co", value["co"], f"a mapping of {sorted(empty['co'])}")
            columns.update({f"rows.co.{k}": v for k, v in value["co"].items()})
            for col, rows in columns.items():
                _check_rows(c, f"detector.{col}", rows)
        elif key == "history":
            _check_rows(c, name, value)
        elif key == "alarm" and kind == "cusum":
            from dataclasses import fields

            from verl_lrstab.cusum import Alarm

            names = sorted(f.name for f in fields(Alarm))
            if value is not None and (not isinstance(value, dict) or sorted(value) != names):
                c.fail(name, value, f"null or a mapping of {names}")
        elif key == "fired_by":
            if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
                c.fail(name, value, "a list of the ways that fired")
        elif key == "surge_steps":
            if not isinstance(value, (list, tuple)) or not all(_integer(s) and s >= 0 for s in value):
                c.fail(name, value, "a list of integer steps >= 0")
        elif key == "first_values":
            if not isinstance(value, (list, tuple)) or not all(_finite(v) for v in value):
                c.fail(name, value, "a list of finite numbers")
        elif key == "num_skipped":
            if not _integer(value) or value < 0:
                c.fail(name, value, "an integer >= 0")
        elif key in ("last_step", "first_step", "streak_start"):
            if value is not None and not _integer(value):
                c.fail(name, value, "null or an integer step")
        elif key == "cusum":
            if not _finite(value) or value < 0:
                c.fail(name, value, "a finite number >= 0")
        elif isinstance(empty, float):  # level, baseline, ratio, ...: NaN means "not formed yet"
            if not _number(value):
                c.fail(name, value, "a number (NaN when not formed yet)")
        elif isinstance(empty, (list, dict)) and not isinstance(value, type(empty)) and value is not None:
            c.fail(name, value, f"a {type(empty).__name__}")
