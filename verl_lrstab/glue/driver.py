"""Trainer-side glue (verl's driver / TaskRunner process): the run's checks, the step tag, pre-rejection mismatch.

- ``RayPPOTrainer.__init__`` (V0) and ``PPOTrainer.__init__`` (V1): a ``length_surge`` run is
  checked as a whole before it trains (:func:`check_run`): every wrap it needs installed in
  this process, and the options that need more than the optimizer config (rollout log-probs
  for the mismatch trigger, not with an async trainer: decided by the trainer's class,
  :mod:`.trainers`), and the rollout configurations known to bias the mismatch figures are
  warned about (:mod:`verl_lrstab.mismatch_checks`), and every node of the Ray cluster must import the
  package (:mod:`.nodes`). A trainer whose checks never ran (its
  ``__init__`` skips verl's) is refused at its first ``_update_actor``, naming its class.
- ``_update_actor`` (V0, V1): tags the actor batch with its position in the trainer step
  (:data:`~verl_lrstab.glue.worker.STEP_POSITION_KEY`); the worker refuses an untagged batch.
- ``compute_rollout_correction_and_add_to_batch``: with rejection sampling (``rollout_rs``) it
  overwrites ``response_mask``; for a ``length_surge`` run the mismatch sums are taken over the
  mask before that and handed to the worker with the batch.

Runs that do not name ``length_surge`` go straight to verl's functions (:func:`~.wraps.dispatch`).
"""

from __future__ import annotations

import logging
import threading
import weakref

from verl_lrstab.config import OPTIONS_KEY
from verl_lrstab.glue import nodes, trainers, versions
from verl_lrstab.glue.optimizer_subclasses import length_surge_options
from verl_lrstab.glue.failsafe import SCHEDULER_NAME
from verl_lrstab.glue.wraps import argument, dispatch, source_contains
from verl_lrstab.glue.steps import PRE_RS_STATS_KEY, STEP_POSITION_KEY, VERSION_LAGS_KEY, GlueError

logger = logging.getLogger("verl_lrstab")

_run = threading.local()  # per thread: verl's trainer runs in one thread of its process
#: trainer -> whether its rollout is async, for every live length_surge trainer whose run-level checks ran
#: (weak: once a run's trainer is gone, a stock trainer built later in the process pays nothing)
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def names_length_surge(config) -> bool:
    """Whether a verl trainer config names ``length_surge`` for the actor (FSDP or Megatron key)."""
    optim = config.actor_rollout_ref.actor.optim
    return SCHEDULER_NAME in (optim.get("lr_scheduler_type"), optim.get("lr_decay_style"))


def trainer_mode(config) -> str:
    """``sync`` for V0, else V1's ``trainer.v1.trainer_mode``."""
    trainer = config.trainer
    if not trainer.get("use_v1", True):
        return "sync"
    return (trainer.get("v1") or {}).get("trainer_mode", "sync") or "sync"


def trainer_class(config) -> type:
    """The class verl's main_ppo builds for ``config``: V0's ``RayPPOTrainer``, or V1's registered mode."""
    if not config.trainer.get("use_v1", True):
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        return RayPPOTrainer
    from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls

    try:
        return get_trainer_cls(trainer_mode(config))
    except (KeyError, ValueError):  # not registered (yet) in this process: judged as verl's base, async
        return PPOTrainer


def run_is_async(config, trainer_cls: type) -> bool:
    """Whether ``trainer_cls`` run with ``config`` may sample with older weights (by class: :mod:`.trainers`)."""
    return trainers.is_async(trainer_cls, trainer_mode(config) if trainers._is_v1(trainer_cls) else None)


def check_run(config, require, trainer=None) -> bool:
    """Refuse, before training, a ``length_surge`` run the glue cannot serve in this process.

    ``require(engine, trainer)``: the registry's check that every wrap the run needs is installed here
    (``trainer``: ``v0`` or ``v1``, from ``trainer.use_v1``).
    ``trainer``: the trainer being built (its class decides whether the rollout is async; without
    it, the class main_ppo would build for the config). Returns whether the run is async.
    """
    actor = config.actor_rollout_ref.actor
    cls = type(trainer) if trainer is not None else trainer_class(config)
    # the trainer's own shape decides which wraps it needs (the one-step-off trainer is V0-shaped under any use_v1)
    family = ("v1" if trainers._is_v1(cls) else "v0") if trainer is not None else \
        ("v1" if config.trainer.get("use_v1", True) else "v0")
    require("megatron" if actor.get("strategy") == "megatron" else "fsdp", family)
    options = length_surge_options(actor.optim.get("length_surge"))
    is_async = run_is_async(config, cls)
    key = f"{OPTIONS_KEY}.trigger"
    if options.trigger != "length":
        if not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
            raise GlueError(f"{key}={options.trigger!r} needs the rollout engine's log-probs: set "
                            "actor_rollout_ref.rollout.calculate_log_probs=true (or trigger: length)")
        if is_async:
            raise GlueError(f"{key}={options.trigger!r} is not supported with the trainer {trainers.describe(cls)} "
                            f"(trainer.v1.trainer_mode={trainer_mode(config)!r}): its rollout may sample with older "
                            "weights than the trainer scores with, so the mismatch figures mix engine mismatch "
                            "with policy staleness and the trigger would react to staleness. Allowed: trigger: "
                            "length (the mismatch/* figures are still logged), or trainer_mode: sync")
    warn_about_rollout_config(config)
    nodes.check_every_node()
    if trainer is not None:
        _checked[trainer] = is_async
    return is_async


def checked_async(trainer) -> bool:
    """Whether ``trainer``'s rollout is async, as its run-level checks found; a trainer whose checks never
    ran (its ``__init__`` does not reach verl's ``RayPPOTrainer.__init__`` / ``PPOTrainer.__init__``) is refused."""
    try:
        return _checked[trainer]
    except (KeyError, TypeError):
        pass
    cls = type(trainer)
    raise GlueError(f"verl_lrstab: {SCHEDULER_NAME} is not supported with the trainer {trainers.describe(cls)}: its "
                    "__init__ does not run verl's RayPPOTrainer.__init__ / PPOTrainer.__init__, where the run's "
                    "checks (the mismatch trigger's needs, whether its rollout is async) are made, so the "
                    "scheduler could be fed figures it must not use. Supported: verl's main_ppo trainers (V0 "
                    "RayPPOTrainer, V1 sync / colocate_async / separate_async) and subclasses that call "
                    "super().__init__.")


def warn_about_rollout_config(config) -> None:
    """The admission check's configuration checks, as warnings at the start of a length_surge run."""
    from verl_lrstab.mismatch_checks import check_rollout_config

    try:
        findings = check_rollout_config(config)
    except Exception as exc:  # noqa: BLE001 - a check must never stop a run it would only warn
        logger.warning("verl_lrstab: the rollout configuration checks could not run (%r)", exc)
        return
    for f in findings:
        logger.warning("verl_lrstab: %s [%s]", f.message, f.code)


def make_trainer_init(original_fn, require):
    def check_then_init(original, *args, **kwargs):
        check_run(argument(args, kwargs, 1, "config"), require, trainer=args[0])
        return original(*args, **kwargs)

    return dispatch(original_fn, lambda self, *a, **k: names_length_surge(argument((self,) + a, k, 1, "config")),
                    check_then_init)


def make_v1_update_actor(original_fn):
    def tag_then_update(original, self, *args, **kwargs):
        batch = argument((self,) + args, kwargs, 1, "batch")
        is_async = checked_async(self)
        count = int(getattr(self, "parameter_sync_step", 1) or 1)
        index = int(getattr(self, "local_trigger_step", 0) or 0)
        _tag(batch.extra_info, [index, count, int(is_async), response_cap(self.config)])
        if is_async:
            _tag_lags(batch.extra_info, versions.lags_or_none(versions.v1_lags, self, batch, index))
        return original(self, *args, **kwargs)

    return dispatch(original_fn, lambda self, *a, **k: names_length_surge(self.config), tag_then_update)


def v1_trainer_checks(module, fn):
    trainer = module.PPOTrainer
    yield "V1 PPOTrainer.step runs parameter_sync_step updates, local_trigger_step = index", *source_contains(
        trainer.step, "for trigger_idx in range(self.parameter_sync_step)", "self.local_trigger_step = trigger_idx")
    yield "V1 PPOTrainer._update_actor sends batch.extra_info to update_actor", *source_contains(
        fn, "batch.extra_info.update", "update_actor(batch)")
    yield "V1 PPOTrainer.__init__ keeps the config as self.config", *source_contains(
        trainer.__init__, "self.config = config")


def make_v0_update_actor(original_fn):
    def tag_then_update(original, self, *args, **kwargs):
        batch = argument((self,) + args, kwargs, 1, "batch")
        is_async = checked_async(self)
        index, count = versions.v0_position(self)  # V0: one update per trainer step; fully-async: a sync cycle's
        _tag(batch.meta_info, [index, count, int(is_async), response_cap(self.config)])
        if is_async:
            _tag_lags(batch.meta_info, versions.lags_or_none(versions.v0_lags, self, batch))
        return original(self, *args, **kwargs)

    return dispatch(original_fn, lambda self, *a, **k: names_length_surge(self.config), tag_then_update)


def v0_trainer_checks(module, fn):
    yield "V0 RayPPOTrainer._update_actor sends the whole batch with attention_mask (the length's source)", \
        *source_contains(fn, "batch_td = batch.to_tensordict()", "left_right_2_no_padding(batch_td)")
    yield "V0 RayPPOTrainer.__init__ keeps the config as self.config", *source_contains(
        module.RayPPOTrainer.__init__, "self.config = config")


def one_step_off_checks(module, fn):
    trainer = module.OneStepOffRayTrainer
    yield "OneStepOffRayTrainer.__init__ keeps the config as self.config", *source_contains(
        trainer.__init__, "self.config = config")
    yield "OneStepOffRayTrainer syncs the weights under global_steps before the step's update", *source_contains(
        trainer._fit_generate, "self._fit_update_weights()")
    yield "OneStepOffRayTrainer.fit syncs the loaded weights before its first step", *source_contains(
        trainer.fit, "self._load_checkpoint()", "self._fit_update_weights()", "self.global_steps += 1")


def fully_async_checks(module, fn):
    trainer = module.FullyAsyncTrainer.__ray_actor_class__
    yield "FullyAsyncTrainer.__init__ keeps the config as self.config", *source_contains(
        trainer.__init__, "self.config = config")
    yield "FullyAsyncTrainer counts a sync cycle's updates in local_trigger_step from 1", *source_contains(
        trainer.__init__, "self.local_trigger_step = 1", "self.trigger_parameter_sync_step = ")
    yield "FullyAsyncTrainer's old-log-prob pass scores with the cycle's first weights", *source_contains(
        trainer._compute_old_log_prob, "restore_model_from_cpu(1)")
    yield "FullyAsyncTrainer advances current_param_version after a cycle's last update", *source_contains(
        trainer._fit_update_local_step, "self.current_param_version += 1", "self.local_trigger_step = 1")


def response_cap(config) -> int:
    """The rollout's response cap in tokens (``actor_rollout_ref.rollout.response_length``, which verl
    sets from ``data.max_response_length``); 0 if the config has neither (no clip ratio is fed then)."""
    from verl_lrstab.mismatch_checks import config_value

    for path in ("actor_rollout_ref.rollout.response_length", "data.max_response_length"):
        try:
            cap = int(config_value(config, path, 0))
        except (TypeError, ValueError):
            continue
        if cap > 0:
            return cap
    return 0


def _tag(info: dict, position: list) -> None:
    """Put the step position ``[index, count, is_async, response cap]``, and the pre-rejection stats if
    any, where verl hands them to the worker."""
    info[STEP_POSITION_KEY] = position
    stats = _pop_pre_rs_stats()
    if stats is not None:
        info[PRE_RS_STATS_KEY] = stats


def _tag_lags(info: dict, lags) -> None:
    """An async trainer's version -> lag map, where verl hands it to the worker (none: the figures stay unsplit)."""
    if lags is not None:
        info[VERSION_LAGS_KEY] = lags


def make_rollout_correction(original_fn):
    def stash_then_correct(original, batch, *args, **kwargs):
        _stash_pre_rs_stats(batch)
        return original(batch, *args, **kwargs)

    return dispatch(original_fn, _rejects_in_length_surge_run, stash_then_correct)


def _rejects_in_length_surge_run(batch, rollout_corr_config, *args, **kwargs) -> bool:
    """Only rejection sampling changes the mask; only a live length_surge trainer reads the figures."""
    return len(_checked) > 0 and rollout_corr_config.get("rollout_rs", None) is not None


def rollout_correction_checks(module, fn):
    yield "compute_rollout_correction_and_add_to_batch overwrites batch response_mask", *source_contains(
        fn, 'batch.batch["response_mask"] = modified_response_mask')
    yield "compute_rollout_correction_and_add_to_batch reads rollout_rs from the config", *source_contains(
        fn, 'rollout_corr_config.get("rollout_rs"')


def _stash_pre_rs_stats(batch) -> None:
    """The mismatch stats of the whole batch over ``response_mask`` before rejection sampling."""
    from verl_lrstab import mismatch

    tensors = batch.batch
    _run.pre_rs = None
    if "rollout_log_probs" in tensors.keys() and "old_log_probs" in tensors.keys():
        stats = mismatch.compute_stats(tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"])
        _run.pre_rs = None if stats is None else stats.cpu().tolist()


def _pop_pre_rs_stats():
    stats, _run.pre_rs = getattr(_run, "pre_rs", None), None
    return stats
