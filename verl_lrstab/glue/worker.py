"""The actor worker's update: feed the scheduler once per trainer step, report its figures.

verl's engine steps the LR scheduler with no argument and the batch never reaches it, so the
glue wraps ``TrainingWorker.train_mini_batch`` (one call = one actor update): for a run whose
engine holds one of our schedulers, it reads the driver's tags, then calls in order
:func:`.batch_figures.measure_batch` (the global length, score and mismatch figures),
:func:`.steps.run_update` (handed to the scheduler, verl's update) and
:func:`.update_metrics.finish_update` (what the update logged; the ``lrstab/*`` and ``mismatch/*``
figures added to the metrics verl returns). Any other run goes straight to verl.

verl's V1 ``separate_async`` trainer runs ``parameter_sync_step`` updates per trainer step;
the driver tags each batch with its position (:mod:`.driver`). The figures of a trainer
step's updates are summed, the LR is held within the step and the scheduler is fed once, on
the step's last update: windows, surge step and decay period are in trainer steps, the step
verl logs. A batch without the tag is an error (the driver-side glue is missing).
"""

from __future__ import annotations

import logging

from verl_lrstab.config import OPTIONS_KEY
from verl_lrstab.feeding import FedSchedule
from verl_lrstab.glue import batch_figures, update_metrics
from verl_lrstab.glue.steps import (PRE_RS_STATS_KEY, STEP_POSITION_KEY, VERSION_LAGS_KEY, GlueError, StepPosition,
                                    run_update, state_of)
from verl_lrstab.glue.wraps import argument, dispatch, source_contains

logger = logging.getLogger("verl_lrstab")


def make_train_mini_batch(original_fn):
    return dispatch(original_fn, _engine_has_our_scheduler, _train_mini_batch)


def _engine_has_our_scheduler(self, *args, **kwargs) -> bool:
    return isinstance(getattr(getattr(self, "engine", None), "lr_scheduler", None), FedSchedule)


def worker_checks(module, mini):
    worker = module.TrainingWorker
    yield "TrainingWorker.train_mini_batch steps the scheduler on its last mini-batch only", *source_contains(
        mini, "update_lr_scheduler=batch_idx == total_num_iterations - 1")
    yield "TrainingWorker.train_mini_batch returns metrics under 'metrics'", *source_contains(mini, '"metrics": metrics')
    yield "TrainingWorker.train_mini_batch runs self.engine", *source_contains(mini, "self.engine")
    yield "TrainingWorker.train_batch calls engine.lr_scheduler_step()", *source_contains(
        worker.train_batch, "self.engine.lr_scheduler_step()")


def _train_mini_batch(original_fn, self, *args, **kwargs):
    """One actor update of a ``length_surge`` run: measure the batch (one collective), run verl's update with
    the step's figures fed (bypass mode: one more collective), then finish it (one collective)."""
    from verl.utils import tensordict_utils as tu

    data = argument((self,) + args, kwargs, 1, "data")
    scheduler = self.engine.lr_scheduler
    position = step_position(tu.pop(data, key=STEP_POSITION_KEY, default=None))
    pre_rs = tu.pop(data, key=PRE_RS_STATS_KEY, default=None)
    lags = version_lags(tu.pop(data, key=VERSION_LAGS_KEY, default=None))
    if scheduler.config.trigger != "length" and "rollout_log_probs" not in data.keys():
        raise GlueError(f"{OPTIONS_KEY}.trigger={scheduler.config.trigger!r} needs the rollout engine's log-probs, "
                        "and the actor batch has no 'rollout_log_probs': set "
                        "actor_rollout_ref.rollout.calculate_log_probs=true (or trigger: length)")
    batch = batch_figures.measure_batch(data, self.engine.get_data_parallel_group(), position.cap or None, pre_rs, lags)
    output, state = run_update(self, data, scheduler, batch, position, lambda: original_fn(self, *args, **kwargs))
    return update_metrics.finish_update(scheduler, state.cosignals, output, position.last, state.logged)


def step_position(value) -> StepPosition:
    """The :class:`~.steps.StepPosition` of the driver's tag; a missing tag is an error, never a guess."""
    if value is None:
        raise GlueError("verl_lrstab: the actor batch carries no trainer-step tag (lrstab_step_position): the "
                        "driver-side glue (PPOTrainer._update_actor / RayPPOTrainer._update_actor) did not run in "
                        "the trainer's process, so the scheduler cannot tell trainer steps apart. Check the "
                        "ERROR logged there; `lrstab check-verl` lists what in this verl no longer matches.")
    values = [int(v) for v in value]
    if len(values) not in (3, 4):
        raise ValueError(f"verl_lrstab: bad trainer-step position {list(value)!r}")
    index, count, is_async, cap = (*values, 0) if len(values) == 3 else values
    if not 0 <= index < count or cap < 0:
        raise ValueError(f"verl_lrstab: bad trainer-step position {list(value)!r}")
    return StepPosition(index, count, bool(is_async), cap)


def version_lags(value):
    """The driver's ``[version, lag, ...]`` tag as a dict; None without one (a sync trainer: nothing to split)."""
    if value is None:
        return None
    values = [int(v) for v in value]
    if len(values) % 2:
        raise ValueError(f"verl_lrstab: bad version-lag tag {list(value)!r}")
    return dict(zip(values[0::2], values[1::2]))


def make_infer_batch(original_fn):
    return dispatch(original_fn, _engine_has_our_scheduler, _infer_batch)


def infer_checks(module, infer):
    yield "TrainingWorker.infer_batch runs self.engine.infer_batch", *source_contains(infer, "self.engine.infer_batch")


def _infer_batch(original_fn, self, *args, **kwargs):
    """A forward pass of a ``length_surge`` run's actor: verl's, unchanged; on the old-log-prob pass
    (``calculate_entropy`` and no loss: what verl's driver asks for before the update) the entropy it
    returns is kept for the detector (a co-signal of ``detector: cusum``, verl's ``actor/entropy``). No extra pass."""
    from verl.utils import tensordict_utils as tu

    data = argument((self,) + args, kwargs, 1, "data")
    old_log_prob_pass = bool(tu.get(data, key="calculate_entropy", default=False)) and not \
        tu.get(data, key="compute_loss", default=True)
    output = original_fn(self, *args, **kwargs)
    if old_log_prob_pass:  # every rank of the default group, each such pass: one collective
        state_of(self.engine.lr_scheduler).cosignals.entropy = update_metrics.old_log_prob_entropy(output, data)
    return output

