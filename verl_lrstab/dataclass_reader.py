"""Typed states: a dataclass read back from its plain form (``dataclasses.asdict``), each field checked.

The detector's, the mismatch trigger's and the schedule's states are dataclasses saved as plain types (what
``torch.load(weights_only=True)`` gives back), the guard's run state one saved as JSON. :func:`from_state`
reads one back: every field present and known, each of its annotated type, the dataclass's own bounds
(:func:`require`) met; anything else is one :class:`StateFieldError` naming the field. No older state format
is read.

Pure: plain Python, no other module of the package.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Tuple, Union, get_args, get_origin, get_type_hints


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value) -> bool:
    return is_number(value) and math.isfinite(value)


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class StateFieldError(ValueError):
    """A field of a saved state that cannot be read: its dotted ``field``, its ``value``, what was ``expected``."""

    def __init__(self, field: str, value: Any, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{field}={shown(value)}, expected {expected}")


def shown(value) -> str:
    """``repr(value)``, cut to 80 characters (a field's value in one error line)."""
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
    value of its annotated type (``int``, ``float``, ``str``, ``bool``, ``Optional``, ``list``,
    ``dict[str, ...]``, :data:`Row`, a fixed ``Tuple[...]`` saved as a list, a nested dataclass; ``Any``: a
    value kept as it is), the dataclass's own bounds (``__post_init__``, :func:`require`) met. Anything else
    raises :class:`StateFieldError` naming the field as ``path.field``."""
    return _read(cls, state, path)


def _read(kind, value, path: str):
    name = path or "state"
    origin, args = get_origin(kind), get_args(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
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
        if not (isinstance(value, (list, tuple)) and len(value) == 2 and is_integer(value[0]) and is_finite(value[1])):
            raise StateFieldError(name, value, "a row [integer step, finite value]")
        return [value[0], value[1]]
    if origin is tuple:  # a fixed tuple (JSON saves it as a list): e.g. ``Tuple[str, int]``
        if not (isinstance(value, (list, tuple)) and len(value) == len(args)):
            raise StateFieldError(name, value, f"a list [{', '.join(_what(a, one=True) for a in args)}]")
        return tuple(_read(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise StateFieldError(name, value, f"a list of {_what(args[0])}")
        return [_read(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise StateFieldError(name, value, f"a mapping of names to {_what(args[1])}")
        return {k: _read(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if kind is Any:
        return value
    if kind is int and not is_integer(value):
        raise StateFieldError(name, value, "an integer")
    if kind is float and not is_number(value):
        raise StateFieldError(name, value, "a number (NaN when not formed yet)")
    if kind in (str, bool) and not isinstance(value, kind):
        raise StateFieldError(name, value, _what(kind))
    if kind is float:
        return float(value)
    return value


def _what(kind, one: bool = False) -> str:
    if kind is Row:
        return "a row [integer step, finite value]" if one else "rows [integer step, finite value]"
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return f"a {kind.__name__} mapping" if one else f"{kind.__name__} mappings"
    if kind is Any:
        return "a value" if one else "values"
    names = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("text", "text"),
             bool: ("true or false", "true or false")}
    return names[kind][0 if one else 1] if kind in names else str(kind)
