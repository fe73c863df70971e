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
from verl_lrstab.glue import signals
from verl_lrstab.glue.bypass import train_mini_batch_bypass
from verl_lrstab.glue.steps import (PRE_RS_STATS_KEY, STEP_POSITION_KEY, GlueError, StepState, count_held_update,
                                    feed, feed_mismatch, state_of, step_position, with_metrics)
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
    """One actor update of a ``length_surge`` run."""
    from verl.utils import tensordict_utils as tu

    data = argument((self,) + args, kwargs, 1, "data")
    scheduler = self.engine.lr_scheduler
    index, count, is_async, cap = step_position(tu.pop(data, key=STEP_POSITION_KEY, default=None))
    pre_rs = tu.pop(data, key=PRE_RS_STATS_KEY, default=None)
    state = state_of(scheduler)
    _warmup_in_trainer_steps(scheduler, state, count)
    if scheduler.config.trigger != "length" and not signals.has_rollout_log_probs(data):
        raise GlueError(f"actor_rollout_ref.actor.optim.length_surge.trigger={scheduler.config.trigger!r} needs the "
                        "rollout engine's log-probs, and the actor batch has no 'rollout_log_probs': set "
                        "actor_rollout_ref.rollout.calculate_log_probs=true (or trigger: length)")
    group = self.engine.get_data_parallel_group()
    if index == 0:
        state.acc.reset()
    last = index == count - 1
    count_held_update(state, last, count, index)
    run_original = lambda: original_fn(self, *args, **kwargs)  # noqa: E731
    length_stats = signals.global_length_stats(data, group, cap=cap or None)
    state.acc.add_score(signals.global_score_stats(data, group))
    mismatch_stats = signals.global_mismatch_stats(data, group, pre_rs)
    if is_bypass(mismatch_stats):  # old_log_probs := rollout_log_probs: figures from the loss's own forward
        output = train_mini_batch_bypass(self, scheduler, state, data, run_original, length_stats, last, is_async)
        return signals.feed_update_figures(scheduler, output, last)
    state.acc.add(length_stats, mismatch_stats)
    if not last:  # not the step's last update: the LR stays, nothing is logged
        with scheduler.holding():
            return signals.feed_update_figures(scheduler, run_original(), last)
    length, figures = state.acc.result()
    feed(scheduler, state, length)
    feed_mismatch(scheduler, figures, is_async)
    state.acc.reset()
    output = with_metrics(run_original(), {**scheduler.metrics(), **(figures or {})})
    # v4: the update's grad norm, KL loss and clip fraction, for the detector's next decision
    return signals.feed_update_figures(scheduler, output, last)


def make_infer_batch(original_fn):
    return dispatch(original_fn, _engine_has_our_scheduler, _infer_batch)


def infer_checks(module, infer):
    yield "TrainingWorker.infer_batch runs self.engine.infer_batch", *source_contains(infer, "self.engine.infer_batch")


def _infer_batch(original_fn, self, *args, **kwargs):
    """A forward pass of a ``length_surge`` run's actor: verl's, unchanged; on the old-log-prob pass
    (``calculate_entropy`` and no loss: what verl's driver asks for before the update) the entropy it
    returns is kept for the detector (v4's co-signal, verl's ``actor/entropy``). No extra pass."""
    from verl.utils import tensordict_utils as tu

    data = argument((self,) + args, kwargs, 1, "data")
    old_log_prob_pass = bool(tu.get(data, key="calculate_entropy", default=False)) and not \
        tu.get(data, key="compute_loss", default=True)
    output = original_fn(self, *args, **kwargs)
    if old_log_prob_pass:
        signals.feed_old_log_prob_entropy(self.engine.lr_scheduler, output, data)
    return output


def _warmup_in_trainer_steps(scheduler: FedSchedule, state: StepState, count: int) -> None:
    """verl resolves the warmup in actor updates (V1 multiplies the total by the updates per step)."""
    if count > 1 and state.updates_per_step != count:
        state.updates_per_step = count
        configured = state.configured_warmup if state.configured_warmup is not None else scheduler.schedule.warmup_steps
        scheduler.schedule.warmup_steps = -(-configured // count)


