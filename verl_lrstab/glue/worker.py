"""The actor worker's update: feed the scheduler once per trainer step, report its figures.

verl's engine steps the LR scheduler with no argument and the batch never reaches it, so the
glue wraps ``TrainingWorker.train_mini_batch`` (one call = one actor update): for a run whose
engine holds one of our schedulers, it measures the global length, score and mismatch
figures, hands them to the scheduler before verl's update, and adds the ``lrstab/*`` and
``mismatch/*`` figures to the metrics verl returns. Any other run goes straight to verl.

verl's V1 ``separate_async`` trainer runs ``parameter_sync_step`` updates per trainer step;
the driver tags each batch with its position (:mod:`.driver`). The figures of a trainer
step's updates are summed, the LR is held within the step and the scheduler is fed once, on
the step's last update: windows, surge step and decay period are in trainer steps, the step
verl logs. A batch without the tag is an error (the driver-side glue is missing).
"""

from __future__ import annotations

import logging

from verl_lrstab.bypass import is_bypass
from verl_lrstab.config import OPTIONS_KEY
from verl_lrstab.glue import signals
from verl_lrstab.glue.bypass import train_mini_batch_bypass
from verl_lrstab.glue.steps import (PRE_RS_STATS_KEY, STEP_POSITION_KEY, GlueError, begin_update, finish_update,
                                    run_update, state_of, step_position)
from verl_lrstab.glue.wraps import argument, dispatch, source_contains
from verl_lrstab.schedule import FedSchedule

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
    """One actor update of a ``length_surge`` run: open it, measure the batch (one collective), run verl's
    update with the figures fed, then feed and log what the update logged (one collective); :mod:`.steps`."""
    from verl.utils import tensordict_utils as tu

    data = argument((self,) + args, kwargs, 1, "data")
    scheduler = self.engine.lr_scheduler
    position = step_position(tu.pop(data, key=STEP_POSITION_KEY, default=None))
    pre_rs = tu.pop(data, key=PRE_RS_STATS_KEY, default=None)
    if scheduler.config.trigger != "length" and "rollout_log_probs" not in data.keys():
        raise GlueError(f"{OPTIONS_KEY}.trigger={scheduler.config.trigger!r} needs the rollout engine's log-probs, "
                        "and the actor batch has no 'rollout_log_probs': set "
                        "actor_rollout_ref.rollout.calculate_log_probs=true (or trigger: length)")
    state = begin_update(scheduler, position)
    batch = signals.measure_batch(data, self.engine.get_data_parallel_group(), position.cap or None, pre_rs)
    run = lambda: original_fn(self, *args, **kwargs)  # noqa: E731
    if is_bypass(batch.mismatch):  # old_log_probs := rollout_log_probs: figures from the loss's own forward
        output, logged = train_mini_batch_bypass(self, scheduler, state, data, run, batch, position)
    else:
        output, logged = run_update(scheduler, state, batch, position, run)
    return finish_update(scheduler, state, output, position.last, logged)


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
        state_of(self.engine.lr_scheduler).entropy = signals.old_log_prob_entropy(output, data)
    return output

