"""One trainer step of a ``length_surge`` run on the worker: its state, and an actor update from its figures to verl's.

A trainer step runs one actor update (``separate_async``: several). The worker (:mod:`.worker`)
measures the batch (:func:`.batch_figures.measure_batch`, one collective) and hands it to
:func:`run_update`: the step's state opens (:func:`begin_update`), the batch's figures are summed
into it and, on the step's last update, handed to the scheduler
(:meth:`~verl_lrstab.feeding.FedSchedule.observe_update`) before verl's update, which steps it;
within the step the LR is held. In bypass mode (:attr:`.batch_figures.BatchStats.bypass`) the mismatch
figure comes from the first mini-batch's forward instead, reduced at the first optimizer step
(one more collective, :func:`verl_lrstab.mismatch.capture_first_mini_batch`) and handed over
again then, in place of the figures handed, while the scheduler has not taken them.
:mod:`.update_metrics` finishes the update. The state is kept per scheduler on our own object
(:class:`StepState`), never on verl's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from verl_lrstab import mismatch, version_split
from verl_lrstab.detectors import UpdateFigures
from verl_lrstab.feeding import FedSchedule
from verl_lrstab.glue import batch_figures
from verl_lrstab.glue.update_metrics import CosignalSums

logger = logging.getLogger("verl_lrstab")

#: Non-tensor keys the driver-side glue adds to the actor batch (the worker pops them).
STEP_POSITION_KEY = "lrstab_step_position"  # [index of the update in the step, updates per step, async, response cap]
PRE_RS_STATS_KEY = "lrstab_pre_rs_mismatch_stats"  # mismatch stats over the tokens before rejection sampling
VERSION_LAGS_KEY = "lrstab_version_lags"  # async trainers: [version, lag, version, lag, ...] (glue/versions.py)

#: The step's mean number of the model's own tokens per response (``response_mask``), as logged (``actor/`` added
#: by verl's driver), beside verl's ``response_length/mean`` (every response token, tool output included).
MODEL_TOKENS_KEY = "lrstab/model_tokens"
#: What the detector reads, as the line that names it says (:func:`announce_length`).
LENGTH_READ = {
    True: "the mean number of the model's own tokens per response (response_mask; logged as "
          "actor/lrstab/model_tokens; verl's response_length/mean also counts tool output)",
    False: "the mean response length as verl's response_length/mean counts it (every response token)",
}

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

    # the tag's field names, kept as they travel between driver and worker; they shadow tuple.index / .count
    index: int  # type: ignore[assignment]
    count: int  # type: ignore[assignment]
    is_async: bool
    cap: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


class StepState:
    """What the glue keeps per scheduler between the updates of a run: the sums of the current trainer
    step's batch figures and its ``mismatch/*`` figures to log, its co-signals
    (:class:`~.update_metrics.CosignalSums`), and the counters of the failure rules."""

    def __init__(self):
        self.unmeasured_steps = 0
        self.unfed_updates = 0  # consecutive actor updates held (not the last of their trainer step)
        self.unstepped_steps = 0  # consecutive feeds verl's engine did not consume
        self.cosignals = CosignalSums()
        self.reset_batch()

    def reset_batch(self) -> None:
        self.length = [0.0, 0.0]  # sum, count
        self.length_unmeasured = False
        self.model_tokens = 0.0  # the model's own tokens (response_mask) of the responses counted in ``length``
        self.model_tokens_valid = True
        self.at_cap = [0.0, 0.0]  # responses at the cap, responses (empty: no cap known)
        self.clip_valid = True
        self.score = [0.0, 0.0]  # sum, count
        self.score_valid = True
        self.mismatch: Optional[torch.Tensor] = None  # stats tensor (sums, then max) or None
        self.mismatch_valid = True
        self.split: Optional[torch.Tensor] = None  # the step's mismatch sums by version lag (async trainers)
        self.split_valid = True
        self.bypass = False  # the step's batches show verl's bypass mode
        self.logged: dict = {}  # the step's mismatch/* and lrstab/model_tokens figures, logged on its last update
        self.length_logged: dict = {}  # the step's lrstab/model_tokens (kept when bypass mode's mismatch comes)

    def add_batch(self, stats: batch_figures.BatchStats) -> None:
        """Add one update's :class:`~.batch_figures.BatchStats` (bypass mode's mismatch comes from elsewhere)."""
        if stats.length is None or stats.model_tokens is None:
            self.model_tokens_valid = False
        else:
            self.model_tokens += stats.model_tokens
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
        self.bypass = stats.bypass
        if not stats.bypass:  # bypass mode: 0 by construction, the first mini-batch's come instead
            self.add_mismatch(stats.mismatch)
            self.add_split(stats.split)

    def add_split(self, split: Optional[torch.Tensor]) -> None:
        """One update's mismatch sums by version lag; an update without them leaves the step unsplit."""
        if split is None:
            self.split_valid = False
        elif self.split_valid:
            self.split = split.clone() if self.split is None else version_split.combine(self.split, split)

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

    def reads_model_tokens(self, length_tokens: str = "auto") -> bool:
        """Whether the step's length is the model's own tokens per response (``length_tokens``, the option):
        ``model``; ``auto`` when the step's responses hold tokens the model did not sample (``response_mask``
        0: tool output); ``all``: never. A step without such tokens gives the same number either way."""
        if length_tokens == "model":
            return True
        return length_tokens == "auto" and self.model_tokens_valid and self.model_tokens < self.length[0]

    def figures(self, mismatch_metric: str, is_async: bool, length_tokens: str = "auto") -> tuple:
        """``(UpdateFigures, mismatch/* figures or None)``: the step's batch figures for the scheduler (the mean
        length, NaN: unmeasured, read as ``length_tokens`` says, :meth:`reads_model_tokens`; score and clip
        ratio, None: unavailable; the mismatch figure ``mismatch_metric``) and the step's ``mismatch/*`` figures
        (none in bypass mode: they come later, :meth:`take_first_mini_batch`).

        In the async modes the rollout's log-probs may come from older weights: the figures mix engine
        mismatch with policy staleness. Where the samples' versions split them (:attr:`split`), ``mismatch/*``
        are the fresh samples' (lag 0, not partial: the engine's own mismatch) and feed the detector, the stale
        ones are logged apart (``mismatch/stale/<lag>/*``, ``mismatch/fresh_share``), and a step without a fresh
        sample feeds none (said once); without versions they are logged but never reach the detector
        (docs/integration.md, docs/mismatch.md).
        The clip ratio counts the responses whose full length (every response token, the budget verl's
        rollout caps) reached the cap, whichever length is read (docs/agentic.md).
        """
        split = self.split if self.split_valid and not self.bypass else None
        if split is not None:
            figures = version_split.split_figures(split) or None
            fed = figures is not None and version_split.fresh_stats(split) is not None
            if not fed:
                version_split.warn_no_fresh()
            kl = figures.get(f"mismatch/{mismatch_metric}") if fed and figures else None
        else:
            figures = None if self.bypass else self.mismatch_figures()
            kl = None if (figures is None or is_async) else figures.get(f"mismatch/{mismatch_metric}")
        total, count = self.length
        at_cap, responses = self.at_cap
        score, scored = self.score
        measured = count > 0 and not self.length_unmeasured
        if self.reads_model_tokens(length_tokens):
            total = self.model_tokens
            measured = measured and self.model_tokens_valid
        return UpdateFigures(
            response_length=total / count if measured else math.nan,
            mismatch_kl=kl,
            score=score / scored if self.score_valid and scored > 0 else None,
            clip_ratio=at_cap / responses if self.clip_valid and not self.length_unmeasured and responses > 0 else None,
        ), figures

    def feed_figures(self, scheduler: FedSchedule, position: StepPosition) -> UpdateFigures:
        """The step's batch figures to hand the scheduler (verl's engine then steps it), its ``mismatch/*`` kept as
        :attr:`logged`; counts the failures (the figures are handed in :func:`run_update`)."""
        length_tokens = scheduler.config.length_tokens
        fed, logged = self.figures(scheduler.config.mismatch_metric, position.is_async, length_tokens)
        self.length_logged = self.model_token_figures()
        self.logged = {**self.length_logged, **(logged or {})}
        if self.length[1] > 0 and not self.length_unmeasured:
            announce_length(scheduler, self.reads_model_tokens(length_tokens), length_tokens)
        if scheduler.figures_waiting:  # the previous step's figures were never consumed
            self.unstepped_steps += 1
            if self.unstepped_steps >= MAX_UNSTEPPED_STEPS:
                raise GlueError(f"verl_lrstab: verl's engine did not step the length_surge scheduler on "
                                f"{self.unstepped_steps} consecutive trainer steps (the figures handed to it were "
                                "never consumed), so the LR would stay constant. `lrstab check-verl` lists what in "
                                "this verl no longer matches.")
        else:
            self.unstepped_steps = 0
        if self.length_unmeasured or (self.reads_model_tokens(length_tokens) and not self.model_tokens_valid):
            self.unmeasured_steps += 1
            if self.unmeasured_steps >= MAX_UNMEASURED_STEPS:
                raise GlueError(f"verl_lrstab: the response length could not be measured on {self.unmeasured_steps} "
                                "consecutive trainer steps (the actor batch lacks the keys it comes from, see the "
                                "warnings above), so length_surge would train at a constant LR. `lrstab check-verl` "
                                "lists what in this verl no longer matches.")
        else:
            self.unmeasured_steps = 0
        return fed

    def model_token_figures(self) -> dict:
        """``{"lrstab/model_tokens": the mean of the model's own tokens per response}`` of the step (logged
        whichever length is read), or ``{}`` where it could not be counted."""
        total, count = self.length
        if count <= 0 or self.length_unmeasured or not self.model_tokens_valid:
            return {}
        return {MODEL_TOKENS_KEY: self.model_tokens / count}

    def take_first_mini_batch(self, scheduler: FedSchedule, position: StepPosition, handed: Optional[UpdateFigures],
                              stats: Optional[torch.Tensor]) -> None:
        """Bypass mode: the first mini-batch's global mismatch stats (None: not measured), at its optimizer step or,
        late, after the update. They join the step's; on its last update the step's ``mismatch/*`` are logged
        and, while the scheduler has not taken the figures ``handed`` to it (its step not taken), they are
        handed again with this mismatch figure."""
        self.add_mismatch(stats)
        if not position.last:
            return
        figures = self.mismatch_figures()
        self.logged = {**self.length_logged, **({**figures, mismatch.BYPASS_KEY: 1.0} if figures else {})}
        if handed is not None and scheduler.figures_waiting:
            metric = f"mismatch/{scheduler.config.mismatch_metric}"
            kl = None if (not figures or position.is_async) else figures.get(metric)
            scheduler.observe_update(dataclasses.replace(handed, mismatch_kl=kl))


_announced: "weakref.WeakKeyDictionary[FedSchedule, bool]" = weakref.WeakKeyDictionary()


def announce_length(scheduler: FedSchedule, reads_model: bool, length_tokens: str) -> None:
    """Say (rank 0) which length the surge detector reads: at the first step, and under ``auto`` again when the
    responses first hold tokens the model did not sample (a later step without any reads the same number)."""
    said = _announced.get(scheduler)
    if said is reads_model or said is True:
        return
    _announced[scheduler] = reads_model
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    why = ""
    if length_tokens == "auto":
        why = " (the responses hold tokens the model did not sample)" if reads_model else \
            " (so far every response token is the model's)"
    print(f"verl_lrstab: the surge detector reads {LENGTH_READ[reads_model]} [length_tokens: {length_tokens}]{why}",
          flush=True)


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
    scheduler.set_updates_per_step(position.count)  # before the first update of a resumed run uses the LR
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


def run_update(worker, data, scheduler: FedSchedule, batch: batch_figures.BatchStats, position: StepPosition,
               run: Callable) -> tuple:
    """One actor update from its batch's figures to verl's update (``run``). Returns ``(verl's output, the step's
    :class:`StepState`)``.

    The figures are summed into the step's state; on the step's last update they are handed to the
    scheduler first (earlier updates: the LR is held). In bypass mode the trainer's log-probs of the
    first mini-batch (verl's loss reads ``worker.loss_fn``) give the mismatch figure, all-reduced at
    the first optimizer step, before the scheduler steps (:meth:`StepState.take_first_mini_batch`).
    """
    state = begin_update(scheduler, position)
    first = first_mini_batch_size(worker, data) if batch.bypass else 0  # what bypass mode captures
    state.add_batch(batch)
    figures = state.feed_figures(scheduler, position) if position.last else None
    handed = None if figures is None else dataclasses.replace(figures, updates_per_step=position.count)
    capture: contextlib.AbstractContextManager = contextlib.nullcontext()
    if batch.bypass:  # old_log_probs := rollout_log_probs: the figures from the loss's own forward
        mismatch.warn_once("bypass")
        engine = worker.engine
        capture = mismatch.capture_first_mini_batch(
            worker, first, micro_batch_view, optimizer=getattr(engine, "optimizer", None),
            group=engine.get_data_parallel_group(),
            on_reduced=functools.partial(state.take_first_mini_batch, scheduler, position, handed))
    hold = contextlib.nullcontext() if position.last else scheduler.holding()
    with hold, capture:
        if handed is not None:
            scheduler.observe_update(handed)
        output = run()
    if batch.bypass and position.last and mismatch.BYPASS_KEY not in state.logged:
        mismatch.warn_once("bypass_failed")
    return output, state


def first_mini_batch_size(worker, data) -> int:
    """The rank's first mini-batch (sequences), as ``TrainingWorker.train_mini_batch`` splits the batch."""
    from verl.utils import tensordict_utils as tu

    n = int(data.shape[0])
    try:
        mini_batch_size = tu.get(data, key="mini_batch_size", default=None)
        num_mini_batch = tu.get(data, key="num_mini_batch", default=None)
        if mini_batch_size is not None:
            n = min(n, int(mini_batch_size) // worker.engine.get_data_parallel_size())
        elif num_mini_batch is not None:
            n = n // int(num_mini_batch)
    except Exception as exc:  # noqa: BLE001 - the optimizer hook still bounds the capture
        logger.warning("verl_lrstab: could not read the mini-batch size (%r); counting the whole batch", exc)
    return max(1, n)


def micro_batch_view(model_output, data):
    """The trainer's and the rollout's log-probs of one micro-batch, padded as verl's ``ppo_loss`` pads them."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("rollout_log_probs", "response_mask").to_padded_tensor()
    return log_probs, padded["rollout_log_probs"], padded["response_mask"], int(data.shape[0])
