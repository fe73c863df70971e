"""Run code right after a module is imported (stdlib only: the plugin's failure guard needs it too)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def when_imported(name: str, hook: Callable) -> None:
    """Run ``hook(module)`` right after module ``name`` executes (now if already imported)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and spec is not None and not getattr(spec, "_initializing", False):
        hook(module)
        return
    sys.meta_path.insert(0, _PostImportFinder(name, hook))


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the other finders, then runs ``hook`` after the module executes."""

    def __init__(self, name: str, hook: Callable):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, hook = spec.loader.exec_module, self.hook

        def exec_then_hook(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook
        return spec
