"""Run code right after a module is imported, never breaking that import (stdlib only).

A hook runs inside the import of one of verl's own modules, so an exception escaping it
would make that import, and every verl run in the environment, fail. Each hook therefore
runs under a guard: an exception is handed to ``on_error(name, exc)`` (default: logged at
ERROR) and the import of verl's module completes as if no hook were there.
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
