"""One trainer step of a ``length_surge`` run on the worker: its state, and its updates from measure to feed.

A trainer step runs one actor update (``separate_async``: several). Per update, the worker
(:mod:`.worker`) tags it (:func:`step_position`), :func:`begin_update` opens it, one collective
measures the batch (:func:`.signals.measure_batch`), :func:`run_update` (or bypass mode's
:func:`.bypass.train_mini_batch_bypass`) sums the figures into the step's state and, on the
step's last update, hands them to the scheduler (:meth:`~verl_lrstab.schedule.FedSchedule.observe_update`)
before verl's update, which steps it; :func:`finish_update` then measures what verl's update
logged (one more collective) and, on the last update, feeds it and logs the step's figures.
The state is kept per scheduler on our own object (:class:`StepState`), never on verl's.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from verl_lrstab import mismatch
from verl_lrstab.glue import signals
from verl_lrstab.schedule import FedSchedule, UpdateFigures

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


class StepPosition(NamedTuple):
    """The driver's tag of an actor update: its index in the trainer step, the updates per step, whether the
    trainer mode is asynchronous, and the rollout's response cap (0: unknown, no clip ratio)."""

    index: int
    count: int
    is_async: bool
    cap: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def step_position(value) -> StepPosition:
    """The :class:`StepPosition` of the driver's tag; a missing tag is an error, never a guess."""
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
    return StepPosition(index, count, bool(is_async), cap)


class StepState:
    """What the glue keeps per scheduler between the updates of a run: the sums of the current trainer
    step's figures, the entropy of its old-log-prob pass, and the counters of the failure rules."""

    def __init__(self):
        self.unmeasured_steps = 0
        self.unfed_updates = 0  # consecutive actor updates held (not the last of their trainer step)
        self.unstepped_steps = 0  # consecutive feeds verl's engine did not consume
        self.entropy: Optional[float] = None  # this step's old-log-prob pass (signals.old_log_prob_entropy)
        self.reset_batch()
        self._reset_update_sums()

    # -- the batch's figures (measured before each update) --------------------------------------
    def reset_batch(self) -> None:
        self.length = [0.0, 0.0]  # sum, count
        self.length_unmeasured = False
        self.at_cap = [0.0, 0.0]  # responses at the cap, responses (empty: no cap known)
        self.clip_valid = True
        self.score = [0.0, 0.0]  # sum, count
        self.score_valid = True
        self.mismatch = None  # stats tensor (sums, then max) or None
        self.mismatch_valid = True

    def add_batch(self, stats: signals.BatchStats, with_mismatch: bool = True) -> None:
        """Add one update's :class:`~.signals.BatchStats` (bypass mode's mismatch comes from elsewhere)."""
        if stats.length is None:
            self.length_unmeasured = True
        else:
            self.length = [self.length[0] + stats.length[0], self.length[1] + stats.length[1]]
            if len(stats.length) > 2:
                self.at_cap = [self.at_cap[0] + stats.length[2], self.at_cap[1] + stats.length[1]]
            else:
                self.clip_valid = False
        if stats.score is None:
            self.score_valid = False
        else:
            self.score = [self.score[0] + stats.score[0], self.score[1] + stats.score[1]]
        if with_mismatch:
            self.add_mismatch(stats.mismatch)

    def add_mismatch(self, stats: Optional[torch.Tensor]) -> None:
        if stats is None:
            self.mismatch_valid = False
        elif self.mismatch_valid:
            if self.mismatch is None:
                self.mismatch = stats.clone()
            else:
                self.mismatch[:-1] += stats[:-1]
                self.mismatch[-1] = max(self.mismatch[-1], stats[-1])

    def mismatch_figures(self) -> Optional[dict]:
        """The step's ``mismatch/*`` figures so far, or None."""
        return mismatch.finalize(self.mismatch if self.mismatch_valid else None)

    def figures(self, mismatch_metric: str, is_async: bool, with_mismatch: bool = True) -> tuple:
        """``(UpdateFigures, mismatch/* figures or None)``: the step's batch figures for the scheduler (the mean
        length, NaN: unmeasured; score and clip ratio, None: unavailable; the mismatch figure ``mismatch_metric``)
        and the step's ``mismatch/*`` figures (none with ``with_mismatch`` false: bypass mode's come later).

        In the async modes the rollout's log-probs come from older weights: the figures mix engine
        mismatch with policy staleness, so they are logged but never reach the detector (docs/integration.md).
        """
        figures = self.mismatch_figures() if with_mismatch else None
        total, count = self.length
        at_cap, responses = self.at_cap
        score, scored = self.score
        measured = count > 0 and not self.length_unmeasured
        return UpdateFigures(
            response_length=total / count if measured else math.nan,
            mismatch_kl=None if (figures is None or is_async) else figures.get(f"mismatch/{mismatch_metric}"),
            score=score / scored if self.score_valid and scored > 0 else None,
            clip_ratio=at_cap / responses if self.clip_valid and not self.length_unmeasured and responses > 0 else None,
        ), figures

    def feed(self, scheduler: FedSchedule, position: StepPosition, with_mismatch: bool = True):
        """Hand the step's batch figures to the scheduler (verl's engine then steps it); count the failures.
        Returns ``(the figures fed, the step's mismatch/* figures to log)`` (bypass mode: no mismatch yet)."""
        figures, logged = self.figures(scheduler.config.mismatch_metric, position.is_async, with_mismatch)
        if scheduler.figures_waiting:  # the previous step's figures were never consumed
            self.unstepped_steps += 1
            if self.unstepped_steps >= MAX_UNSTEPPED_STEPS:
                raise GlueError(f"verl_lrstab: verl's engine did not step the length_surge scheduler on "
                                f"{self.unstepped_steps} consecutive trainer steps (the figures handed to it were "
                                "never consumed), so the LR would stay constant. verl-lrstab supports verl 0.9.x; "
                                "`python patches/check_verl.py` lists what no longer matches.")
        else:
            self.unstepped_steps = 0
        if self.length_unmeasured:
            self.unmeasured_steps += 1
            if self.unmeasured_steps >= MAX_UNMEASURED_STEPS:
                raise GlueError(f"verl_lrstab: the response length could not be measured on {self.unmeasured_steps} "
                                "consecutive trainer steps (the actor batch lacks the keys it comes from, see the "
                                "warnings above), so length_surge would train at a constant LR. verl-lrstab supports "
                                "verl 0.9.x; `python patches/check_verl.py` lists what no longer matches.")
        else:
            self.unmeasured_steps = 0
        scheduler.set_updates_per_step(position.count)
        scheduler.observe_update(figures)
        return figures, logged or {}

    # -- what verl's update logged (measured after each update) ---------------------------------
    def _reset_update_sums(self) -> None:
        self.update_sums = torch.zeros(2 * len(signals.UPDATE_FIGURES), dtype=torch.float64)
        self.update_valid = True

    def close_update(self, stats: Optional[torch.Tensor], last: bool) -> dict:
        """Add one update's :data:`~.signals.UPDATE_FIGURES` sums (None: some rank could not read them); on the
        step's last update, the step's means (the old-log-prob pass's entropy winning over the update's own),
        used once: the sums and the entropy start afresh. Earlier updates: ``{}``."""
        if stats is None:
            self.update_valid = False
        else:
            self.update_sums += stats
        if not last:
            return {}
        means = {}
        if self.update_valid:
            for i, name in enumerate(signals.UPDATE_FIGURES):
                total, count = self.update_sums[2 * i].item(), self.update_sums[2 * i + 1].item()
                if count > 0:
                    means[name] = total / count
        if self.entropy is not None:  # this step's old-log-prob pass: verl's actor/entropy
            means["entropy"] = self.entropy
        self.entropy = None
        self._reset_update_sums()
        return means


_states: "weakref.WeakKeyDictionary[FedSchedule, StepState]" = weakref.WeakKeyDictionary()


def state_of(scheduler: FedSchedule) -> StepState:
    """The glue's state for ``scheduler`` (created on first use)."""
    state = _states.get(scheduler)
    if state is None:
        state = _states[scheduler] = StepState()
    return state


def begin_update(scheduler: FedSchedule, position: StepPosition) -> StepState:
    """Open an actor update: the step's state, its sums restarted on the step's first update.

    Counts the updates that do not feed the scheduler (not their trainer step's last); fails the
    run when one trainer step's worth (``count``, the updates per step the driver tagged) passed
    unfed: the position never reaches the last update (a trainer whose ``step()`` does not
    advance verl's ``local_trigger_step``, or a ``parameter_sync_step`` its ``step()`` does not
    loop over), and the LR would stay constant with nothing logged.
    """
    state = state_of(scheduler)
    if position.index == 0:
        state.reset_batch()
    if position.last:
        state.unfed_updates = 0
        return state
    state.unfed_updates += 1
    if state.unfed_updates >= position.count:
        raise GlueError(f"verl_lrstab: the length_surge scheduler was not fed for {state.unfed_updates} consecutive "
                        f"actor updates: each batch is tagged update {position.index} of {position.count} in its "
                        "trainer step, so the step's last update (which feeds the scheduler) never comes and the LR "
                        "would stay constant. The trainer's step() does not advance verl's local_trigger_step over "
                        "its parameter_sync_step updates (an overridden step(), or a trainer mode that does not loop "
                        "over trainer.v1.<mode>.parameter_sync_step); set parameter_sync_step: 1 or run "
                        "verl's own trainer modes.")
    return state


def run_update(scheduler: FedSchedule, state: StepState, batch: signals.BatchStats, position: StepPosition,
               run: Callable):
    """verl's update with the batch's figures summed in; on the step's last update they are fed first.
    Returns ``(verl's output, the step's mismatch/* figures to log)``."""
    state.add_batch(batch)
    if not position.last:  # not the step's last update: the LR stays, nothing is logged
        with scheduler.holding():
            return run(), {}
    _, logged = state.feed(scheduler, position)  # (the next step's first update restarts the sums)
    return run(), logged


def finish_update(scheduler: FedSchedule, state: StepState, output, last: bool, logged: dict):
    """After verl's update (every rank, each update: one collective): sum what it logged; on the step's last
    update feed its means to the scheduler and log the step's ``lrstab/*`` figures and ``logged``."""
    means = state.close_update(signals.measure_update_output(output), last)
    if not last:
        return output
    scheduler.observe_update(UpdateFigures(cosignals=means))
    if output is None:  # ranks that do not report
        return output
    from verl.utils import tensordict_utils as tu

    metrics = dict(tu.get(output, "metrics"))
    for key, value in {**scheduler.metrics(), **logged}.items():
        metrics[key] = [value]
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()

