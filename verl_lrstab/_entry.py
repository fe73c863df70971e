"""The ``verl.plugins`` entry point: verl imports this in every process on ``import verl``.

Nothing here may break a verl run, and verl logs a failing plugin at DEBUG only. A verl outside
the tested release series gets one WARNING here (:func:`verl_lrstab.glue.failsafe.announce_verl`);
the checks of each wrapped function then decide whether the plugin serves it. Every
module the glue needs is imported here one by one; one that fails is reported by name
(:func:`verl_lrstab.glue.failsafe.report_failure`: one ERROR naming verl's version and the
cause, verl's own code left in place, ``length_surge`` refused in this process), and the
glue is installed (:func:`verl_lrstab.glue.registry.install`). Only if the glue itself cannot
be installed are verl's optimizer configs guarded (:func:`verl_lrstab.glue.failsafe.arm_guard`). Runs that do not name
``length_surge`` are untouched: the wrappers call verl's own functions for them.
"""

import importlib

#: The package's modules a ``length_surge`` run needs, in import order (the glue last).
PACKAGE_MODULES = ("verl_lrstab._numbers", "verl_lrstab.config", "verl_lrstab.collective", "verl_lrstab.ratio",
                   "verl_lrstab.cusum", "verl_lrstab.mismatch_trigger", "verl_lrstab.decay", "verl_lrstab.detectors",
                   "verl_lrstab.feeding", "verl_lrstab.mismatch", "verl_lrstab.scheduler")


def load() -> None:
    try:
        from verl_lrstab.glue.failsafe import announce_verl, arm_guard, report_failure  # stdlib only
    except Exception as exc:  # noqa: BLE001 - a broken install: said here, since verl's DEBUG line is never seen
        import sys

        print(f"ERROR verl-lrstab: the plugin cannot load ({exc!r}); verl runs without it, and a run naming "
              "length_surge fails in verl's own config check. Reinstall verl-lrstab", file=sys.stderr, flush=True)
        return
    announce_verl()

    causes: set = set()  # modules importing a broken one fail with its error: report the first only

    def report(target: str, exc: BaseException) -> None:
        if repr(exc) not in causes:
            causes.add(repr(exc))
            report_failure(target, exc)

    for name in PACKAGE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported by name, verl would swallow it
            report(f"the package module {name}", exc)
    try:
        from verl_lrstab.glue import registry

        registry.install()
    except Exception as exc:  # noqa: BLE001
        report("verl_lrstab.glue (the glue itself)", exc)
        arm_guard()  # no wrap of ours is in place: only a guard on verl's config classes can refuse


load()
