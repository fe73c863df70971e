"""How the glue replaces one verl attribute, fail-safe (the mechanics; the list is in :mod:`.registry`).

verl has no registry for LR schedulers, so the glue replaces a few of verl's functions, each
the moment its module is first imported. A :class:`Wrap` names the target, the signature and
the other assumptions the wrapper relies on, and the factory of the wrapper. :func:`apply`
checks the assumptions first: a target that is missing or has another shape, or a factory
that raises, leaves verl's original in place and goes to
:func:`verl_lrstab.glue.failsafe.report_failure` (a refusal's, to ``report_refusal_failure``).

Every wrapper is built with :func:`dispatch`: it decides from verl's own arguments whether
the run names ``length_surge`` and otherwise calls verl's original with the arguments
unchanged, before any other code of ours runs; the decision itself can never raise into verl.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from verl_lrstab.glue.failsafe import report_failure, report_optional_failure, report_refusal_failure

logger = logging.getLogger("verl_lrstab")

Check = tuple  # (assumption, ok, detail)


@dataclass(frozen=True)
class Wrap:
    """One verl attribute the glue replaces.

    Args:
        module: the module whose import installs the wrap.
        owner: class in ``module`` holding the attribute (dotted for a nested one); None for a
            module attribute.
        attribute: the attribute replaced.
        parameters: leading parameter names of verl's function the wrapper relies on
            (further parameters must be optional); None for a non-function (a class).
        make: ``make(original) -> replacement``.
        checks: ``checks(module, original) -> iterable of (assumption, ok, detail)``: the other
            assumptions the wrapper makes about verl's code (cheap: run at install time).
        also_in: further modules whose attribute of the same name is replaced as well.
        required: a ``length_surge`` run cannot work without it (refusals are not required: one
            that cannot be installed is reported and disabled, ``length_surge`` stays usable).
        where: what a refusal refuses, for the message when it cannot be installed.
        fallback: for a wrap that is not required and not a refusal (an async trainer's run checks): what
            happens to a length_surge run when it cannot be installed, for that message.
    """

    module: str
    owner: Optional[str]
    attribute: str
    parameters: Optional[tuple]
    make: Callable[[Any], Any]
    checks: Optional[Callable[[Any, Any], Iterable[Check]]] = None
    also_in: tuple = ()
    required: bool = True
    where: str = ""
    fallback: str = ""

    @property
    def target(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attribute) if p)


class VerlShapeError(RuntimeError):
    """verl's target does not have the shape the wrapper relies on."""


def apply(wrap: Wrap, module) -> bool:
    """Install ``wrap`` on ``module``; on any failure leave verl's original and report it."""
    try:
        owner = owner_of(wrap, module)
        current = getattr(owner, wrap.attribute)
        if getattr(current, "_lrstab_original", None) is not None:
            return True
        problems = [f"{name} ({detail})" if detail else name
                    for name, ok, detail in shape_checks(wrap, module, current) if not ok]
        if problems:
            raise VerlShapeError("; ".join(problems))
        replacement = wrap.make(current)
        if wrap.parameters is not None:
            replacement = functools.wraps(current)(replacement)  # keeps verl's decorator attributes
        replacement._lrstab_original = current
        for name in wrap.also_in:
            other = _loaded(name)
            if other is not None and getattr(other, wrap.attribute, None) is current:
                setattr(other, wrap.attribute, replacement)
        setattr(owner, wrap.attribute, replacement)
        return True
    except Exception as exc:  # noqa: BLE001 - never break verl's import; report and refuse length_surge
        if wrap.required:
            report_failure(wrap.target, exc)
        elif wrap.fallback:  # one trainer's checks: that trainer's runs take the fallback, the others are untouched
            report_optional_failure(wrap.target, exc, wrap.fallback)
        else:  # a refusal: only that refusal is lost
            report_refusal_failure(wrap.target, exc, wrap.where)
        return False


def dispatch(original: Callable, names_length_surge: Callable[..., bool], length_surge: Callable) -> Callable:
    """A wrapper that runs ``length_surge(original, *args, **kwargs)`` for a length_surge run, else verl's own.

    ``names_length_surge(*args, **kwargs)`` reads verl's arguments only; if it raises (verl
    changed under us), verl's original runs and one ERROR says so: a stock run never fails here.
    """

    def wrapper(*args, **kwargs):
        try:
            ours = bool(names_length_surge(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a stock run must reach verl's code whatever happens here
            _error_once(getattr(original, "__qualname__", repr(original)), exc)
            ours = False
        if not ours:
            return original(*args, **kwargs)
        return length_surge(original, *args, **kwargs)

    return wrapper


_reported: set = set()


def _error_once(where: str, exc: BaseException) -> None:
    if where not in _reported:
        _reported.add(where)
        logger.error("verl-lrstab: could not tell whether the run names length_surge in %s (%r); verl's own code "
                     "ran", where, exc)


def owner_of(wrap: Wrap, module):
    """The object holding ``wrap.attribute``: the module, or the (dotted) ``owner`` in it."""
    return functools.reduce(getattr, wrap.owner.split("."), module) if wrap.owner else module


def original(obj):
    """verl's own object behind a wrapper (the object itself if not wrapped)."""
    return getattr(obj, "_lrstab_original", obj)


def shape_checks(wrap: Wrap, module, current) -> Iterable[Check]:
    """The assumptions ``wrap`` makes about verl's target, as ``(assumption, ok, detail)``."""
    target = original(current)
    if wrap.parameters is not None:
        yield _signature_check(wrap, target)
    if wrap.checks is not None:
        yield from wrap.checks(module, target)


def _signature_check(wrap: Wrap, func) -> Check:
    expected = tuple(wrap.parameters or ())  # called for a function's wrap only (parameters given)
    name = f"{wrap.target}{expected}"
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        return name, False, f"no signature: {exc}"
    head = [p.name for p in params[: len(expected)]]
    extra_required = [p.name for p in params[len(expected):]
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    ok = head == list(expected) and not extra_required
    return name, ok, "" if ok else f"verl has {inspect.signature(func)}"


def source_contains(obj, *needles: str) -> tuple:
    """(ok, detail) for "each needle is in obj's source"; unreadable source is not a failure."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return True, "source not available, not checked"
    missing = [n for n in needles if n not in source]
    return not missing, f"not found: {missing}" if missing else ""


def argument(args: tuple, kwargs: dict, index: int, name: str):
    """verl's argument ``name`` (positional ``index`` counting ``self``), as the wrapped function got it."""
    return args[index] if len(args) > index else kwargs[name]


def _loaded(name: str):
    import sys

    return sys.modules.get(name)
