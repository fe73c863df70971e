"""An actor update in verl's bypass mode (``old_log_probs := rollout_log_probs``, 0 by construction).

``mismatch/*`` come instead from the log-probs verl's loss gets for the update's first
mini-batch (before any optimizer step) against ``rollout_log_probs``: ``worker.loss_fn``,
which the engine reads per mini-batch, observes them for this call only; the sums are
all-reduced at the first optimizer step (a torch step pre-hook), before the scheduler steps
(:mod:`verl_lrstab.bypass` does the measuring; this module is its verl side).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from verl_lrstab import mismatch
from verl_lrstab.bypass import BYPASS_KEY, capture_first_mini_batch

logger = logging.getLogger("verl_lrstab")


def train_mini_batch_bypass(worker, scheduler, state, data, run, batch, position):
    """One update of a bypass-mode ``length_surge`` run; as :func:`verl_lrstab.glue.steps.run_update`
    (``state``: its :class:`~verl_lrstab.glue.steps.StepState`), the mismatch figure fed at the optimizer step."""
    mismatch.warn_once("bypass")
    n_sequences = first_mini_batch_size(worker, data)
    state.add_batch(batch, with_mismatch=False)  # old vs rollout log-probs: 0 by construction
    metric, is_async, last = scheduler.config.mismatch_metric, position.is_async, position.last
    fed = state.feed(scheduler, position, with_mismatch=False)[0] if last else None
    figures = {}
    done = False

    def on_reduced(measured):  # once, on every rank alike; before the scheduler steps if at the optimizer step
        state.add_mismatch(capture.global_stats if measured is not None else None)
        if last:
            figures.update(state.mismatch_figures() or {})
            if not done:  # after the update the step is taken: the figure is logged, not fed to the next step
                kl = None if (not figures or is_async) else figures.get(f"mismatch/{metric}")
                scheduler.observe_update(dataclasses.replace(fed, mismatch_kl=kl))

    engine = worker.engine
    hold = contextlib.nullcontext() if last else scheduler.holding()
    with hold, capture_first_mini_batch(
            worker, n_sequences, micro_batch_view,
            optimizer=getattr(engine, "optimizer", None), group=engine.get_data_parallel_group(),
            on_reduced=on_reduced) as capture:
        output = run()
        done = True
    if not last:  # not the step's last update: the LR stays, nothing is logged
        return output, {}
    state.reset_batch()
    if not figures:
        mismatch.warn_once("bypass_failed")
    else:
        figures[BYPASS_KEY] = 1.0
    return output, figures


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
