"""Trainer side: which weight versions a batch's samples were drawn with, and how far each is behind.

verl tags every sample with the versions it was sampled with (``min_global_steps`` /
``max_global_steps``: the ``global_steps`` the rollout's weights were synced under). What a
version means depends on when the trainer syncs, so the map version -> lag is made here, where
the trainer is, and travels with the step tag (:data:`~.steps.VERSION_LAGS_KEY`); the worker
splits the mismatch figures by it (:mod:`verl_lrstab.version_split`). A lag counts weight changes
of the actor between the sync and the update: 0 is the trainer's own weights.

- V1 ``colocate_async`` / ``separate_async``: the weights are synced under ``global_steps`` after
  the step's updates (``on_step_end``; at start under the loaded step), so at step G the trainer's
  weights are version G - 1 (verl's own ``training/off_policy/trajectory_staleness`` is
  ``(G - 1) - max_global_steps``). The lag is that of the weights the old-log-prob pass scores with:
  ``separate_async`` restores the step's first weights for it on every update of the step (one
  pi_old a step: verl's ``_compute_old_log_prob``); a trainer that does not (``colocate_async`` with
  ``parameter_sync_step`` > 1) scores a step's later updates with weights the step already changed:
  every version is one more behind there.
- ``OneStepOffRayTrainer`` (V0-shaped): step G syncs under G before its update, so version t >= the
  first step holds the weights after t - 1 updates, and the sync at ``fit``'s start, under the
  step before the first (the loaded step), the weights after that many: at step G the trainer's
  weights are version G (and the start's version on the first step), version t is G - t behind,
  the start's version G - 1 - t. Its batch was sampled during the previous step: lag 1 from the
  second step on.
- ``FullyAsyncTrainer`` (V0-shaped, a Ray actor): one logged step is a sync cycle of
  ``trigger_parameter_sync_step`` updates; at its end ``current_param_version`` advances and the weights
  are synced under it. Its old-log-prob pass always scores with the cycle's first weights (verl restores
  them: ``_compute_old_log_prob``), the weights of version ``current_param_version``: version t is
  ``current_param_version - t`` behind, on every update of the cycle.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, Optional

from verl_lrstab.glue import trainers

logger = logging.getLogger("verl_lrstab")


def flat(lags: dict) -> list:
    """``{version: lag}`` as the tag travels: ``[version, lag, ...]`` (plain ints)."""
    return [int(x) for item in sorted(lags.items()) for x in item]


def versions_in(pairs: Iterable) -> set:
    """The versions named by ``(min, max)`` pairs, None left out."""
    return {int(v) for pair in pairs for v in pair if v is not None}


def v1_tags_versions(batch) -> set:
    """The versions of a V1 ``KVBatchMeta``'s samples (its ``tags``)."""
    return versions_in((t.get("min_global_steps"), t.get("max_global_steps")) for t in batch.tags)


#: V1 trainers whose old-log-prob pass restores the step's first weights on the step's later updates
V1_SCORE_WITH_FIRST_WEIGHTS = {("verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync")}


def v1_lags(trainer, batch, index: int) -> dict:
    """V1 async modes: version ``v`` is ``(global_steps - 1) - v`` behind; one more on a step's later updates
    (``index`` > 0) of a trainer that scores them with the weights the step changed (by class)."""
    current = int(trainer.global_steps) - 1
    moved = index > 0 and trainers.verl_class(type(trainer)) not in V1_SCORE_WITH_FIRST_WEIGHTS
    return {v: current - v + int(moved) for v in v1_tags_versions(batch)}


def v0_batch_versions(batch) -> set:
    """The versions of a V0-shaped ``DataProto``'s samples (the agent loop's non-tensor fields)."""
    fields = batch.non_tensor_batch
    if "min_global_steps" not in fields or "max_global_steps" not in fields:
        return set()
    return versions_in(zip(fields["min_global_steps"], fields["max_global_steps"]))


#: trainer -> the first step it updated in this process (its ``fit`` synced the loaded weights just before)
_first_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def one_step_off_lags(trainer, batch) -> dict:
    """``OneStepOffRayTrainer``: version t is ``G - t`` behind at step G; the sync at ``fit``'s start
    (under the step before the first) holds the weights of the first step's update: ``G - 1 - t``."""
    step = int(trainer.global_steps)
    first = _first_step.setdefault(trainer, step)
    return {t: (step - t if t >= first else step - 1 - t) for t in v0_batch_versions(batch)}


def fully_async_lags(trainer, batch) -> dict:
    """``FullyAsyncTrainer``: version t is ``current_param_version - t`` behind (the old-log-prob pass's weights)."""
    current = int(trainer.current_param_version)
    return {t: current - t for t in v0_batch_versions(batch)}


#: V0-shaped async trainers (by verl's class name in the MRO) -> their map of versions to lags
V0_RULES = {"OneStepOffRayTrainer": one_step_off_lags, "FullyAsyncTrainer": fully_async_lags}


def v0_position(trainer) -> tuple:
    """``(index of the update in the logged step, updates per logged step)`` of a V0-shaped trainer: the
    fully-async trainer logs one step per sync cycle of ``trigger_parameter_sync_step`` updates
    (``local_trigger_step`` counts them from 1); every other one update a step."""
    if any(k.__name__ == "FullyAsyncTrainer" and k.__module__.startswith("verl.") for k in type(trainer).__mro__):
        count = int(trainer.trigger_parameter_sync_step)
        return int(trainer.local_trigger_step) - 1, count
    return 0, 1


def v0_lags(trainer, batch) -> dict:
    """The lags of a V0-shaped async trainer's batch, by the nearest of verl's classes with a rule; a trainer
    without one has no known versions: an error (the figures then stay unsplit, with a warning)."""
    for klass in type(trainer).__mro__:
        rule = V0_RULES.get(klass.__name__)
        if rule is not None and klass.__module__.startswith("verl."):
            return rule(trainer, batch)
    raise LookupError(f"no rule maps {type(trainer).__name__}'s weight versions to lags")


def lags_or_none(compute, *args) -> Optional[list]:
    """``flat(compute(*args))``, or None with a WARNING: the figures are then logged unsplit and never fed,
    as before the split; verl's update is untouched."""
    try:
        return flat(compute(*args))
    except Exception as exc:  # noqa: BLE001 - a metric's input must never fail verl's update
        logger.warning("verl_lrstab: could not read the batch's policy versions (%r); its mismatch figures are "
                       "logged unsplit and none is fed to the detector this step", exc)
        return None
