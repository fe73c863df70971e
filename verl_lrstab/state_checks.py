"""Validation of a loaded scheduler state, before anything of it is restored.

A checkpoint's scheduler state that would resume a wrong LR (``base_lrs`` NaN, inf or negative), a
counter before the start (``last_epoch`` -5) or a detector that would fail later (a missing key,
a malformed row) is refused with one :class:`SchedulerStateError` naming the checkpoint's step
and the bad field, instead of being taken silently or failing with a bare ``KeyError``.

Pure: plain Python (the state is what ``torch.load(weights_only=True)`` gives).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple, Union, get_args, get_origin, get_type_hints


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
            _check_options(c, own, f"{own_key}.options")
            check_schedule_state(own["schedule"], step)


def _check_options(c: "_Checker", state: dict, name: str) -> None:
    """The options the schedule was written with: a mapping of every ``LengthSurgeConfig`` key."""
    from dataclasses import fields

    from verl_lrstab.config import LengthSurgeConfig

    options = c.need(state, "options", name.removesuffix("options"))
    keys = {f.name for f in fields(LengthSurgeConfig)}
    if not isinstance(options, dict):
        c.fail(name, options, "a mapping of the length_surge options")
    for key in sorted(set(options) ^ keys, key=str):
        c.fail(f"{name}.{key}", options.get(key, MISSING),
               "the key to be present" if key in keys else "absent (not a length_surge option)")


def check_schedule_state(state: Any, step: Optional[int] = None) -> None:
    """``LengthSurgeSchedule.state_dict()``, read as :class:`verl_lrstab.schedule.ScheduleState` (every field of
    it and of the detector's and trigger's states present, known and of its type; rows ``[step, finite value]``)."""
    from verl_lrstab.schedule import ScheduleState

    c = _Checker(step, "length_surge state")
    try:
        ScheduleState.from_state(state)
    except StateFieldError as err:
        c.fail(err.field, err.value, err.expected)


# -- typed states: a dataclass read back from its plain form, each field checked --------------------------
class StateFieldError(ValueError):
    """A field of a saved state that cannot be read: its dotted ``field``, its ``value``, what was ``expected``."""

    def __init__(self, field: str, value: Any, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{field}={_shown(value)}, expected {expected}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """A dataclass state's own bound (its ``__post_init__``): refused naming ``field`` unless ``ok``."""
    if not ok:
        raise StateFieldError(field, value, expected)


#: A ``[step, value]`` row of a detector's history (saved as a list).
Row = Tuple[int, float]


def from_state(cls: type, state: Any, path: str = "") -> Any:
    """The dataclass ``cls`` from its plain form (``dataclasses.asdict``): every field present and known, each
    value of its annotated type (``int``, ``float``, ``str``, ``Optional``, ``list``, ``dict[str, ...]``,
    :data:`Row`, a nested dataclass), the dataclass's own bounds (``__post_init__``, :func:`require`)
    met. Anything else raises :class:`StateFieldError` naming the field as ``path.field``."""
    return _read(cls, state, path)


def _read(kind, value, path: str):
    name = path or "state"
    origin, args = get_origin(kind), get_args(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise StateFieldError(name, value, f"a mapping of {sorted(f.name for f in dataclasses.fields(kind))}")
        hints = get_type_hints(kind)
        known = [f.name for f in dataclasses.fields(kind) if f.init]
        prefix = f"{path}." if path else ""
        for key in sorted(set(value) - set(known), key=str):  # no older state format is read
            raise StateFieldError(f"{prefix}{key}", value[key], f"absent (not a field of {kind.__name__})")
        for key in known:
            if key not in value:
                raise StateFieldError(f"{prefix}{key}", MISSING, "the key to be present")
        fields = {key: _read(hints[key], value[key], f"{prefix}{key}") for key in known}
        try:
            return kind(**fields)
        except StateFieldError as err:
            raise StateFieldError(f"{prefix}{err.field}", err.value, err.expected) from None
    if origin is Union:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        try:
            return _read(inner, value, path)
        except StateFieldError as err:
            if err.field != name:  # a field inside the value
                raise
            raise StateFieldError(err.field, err.value, f"null or {err.expected}") from None
    if kind is Row:
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and _integer(value[0]) and _finite(value[1])):
            raise StateFieldError(name, value, "a row [integer step, finite value]")
        return [value[0], value[1]]
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise StateFieldError(name, value, f"a list of {_what(args[0])}")
        return [_read(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise StateFieldError(name, value, f"a mapping of names to {_what(args[1])}")
        return {k: _read(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if kind is int and not _integer(value):
        raise StateFieldError(name, value, "an integer")
    if kind is float and not _number(value):
        raise StateFieldError(name, value, "a number (NaN when not formed yet)")
    if kind in (str, bool) and not isinstance(value, kind):
        raise StateFieldError(name, value, _what(kind))
    if kind is float:
        return float(value)
    return value


def _what(kind) -> str:
    if kind is Row:
        return "rows [integer step, finite value]"
    if dataclasses.is_dataclass(kind):
        return f"{kind.__name__} mappings"
    return {int: "integers", float: "numbers", str: "text", bool: "true or false"}.get(kind, str(kind))
