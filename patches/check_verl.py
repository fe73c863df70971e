"""Check that what verl-lrstab wraps in verl still has the shape the wrappers rely on.

The same checks run in-process when the plugin installs each wrap (``verl_lrstab.glue.registry``):
a target that fails them is left unwrapped, and ``length_surge`` is refused with the cause.
This script prints them all for the installed verl.

Exit status 0 when every check passes; otherwise one line per failed check and status 1.
"""

from __future__ import annotations

import importlib
import sys


def checks():
    """Yield (name, ok, detail) for each assumption the glue makes about verl; ``ok`` None: not checked,
    the target's module needs a package verl does not require that is not installed (megatron-core:
    ``make install-megatron``), so verl cannot run that path here either."""
    import verl

    from verl_lrstab.glue import registry, signals, wraps

    yield "verl version 0.9.x", verl.__version__.startswith("0.9."), verl.__version__
    for wrap in registry.WRAPS:
        try:
            module = importlib.import_module(wrap.module)
            owner = wraps.owner_of(wrap, module)
            current = getattr(owner, wrap.attribute)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != "verl":  # verl's module needs an extra not installed here
                yield f"{wrap.target} exists", None, f"not checked: {exc.name} is not installed ({exc})"
            else:
                yield f"{wrap.target} exists", False, repr(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - a missing target is a failed check
            yield f"{wrap.target} exists", False, repr(exc)
            continue
        yield f"{wrap.target} exists", True, ""
        yield from wraps.shape_checks(wrap, module, current)
    yield from signals.assumption_checks()


def main() -> int:
    failed = 0
    for name, ok, detail in checks():
        print(f"{'skip' if ok is None else 'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail and not ok else ""))
        failed += ok is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
