"""The verl targets the glue wraps (one list), their installation, and what a ``length_surge`` run requires.

``lrstab check-verl`` (:mod:`verl_lrstab.cli.check_verl`) prints the checks of each against the
installed verl. To wrap another target, append a :class:`~.wraps.Wrap`.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Optional

from verl_lrstab.glue import optimizer_subclasses as configs
from verl_lrstab.glue import driver, engine, refusals, worker
from verl_lrstab.glue.failsafe import FAILURES, check_usable, report_failure
from verl_lrstab.glue.imports import when_imported
from verl_lrstab.glue.wraps import Wrap, apply, original, owner_of

#: What a run of an async trainer whose run-check wrap cannot be installed gets (driver.checked_async).
REFUSED_AT_FIRST_UPDATE = ("a length_surge run of {} is refused at its first actor update, before the batch reaches "
                           "a worker (its run checks could not run)")

WRAPS: list = [
    Wrap("verl.workers.config", None, "FSDPOptimizerConfig", None,
         lambda verl_cls: configs.make_config("LengthSurgeOptimizerConfig", verl_cls, require),
         configs.fsdp_config_checks,
         also_in=("verl.workers.config.optimizer",)),
    Wrap("verl.workers.config", None, "McoreOptimizerConfig", None,
         lambda verl_cls: configs.make_config("LengthSurgeMcoreOptimizerConfig", verl_cls, require),
         configs.mcore_config_checks,
         also_in=("verl.workers.config.optimizer",)),
    Wrap("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine", "_build_lr_scheduler", ("self", "optimizer"),
         engine.make_fsdp_build, engine.fsdp_engine_checks),
    Wrap("verl.workers.engine.megatron.transformer_impl", "MegatronEngine", "_build_lr_scheduler", ("self",),
         engine.make_megatron_build, engine.megatron_engine_checks),
    Wrap("verl.workers.engine_workers", "TrainingWorker", "train_mini_batch", ("self", "data"),
         worker.make_train_mini_batch, worker.worker_checks),
    Wrap("verl.workers.engine_workers", "TrainingWorker", "infer_batch", ("self", "data"),
         worker.make_infer_batch, worker.infer_checks),
    Wrap("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "__init__", ("self", "config"),
         lambda verl_fn: driver.make_trainer_init(verl_fn, require)),
    Wrap("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_update_actor", ("self", "batch", "metrics"),
         driver.make_v1_update_actor, driver.v1_trainer_checks),
    Wrap("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "__init__",
         ("self", "config", "tokenizer", "role_worker_mapping", "resource_pool_manager"),
         lambda verl_fn: driver.make_trainer_init(verl_fn, require)),
    Wrap("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "_update_actor", ("self", "batch"),
         driver.make_v0_update_actor, driver.v0_trainer_checks),
    # its __init__ skips RayPPOTrainer.__init__ (where a run is checked): the same checks at its own; not
    # required: where it cannot be installed, the run is refused at its first _update_actor (driver.checked_async)
    Wrap("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer", "__init__",
         ("self", "config", "tokenizer", "role_worker_mapping", "resource_pool_manager"),
         lambda verl_fn: driver.make_trainer_init(verl_fn, require), driver.one_step_off_checks, required=False,
         fallback=REFUSED_AT_FIRST_UPDATE.format("the one-step-off-policy trainer")),
    # a Ray actor class: Ray builds the actor from the class it made at decoration (modified_class), whose
    # __init__ is its own copy (Ray's tracing wrapper of verl's): wrapping __ray_actor_class__ would never run
    Wrap("verl.experimental.fully_async_policy.fully_async_trainer",
         "FullyAsyncTrainer.__ray_metadata__.modified_class",
         "__init__", ("self", "config", "tokenizer", "role_worker_mapping", "resource_pool_manager"),
         lambda verl_fn: driver.make_trainer_init(verl_fn, require), driver.fully_async_checks, required=False,
         fallback=REFUSED_AT_FIRST_UPDATE.format("the fully-async trainer")),
    Wrap("verl.trainer.ppo.rollout_corr_helper", None, "compute_rollout_correction_and_add_to_batch",
         ("batch", "rollout_corr_config"), driver.make_rollout_correction, driver.rollout_correction_checks,
         also_in=("verl.trainer.ppo.v1.trainer_base",)),
    *refusals.WRAPS,
]

#: The modules whose wraps a ``length_surge`` run needs: every run's, its engine's and its trainer's.
REQUIRED_MODULES = {
    "common": ("verl.workers.config", "verl.workers.engine_workers", "verl.trainer.ppo.rollout_corr_helper"),
    "fsdp": ("verl.workers.engine.fsdp.transformer_impl",),
    "megatron": ("verl.workers.engine.megatron.transformer_impl",),
    "v0": ("verl.trainer.ppo.ray_trainer",),
    "v1": ("verl.trainer.ppo.v1.trainer_base",),
}
TRAINERS = ("v0", "v1")

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install every wrap now if its module is loaded, else the moment it is imported (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    by_module: dict = {}
    for wrap in WRAPS:
        by_module.setdefault(wrap.module, []).append(wrap)
    for name, wraps in by_module.items():
        when_imported(name, functools.partial(_apply_all, wraps), on_error=report_failure)


def _apply_all(wraps: list, module) -> None:
    for wrap in wraps:
        apply(wrap, module)


def require(engine_name: str, trainer: Optional[str] = None) -> None:
    """Refuse (:class:`~.failsafe.GlueUnavailable`) a ``length_surge`` run the glue cannot serve in this process.

    Imports the modules of every wrap the run needs, driver-side ones included, so that a
    wrap that cannot be installed fails the run wherever its config is first built (the
    driver validates the actor config before the trainer's modules are imported; the
    workers never import them otherwise). A module that does not import refuses the run,
    also where it needs a package verl does not require and that is not installed: its
    wraps, and the checks ``lrstab check-verl`` reports as skipped, could not run.

    Args:
        engine_name: ``fsdp`` or ``megatron``.
        trainer: ``v0`` or ``v1`` where the run's trainer is known (the driver's check of the
            run, before it trains). None where only the actor's config is built: both trainers'
            modules are imported, and one that needs a package not installed here is left to
            the run's check (a V0 run does not need V1's TransferQueue).
    """
    install()
    if trainer is not None and trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r}: allowed values are {list(TRAINERS)} or None")
    run_modules = REQUIRED_MODULES["common"] + REQUIRED_MODULES[engine_name]
    run_modules += REQUIRED_MODULES[trainer] if trainer else ()
    for name in run_modules + tuple(m for t in TRAINERS for m in REQUIRED_MODULES[t] if m not in run_modules):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if name in run_modules or (exc.name or "").split(".")[0] == "verl":
                _report_once(name, _missing(name, exc))
            continue
        except Exception as exc:  # noqa: BLE001 - verl's module itself fails: reported, then refused below
            _report_once(name, exc)
            continue
        failed = {target for target, _ in FAILURES}
        for wrap in WRAPS:
            if wrap.module == name and wrap.required and wrap.target not in failed and not _is_wrapped(wrap, module):
                apply(wrap, module)  # not yet (a hook that never ran): installs it or reports why not
    check_usable()


def _report_once(name: str, exc: BaseException) -> None:
    if name not in {target for target, _ in FAILURES}:  # every config built calls require: one ERROR is enough
        report_failure(name, exc)


def _missing(name: str, exc: ModuleNotFoundError) -> BaseException:
    """The cause of a required module that does not import, naming the package to install where it is not verl."""
    top = (exc.name or "").split(".")[0]
    if not top or top == "verl":
        return exc
    return ModuleNotFoundError(f"{name} needs the module {top}, which is not installed here (verl imports it "
                               "without requiring it): install the package that provides it; `lrstab check-verl` "
                               "lists every check it skips", name=exc.name)


def _is_wrapped(wrap: Wrap, module) -> bool:
    try:
        current = getattr(owner_of(wrap, module), wrap.attribute)
    except AttributeError:
        return False
    return original(current) is not current or getattr(current, "__module__", "").startswith("verl_lrstab")
