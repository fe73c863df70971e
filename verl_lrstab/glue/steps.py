"""One trainer step's figures: their sums over the step's actor updates, and the hand-off to the scheduler.

Shared by the worker's update (:mod:`.worker`) and its bypass-mode branch (:mod:`.bypass`); the
state is kept per scheduler on our own object (:class:`StepState`), never on verl's.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

from verl_lrstab import mismatch
from verl_lrstab.schedule import FedSchedule

#: Non-tensor keys the driver-side glue adds to the actor batch (popped here).
STEP_POSITION_KEY = "lrstab_step_position"  # [index of the update in the step, updates per step, async, response cap]
PRE_RS_STATS_KEY = "lrstab_pre_rs_mismatch_stats"  # mismatch stats over the tokens before rejection sampling

#: A length that cannot be measured (no key it comes from) on this many consecutive trainer
#: steps fails the run: the detector would never see a step and the LR would stay constant.
MAX_UNMEASURED_STEPS = 3
#: Figures handed to the scheduler that verl's engine never consumed (it did not step the
#: scheduler) on this many consecutive trainer steps fail the run: the LR would stay constant.
MAX_UNSTEPPED_STEPS = 3


class GlueError(RuntimeError):
    """A ``length_surge`` run cannot go on as configured (the message says what to set)."""


class StepState:
    """What the glue keeps per scheduler between the updates of a run (on our object, not verl's)."""

    def __init__(self, configured_warmup: Optional[int] = None):
        self.configured_warmup = configured_warmup  # in actor updates, as verl resolved it
        self.updates_per_step = 1
        self.unmeasured_steps = 0
        self.unfed_updates = 0  # consecutive actor updates held (not the last of their trainer step)
        self.unstepped_steps = 0  # consecutive feeds verl's engine did not consume
        self.acc = StepAccumulator()
        self.entropy: Optional[float] = None  # this step's old-log-prob pass (signals.feed_old_log_prob_entropy)


_states: "weakref.WeakKeyDictionary[FedSchedule, StepState]" = weakref.WeakKeyDictionary()


def state_of(scheduler: FedSchedule, configured_warmup: Optional[int] = None) -> StepState:
    """The glue's state for ``scheduler`` (created on first use)."""
    state = _states.get(scheduler)
    if state is None:
        state = _states[scheduler] = StepState(configured_warmup)
    return state


def count_held_update(state: StepState, last: bool, count: int, index: int) -> None:
    """Count an actor update that does not feed the scheduler (not its trainer step's last); fail the run
    when one trainer step's worth (``count``, the updates per step the driver tagged) passed unfed.

    A trainer step runs ``count`` updates, the first ``count - 1`` held: more than that in a row means
    the position never reaches the last update (a trainer whose ``step()`` does not advance verl's
    ``local_trigger_step``, or a ``parameter_sync_step`` its ``step()`` does not loop over), and the LR
    would stay constant with nothing logged.
    """
    if last:
        state.unfed_updates = 0
        return
    state.unfed_updates += 1
    if state.unfed_updates >= count:
        raise GlueError(f"verl_lrstab: the length_surge scheduler was not fed for {state.unfed_updates} consecutive "
                        f"actor updates: each batch is tagged update {index} of {count} in its trainer step, so "
                        "the step's last update (which feeds the scheduler) never comes and the LR would stay "
                        "constant. The trainer's step() does not advance verl's local_trigger_step over its "
                        "parameter_sync_step updates (an overridden step(), or a trainer mode that does not loop "
                        "over trainer.v1.<mode>.parameter_sync_step); set parameter_sync_step: 1 or run "
                        "verl's own trainer modes.")


def feed(scheduler: FedSchedule, state: StepState, length: float) -> None:
    """Hand one trainer step's length and score to the scheduler (verl's engine then steps it)."""
    if scheduler.pending_response_length is not None:  # the previous step's figures were never consumed
        state.unstepped_steps += 1
        if state.unstepped_steps >= MAX_UNSTEPPED_STEPS:
            raise GlueError(f"verl_lrstab: verl's engine did not step the length_surge scheduler on "
                            f"{state.unstepped_steps} consecutive trainer steps (the figures handed to it were "
                            "never consumed), so the LR would stay constant. verl-lrstab supports verl 0.9.x; "
                            "`python patches/check_verl.py` lists what no longer matches.")
    else:
        state.unstepped_steps = 0
    if state.acc.length_unmeasured:
        state.unmeasured_steps += 1
        if state.unmeasured_steps >= MAX_UNMEASURED_STEPS:
            raise GlueError(f"verl_lrstab: the response length could not be measured on {state.unmeasured_steps} "
                            "consecutive trainer steps (the actor batch lacks the keys it comes from, see the "
                            "warnings above), so length_surge would train at a constant LR. verl-lrstab supports "
                            "verl 0.9.x; `python patches/check_verl.py` lists what no longer matches.")
    else:
        state.unmeasured_steps = 0
    scheduler.pending_response_length = length
    scheduler.pending_score = state.acc.score_mean()
    scheduler.pending_clip_ratio = state.acc.clip_ratio()


def feed_mismatch(scheduler: FedSchedule, figures: Optional[dict], is_async: bool) -> None:
    """Hand the step's mismatch figure to the scheduler (the trigger and cusum's KL co-signal).

    In the async modes the rollout's log-probs come from older weights: the figures mix engine
    mismatch with policy staleness, so they are logged but never reach the detector (docs/integration.md).
    """
    key = f"mismatch/{scheduler.config.mismatch_metric}"
    scheduler.pending_mismatch_kl = None if (figures is None or is_async) else figures.get(key)


def step_position(value) -> tuple:
    """``(index, count, is_async, response_cap)`` of the driver's tag; a missing tag is an error, never
    a guess (``response_cap`` 0: unknown, no clip ratio)."""
    if value is None:
        raise GlueError("verl_lrstab: the actor batch carries no trainer-step tag (lrstab_step_position): the "
                        "driver-side glue (PPOTrainer._update_actor / RayPPOTrainer._update_actor) did not run in "
                        "the trainer's process, so the scheduler cannot tell trainer steps apart. Check the "
                        "ERROR logged there; verl-lrstab supports verl 0.9.x (`python patches/check_verl.py`).")
    values = [int(v) for v in value]
    if len(values) not in (3, 4):
        raise ValueError(f"verl_lrstab: bad trainer-step position {list(value)!r}")
    index, count, is_async, cap = (*values, 0) if len(values) == 3 else values
    if not 0 <= index < count or cap < 0:
        raise ValueError(f"verl_lrstab: bad trainer-step position {list(value)!r}")
    return index, count, bool(is_async), cap


class StepAccumulator:
    """Sums the global length, score and mismatch figures of the actor updates of one trainer step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.length = [0.0, 0.0]  # sum, count
        self.length_unmeasured = False
        self.at_cap = [0.0, 0.0]  # responses at the cap, responses (empty: no cap known)
        self.clip_valid = True
        self.score = [0.0, 0.0]  # sum, count
        self.score_valid = True
        self.mismatch = None  # stats tensor (sums, then max) or None
        self.mismatch_valid = True

    def add(self, length_stats, mismatch_stats) -> None:
        self.add_length(length_stats)
        self.add_mismatch(mismatch_stats)

    def add_length(self, length_stats: Optional[list]) -> None:
        """``[sum, count]`` or ``[sum, count, at_cap]`` (:func:`~verl_lrstab.glue.signals.global_length_stats`)."""
        if length_stats is None:
            self.length_unmeasured = True
            return
        self.length = [self.length[0] + length_stats[0], self.length[1] + length_stats[1]]
        if len(length_stats) > 2:
            self.at_cap = [self.at_cap[0] + length_stats[2], self.at_cap[1] + length_stats[1]]
        else:
            self.clip_valid = False

    def clip_ratio(self) -> Optional[float]:
        """The step's share of responses at the rollout's cap, or None (no cap known, or unmeasured)."""
        at_cap, count = self.at_cap
        return at_cap / count if self.clip_valid and not self.length_unmeasured and count > 0 else None

    def add_score(self, score_stats: Optional[list]) -> None:
        if score_stats is None:
            self.score_valid = False
        else:
            self.score = [self.score[0] + score_stats[0], self.score[1] + score_stats[1]]

    def score_mean(self) -> Optional[float]:
        """The step's mean sequence score, or None (the detector then runs without it)."""
        total, count = self.score
        return total / count if self.score_valid and count > 0 else None

    def add_mismatch(self, mismatch_stats) -> None:
        if mismatch_stats is None:
            self.mismatch_valid = False
        elif self.mismatch_valid:
            if self.mismatch is None:
                self.mismatch = mismatch_stats.clone()
            else:
                self.mismatch[:-1] += mismatch_stats[:-1]
                self.mismatch[-1] = max(self.mismatch[-1], mismatch_stats[-1])

    def result(self):
        """``(mean length or NaN, mismatch/* figures or None)`` of the step so far."""
        total, count = self.length
        length = total / count if count > 0 and not self.length_unmeasured else math.nan
        return length, mismatch.finalize(self.mismatch if self.mismatch_valid else None)


def with_metrics(output, extra: dict):
    """Return verl's ``train_mini_batch`` output with ``extra`` added to its metrics."""
    if output is None:  # ranks that do not report
        return output
    from verl.utils import tensordict_utils as tu

    metrics = dict(tu.get(output, "metrics"))
    for key, value in extra.items():
        metrics[key] = [value]
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
