"""What happens when the glue cannot work in a process (stdlib only).

Every failure of the glue, a verl target that cannot be wrapped or a module of the package
that does not import, goes through :func:`report_failure`: one ERROR naming verl's version,
the target and the cause; verl's own code stays in place, so runs that do not name
``length_surge`` are unaffected; and a run that names ``length_surge`` is refused from then
on (:func:`check_usable`, called by the glue wherever such a run is configured or built).

Only where the glue itself could not be installed (``verl_lrstab._entry`` found the registry
broken: no wrap of ours is in place to refuse anything) does a guard on verl's own
optimizer-config dataclasses refuse ``length_surge`` with the cause (:func:`arm_guard`); after
any other failure verl's classes stay as verl wrote them and the glue's own wraps refuse. A
refusal that cannot be installed (:func:`report_refusal_failure`) disables that refusal only.
This module imports nothing of the package, so it works whatever else of it is broken.
"""

from __future__ import annotations

import logging

from verl_lrstab.glue.imports import when_imported

logger = logging.getLogger("verl_lrstab")

SCHEDULER_NAME = "length_surge"  # verl_lrstab.config.SCHEDULER_NAME (not imported: it may be the broken one)
OPTIM = "actor_rollout_ref.actor.optim"  # verl_lrstab.config.OPTIM_KEY (not imported, as above)
OPTIM_KEY = f"{OPTIM}.lr_scheduler_type"

#: The verl release series the package is tested on. Another verl is not refused for its number: the
#: checks of each wrapped function decide (an ERROR names each mismatch, and ``length_surge`` is refused).
TESTED_VERL = "0.9"

#: ``(target, cause)`` of every failure of the glue in this process.
FAILURES: list = []
_guard_armed = False
_announced = False


def verl_version() -> str:
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001
        return "(unknown version)"


def serves_tested_verl(version: str) -> bool:
    """Whether ``version`` is a release of the tested series (``0.9.0``, ``0.9.1``, ``0.9.2rc1``; not ``0.10.0.dev0``)."""
    return version.split("+")[0].startswith(TESTED_VERL + ".")


def announce_verl() -> None:
    """At plugin load (once per process): a WARNING where verl is not a tested release, naming how it is decided.

    Silent on a tested release; the functions the glue wraps are checked as verl imports them, and
    each mismatch is an ERROR (:func:`report_failure`), so a user reading the log sees, in every
    process, whether the plugin serves this verl.
    """
    global _announced
    if _announced:
        return
    _announced = True
    version = verl_version()
    if not serves_tested_verl(version):
        logger.warning("verl-lrstab: verl %s is not a release this package was tested on (verl %s.x). Each verl "
                       "function the plugin wraps is checked as verl imports it: where one no longer matches, an "
                       "ERROR names it and a run with %s=%s is refused before it trains; runs that do not name "
                       "length_surge are unaffected. `lrstab check-verl` runs every check now.",
                       version, TESTED_VERL, OPTIM_KEY, SCHEDULER_NAME)


def report_failure(target: str, cause: BaseException) -> None:
    """Record a failure of the glue: one loud ERROR, and ``length_surge`` refused in this process from now on."""
    FAILURES.append((target, cause))
    logger.error("verl-lrstab: cannot use %s with verl %s: %r. verl's own code stays in place, so runs that do not "
                 "name length_surge are unaffected; a run with %s=%s is refused before it trains.",
                 target, verl_version(), cause, OPTIM_KEY, SCHEDULER_NAME)


def report_refusal_failure(target: str, cause: BaseException, where: str = "") -> None:
    """A refusal (a wrap that only refuses ``length_surge`` somewhere it is never fed) could not be installed:
    one ERROR; that refusal is off, ``length_surge`` on the supported paths is not affected."""
    logger.error("verl-lrstab: cannot install the refusal of %s at %s with verl %s: %r. That refusal is disabled: "
                 "naming length_surge %s is no longer refused (it would never be fed); the supported paths and "
                 "stock runs are unaffected.", SCHEDULER_NAME, target, verl_version(), cause, where or "there")


def report_optional_failure(target: str, cause: BaseException, fallback: str) -> None:
    """A wrap one trainer's runs need, not every run's, could not be installed: one ERROR saying what those runs get
    (``fallback``); ``length_surge`` elsewhere and stock runs are not affected."""
    logger.error("verl-lrstab: cannot use %s with verl %s: %r. verl's own code stays in place; %s. Other trainers "
                 "and stock runs are unaffected.", target, verl_version(), cause, fallback)


def failure_message() -> str:
    causes = "; ".join(f"{target}: {cause!r}" for target, cause in FAILURES)
    return (f"{OPTIM_KEY}={SCHEDULER_NAME} cannot be used: the verl-lrstab plugin failed to load or to wrap "
            f"verl {verl_version()} in this process ({causes}). Runs with lr_scheduler_type constant or cosine "
            "are unaffected. `lrstab check-verl` lists what in this verl no longer matches.")


class GlueUnavailable(RuntimeError):
    """``length_surge`` named in a process where the glue failed (the message names the target and the cause)."""


def check_usable() -> None:
    """Raise :class:`GlueUnavailable` with the recorded causes if the glue failed in this process."""
    if FAILURES:
        raise GlueUnavailable(failure_message()) from FAILURES[0][1]


def arm_guard() -> None:
    """Make every verl optimizer config that names ``length_surge`` raise :func:`failure_message`.

    Armed by the entry point only when the glue itself could not be installed: then no wrap of
    ours is in place, and verl's Megatron config would accept ``lr_decay_style: length_surge``
    (megatron-core raises only after the warmup).
    """
    global _guard_armed
    if _guard_armed:
        return
    _guard_armed = True
    when_imported("verl.workers.config.optimizer", _guard_module, on_error=_guard_failed)
    when_imported("verl.workers.config", _guard_module, on_error=_guard_failed)


def _guard_module(module) -> None:
    """Guard verl's optimizer-config dataclasses: those with an ``lr_scheduler_type`` (or Megatron's
    ``lr_decay_style``) field, found by field, not by name, so a renamed class is guarded too.

    ``__init__``: a config naming ``length_surge`` raises :func:`failure_message`; the
    ``length_surge:`` options node (a field verl's class does not have) is dropped with a
    WARNING, so that a stock run whose YAML keeps the node (``lr_scheduler_type=constant``
    for a baseline) trains on verl's code, as it would with the glue working.
    ``__post_init__``: the same check for configs built another way.
    """
    for cls in list(vars(module).values()):
        fields = getattr(cls, "__dataclass_fields__", None)
        if not isinstance(cls, type) or not fields or not {"lr_scheduler_type", "lr_decay_style"} & set(fields):
            continue
        if "length_surge" in fields or getattr(cls.__dict__.get("__init__"), "_lrstab_guard", False):
            continue  # the glue's own class (it checks itself), or guarded already
        init, post_init = cls.__dict__.get("__init__"), cls.__dict__.get("__post_init__")

        def __init__(self, *args, _init=init, **kwargs):
            options = kwargs.pop("length_surge", None)
            if _names_length_surge(kwargs.get):
                check_usable()
            if options:
                logger.warning("verl-lrstab: %s.length_surge is ignored: the plugin failed to load, and the run "
                               "does not name length_surge", OPTIM_KEY.rsplit(".", 1)[0])
            _init(self, *args, **kwargs)

        setattr(__init__, "_lrstab_guard", True)  # set on verl's class at run time: setattr says so
        if init is not None:
            setattr(cls, "__init__", __init__)
        if post_init is not None:
            def __post_init__(self, _original=post_init):
                if _names_length_surge(lambda key: getattr(self, key, None)):
                    check_usable()
                _original(self)

            setattr(cls, "__post_init__", __post_init__)


def _names_length_surge(get) -> bool:
    """Whether a config names length_surge under any of verl's scheduler keys (``get(key)`` reads one)."""
    return SCHEDULER_NAME in (get("lr_scheduler_type"), get("warmup_style"), get("lr_decay_style"))


def _guard_failed(name: str, exc: BaseException) -> None:
    logger.error("verl-lrstab: could not guard %s against lr_scheduler_type=length_surge: %r", name, exc)
