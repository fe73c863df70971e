"""``lrstab check-verl``: whether the installed verl still has the shape the plugin relies on.

The same checks run inside verl's processes as the plugin wraps each verl function
(:mod:`verl_lrstab.glue.registry`): a target that fails them is left as verl wrote it, and a
``length_surge`` run is refused before it trains, naming the cause. This command runs them all
at once against the verl of the current environment, one line per check::

    ok   <check>
    FAIL <check> (<what verl has instead>)
    skip <check> (<why: the target's module needs a package verl does not require, e.g. megatron-core>)
    note <check> (<information: the verl release is not one the package was tested on>)

Exit status 0 when no check fails (``note`` and ``skip`` lines included), 1 otherwise, 1 also
when verl is not installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import Iterable


def checks() -> Iterable[tuple]:
    """Yield ``(check, ok, detail)`` for each assumption the glue makes about the installed verl.

    ``ok`` is True, False, None (not checked: the target's module needs a package verl does not
    require that is not installed, so verl cannot run that path here either) or ``"note"``
    (the version line of a verl release outside the tested series: information, not a failure;
    the target checks decide).
    """
    import verl

    from verl_lrstab.glue import registry, signals, wraps
    from verl_lrstab.glue.failsafe import TESTED_VERL, serves_tested_verl

    version = verl.__version__
    if serves_tested_verl(version):
        yield f"verl {version} is a tested release (verl {TESTED_VERL}.x)", True, ""
    else:
        yield (f"verl {version} is not a tested release (verl {TESTED_VERL}.x)", "note",
               "the checks below decide whether the plugin serves it")
    for wrap in registry.WRAPS:
        try:
            module = importlib.import_module(wrap.module)
            owner = wraps.owner_of(wrap, module)
            current = getattr(owner, wrap.attribute)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != "verl":  # verl's module needs a package not installed here
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


def line(name: str, ok, detail: str) -> str:
    status = {True: "ok  ", False: "FAIL", None: "skip", "note": "note"}[ok]
    return f"{status} {name}" + (f" ({detail})" if detail and ok is not True else "")


def run(out=None) -> int:
    """Print one line per check; return 1 if any failed (or verl is missing), else 0."""
    out = out or sys.stdout
    try:
        importlib.import_module("verl")
    except Exception as exc:  # noqa: BLE001 - no verl here: nothing to serve
        print(f"FAIL verl imports ({exc!r}): install verl-lrstab into the environment that runs verl", file=out)
        return 1
    failed = 0
    for name, ok, detail in checks():
        print(line(name, ok, detail), file=out)
        failed += ok is False
    summary = (f"verl-lrstab cannot serve this verl: {failed} check(s) failed; a length_surge run is refused "
               "before it trains, stock schedulers are unaffected" if failed else
               "verl-lrstab serves this verl: every check passed")
    print(summary, file=out)
    return 1 if failed else 0


def cmd_check_verl(args) -> int:
    return run()


def add_parser(sub) -> None:
    p = sub.add_parser("check-verl", help="check that the installed verl has the shape the plugin wraps")
    p.set_defaults(func=cmd_check_verl)
