"""Run code right after a module is imported, never breaking that import (stdlib only).

A hook runs inside the import of one of verl's own modules, so an exception escaping it
would make that import, and every verl run in the environment, fail. Each hook therefore
runs under a guard: an exception is handed to ``on_error(name, exc)`` (default: logged at
ERROR) and the import of verl's module completes as if no hook were there.

The glue reports its failures with :func:`report_failure`: one ERROR naming verl's version
and the target, and a guard armed so that a config naming ``length_surge`` fails at config
time with that cause (:func:`check_usable`); stock configs are untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Callable, Optional

logger = logging.getLogger("verl_lrstab")

ErrorHandler = Callable[[str, BaseException], None]


def when_imported(name: str, hook: Callable, on_error: Optional[ErrorHandler] = None) -> None:
    """Run ``hook(module)`` right after module ``name`` executes (now if already imported).

    Args:
        name: dotted module name.
        hook: called with the module object once it has executed.
        on_error: called with ``(name, exception)`` if ``hook`` raises; the exception never
            reaches the importer. Default: log it at ERROR level.
    """
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and spec is not None and not getattr(spec, "_initializing", False):
        run_hook(name, hook, module, on_error)
        return
    sys.meta_path.insert(0, _PostImportFinder(name, hook, on_error))


def run_hook(name: str, hook: Callable, module, on_error: Optional[ErrorHandler] = None) -> None:
    """``hook(module)``; any exception goes to ``on_error`` instead of the caller."""
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001 - a hook must never break verl's import
        try:
            if on_error is not None:
                on_error(name, exc)
            else:
                logger.error("verl_lrstab: a hook on %s failed: %r", name, exc, exc_info=True)
        except Exception:  # noqa: BLE001 - not even the reporting may break the import
            logger.exception("verl_lrstab: reporting a failed hook on %s failed", name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders, then runs ``hook`` after the module executes."""

    def __init__(self, name: str, hook: Callable, on_error: Optional[ErrorHandler] = None):
        self.name, self.hook, self.on_error = name, hook, on_error

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception as exc:  # noqa: BLE001 - let the regular finders report it
            run_hook(fullname, _raise, exc, self.on_error)
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, hook, on_error = spec.loader.exec_module, self.hook, self.on_error

        def exec_then_hook(module):
            exec_module(module)  # verl's own code: its errors are verl's and propagate
            run_hook(fullname, hook, module, on_error)

        spec.loader.exec_module = exec_then_hook
        return spec


def _raise(exc):
    raise exc


# -- failures of the glue and the config guard ------------------------------------------------
SCHEDULER_NAME = "length_surge"  # verl_lrstab.config.SCHEDULER_NAME (not imported: this module stays tiny)
OPTIM_KEY = "actor_rollout_ref.actor.optim.lr_scheduler_type"

#: ``(target, cause)`` of every failure of the glue in this process.
FAILURES: list[tuple[str, BaseException]] = []
_guard_armed = False


def verl_version() -> str:
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001
        return "(unknown version)"


def report_failure(target: str, cause: BaseException) -> None:
    """Record a failure of the glue: one loud error, and ``length_surge`` configs refused from now on."""
    FAILURES.append((target, cause))
    logger.error("verl-lrstab: cannot wrap %s of verl %s: %r. verl's own code stays in place, so runs that do "
                 "not name length_surge are unaffected; %s=%s will fail at config time in this process.",
                 target, verl_version(), cause, OPTIM_KEY, SCHEDULER_NAME)
    _arm_guard()


def failure_message() -> str:
    causes = "; ".join(f"{target}: {cause!r}" for target, cause in FAILURES)
    return (f"{OPTIM_KEY}={SCHEDULER_NAME} cannot be used: the verl-lrstab plugin failed to load or to wrap "
            f"verl {verl_version()} in this process ({causes}). Runs with lr_scheduler_type constant or cosine "
            "are unaffected. verl-lrstab supports verl 0.9.x; `python patches/check_verl.py` lists what no "
            "longer matches.")


def check_usable() -> None:
    """Raise with the recorded cause if the glue failed in this process (called for ``length_surge`` only)."""
    if FAILURES:
        raise RuntimeError(failure_message()) from FAILURES[0][1]


def _arm_guard() -> None:
    """Make every verl optimizer config that names ``length_surge`` raise :func:`failure_message`."""
    global _guard_armed
    if _guard_armed:
        return
    _guard_armed = True
    when_imported("verl.workers.config.optimizer", _guard_module, on_error=_guard_failed)
    when_imported("verl.workers.config", _guard_module, on_error=_guard_failed)


def _guard_module(module) -> None:
    """Wrap ``__post_init__`` of the module's dataclasses that have an ``lr_scheduler_type`` (or Megatron's
    ``lr_decay_style``) field.

    Found by field, not by name, so a renamed ``FSDPOptimizerConfig`` is guarded too.
    """
    for cls in list(vars(module).values()):
        fields = getattr(cls, "__dataclass_fields__", None)
        if not isinstance(cls, type) or not fields or not {"lr_scheduler_type", "lr_decay_style"} & set(fields):
            continue
        original = cls.__dict__.get("__post_init__")
        if original is None or getattr(original, "_lrstab_guard", False):
            continue

        def __post_init__(self, _original=original):
            if SCHEDULER_NAME in (getattr(self, "lr_scheduler_type", None), getattr(self, "warmup_style", None),
                                  getattr(self, "lr_decay_style", None)):  # lr_decay_style: Megatron's key
                check_usable()
            _original(self)

        __post_init__._lrstab_guard = True
        cls.__post_init__ = __post_init__


def _guard_failed(name: str, exc: BaseException) -> None:
    logger.error("verl-lrstab: could not guard %s against lr_scheduler_type=length_surge: %r", name, exc)
