"""``lrstab check-verl``: whether the installed verl still has the shape the plugin relies on.

The same checks run inside verl's processes as the plugin wraps each verl function
(:mod:`verl_lrstab.glue.registry`): a target that fails them is left as verl wrote it, and a
``length_surge`` run is refused before it trains, naming the cause. This command runs them all
at once against the verl of the current environment, one line per check::

    ok   <check>
    FAIL <check> (<what verl has instead>)
    skip <check> (<why: the target's module needs a package verl does not require, e.g. megatron-core>)
    note <check> (<information: the verl release is not one the package was tested on>)

The last lines are the verdict: the count of passed, skipped and failed checks, each skipped
check again with its reason, and one line that says "every check passed" only when none was
skipped or failed. A skipped check counts as not passed: a ``length_surge`` run that needs its
target is refused before it trains (:func:`verl_lrstab.glue.registry.require`), as after a failed one.

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

    from verl_lrstab.glue import batch_figures, registry, wraps
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
    yield from batch_figures.assumption_checks()


def line(name: str, ok, detail: str) -> str:
    status = {True: "ok  ", False: "FAIL", None: "skip", "note": "note"}[ok]
    return f"{status} {name}" + (f" ({detail})" if detail and ok is not True else "")


def run(out=None) -> int:
    """Print one line per check, then the verdict; return 1 if any failed (or verl is missing), else 0."""
    out = out or sys.stdout
    try:
        importlib.import_module("verl")
    except Exception as exc:  # noqa: BLE001 - no verl here: nothing to serve
        print(f"FAIL verl imports ({exc!r}): install verl-lrstab into the environment that runs verl", file=out)
        return 1
    results = list(checks())
    for name, ok, detail in results:
        print(line(name, ok, detail), file=out)
    for text in verdict(results):
        print(text, file=out)
    return 1 if any(ok is False for _, ok, _ in results) else 0


def verdict(results: list) -> list[str]:
    """The closing lines: the counts, each skipped check with its reason, and the one-line verdict (last)."""
    passed = sum(ok is True for _, ok, _ in results)
    skipped = [(name, detail) for name, ok, detail in results if ok is None]
    failed = sum(ok is False for _, ok, _ in results)
    lines = [f"checks: {passed} passed, {len(skipped)} skipped, {failed} failed"]
    lines += [f"skipped: {name} ({detail})" for name, detail in skipped]
    if failed:
        lines.append(f"verl-lrstab cannot serve this verl: {failed} check(s) failed; a length_surge run is refused "
                     "before it trains, stock schedulers are unaffected")
    elif skipped:
        lines.append(f"verl-lrstab serves this verl only where it could check it: {len(skipped)} check(s) could not "
                     "run (above, each with the package it needs); a length_surge run that needs one of them is "
                     "refused before it trains, stock schedulers are unaffected")
    else:
        lines.append("verl-lrstab serves this verl: every check passed")
    return lines


def cmd_check_verl(args) -> int:
    return run()


def add_parser(sub) -> None:
    p = sub.add_parser("check-verl", help="check that the installed verl has the shape the plugin wraps")
    p.set_defaults(func=cmd_check_verl)
