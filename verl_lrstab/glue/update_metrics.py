"""verl's update metrics: the co-signals read from them, summed over the trainer step and fed; the step's figures
added to them.

The co-signals of ``detector: cusum`` are what verl's update logged (grad norm, KL loss, clip
fraction, entropy: :data:`UPDATE_FIGURES`) and the entropy of its old-log-prob pass
(:func:`old_log_prob_entropy`, kept by the worker's ``infer_batch`` wrap). They exist only once the
update ran, after the scheduler stepped, so they cannot travel with the batch's collective
(:func:`.batch_figures.measure_batch`): :func:`finish_update` measures them in one collective over the
default group, sums them over the trainer step's updates (:class:`CosignalSums`, part of the step's
:class:`~.steps.StepState`) and, on the step's last update, feeds their means to the scheduler
(:meth:`~verl_lrstab.feeding.FedSchedule.observe_update`) and adds the step's ``lrstab/*`` and
``mismatch/*`` figures to the metrics verl returns.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from verl_lrstab._numbers import finite_float
from verl_lrstab.collective import all_reduce_or_none
from verl_lrstab.detectors import UpdateFigures
from verl_lrstab.feeding import FedSchedule

logger = logging.getLogger("verl_lrstab")

#: The figures of an actor update that ``detector: cusum`` reads, by co-signal, as keyed in the
#: metrics ``TrainingWorker.train_mini_batch`` returns (the driver then prefixes ``actor/``).
#: ``entropy``: the update's own (``actor/entropy_loss``, computed when ``calculate_entropy`` or an entropy
#: coefficient asks for it, as in bypass mode); a recompute run's ``actor/entropy`` comes from the old-log-prob
#: pass instead (:func:`old_log_prob_entropy_stats`), and takes precedence.
UPDATE_FIGURES = {"grad_norm": "grad_norm", "kl_loss": "kl_loss", "pg_clipfrac": "actor/pg_clipfrac",
                  "entropy": "actor/entropy_loss"}


class CosignalSums:
    """The co-signals of the current trainer step: the sums of its updates' :data:`UPDATE_FIGURES`
    and the entropy of its old-log-prob pass (None: no such pass yet)."""

    def __init__(self):
        self.entropy: Optional[float] = None
        self._restart()

    def _restart(self) -> None:
        self.sums = torch.zeros(2 * len(UPDATE_FIGURES), dtype=torch.float64)
        self.valid = True

    def close(self, stats: Optional[torch.Tensor], last: bool) -> dict:
        """Add one update's ``[sum, count]`` per :data:`UPDATE_FIGURES` entry (None: some rank could not read
        them); on the step's last update, the step's means (the old-log-prob pass's entropy winning over the
        update's own), used once: the sums and the entropy start afresh. Earlier updates: ``{}``."""
        if stats is None:
            self.valid = False
        else:
            self.sums += stats
        if not last:
            return {}
        means = {}
        if self.valid:
            for i, name in enumerate(UPDATE_FIGURES):
                total, count = self.sums[2 * i].item(), self.sums[2 * i + 1].item()
                if count > 0:
                    means[name] = total / count
        if self.entropy is not None:  # this step's old-log-prob pass: verl's actor/entropy
            means["entropy"] = self.entropy
        self.entropy = None
        self._restart()
        return means


def finish_update(scheduler: FedSchedule, sums: CosignalSums, output, last: bool, logged: dict):
    """After verl's update (every rank, each update: one collective): sum what it logged into ``sums``; on the
    step's last update feed their means to the scheduler and add the step's ``lrstab/*`` figures and
    ``logged`` (its ``mismatch/*``) to verl's metrics. Returns verl's output (extended on the last update)."""
    means = sums.close(measure_update_output(output), last)
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


def measure_update_output(output) -> Optional[torch.Tensor]:
    """``[sum, count]`` per :data:`UPDATE_FIGURES` entry of one update's metrics, over the default group, or None.

    Called on every rank after verl's update (one collective: every rank of the default group,
    each update): only the model-parallel source ranks hold verl's metrics, so they are summed
    over the default group, not the data-parallel one.
    """
    try:
        local = update_figure_stats(output)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        logger.warning("verl_lrstab: could not read the update's grad norm / KL loss / clip fraction (%s)", exc)
        local = None
    return all_reduce_or_none(local, 2 * len(UPDATE_FIGURES))


def update_figure_stats(output) -> torch.Tensor:
    """``[sum, count]`` per :data:`UPDATE_FIGURES` entry of one update's metrics (verl's values: one
    per mini-batch, already gathered over the data-parallel group; the driver logs their mean).
    A rank that returns no output (not a model-parallel source rank) or a metric not logged adds 0."""
    metrics: dict = {}
    if output is not None:
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(output, "metrics") or {}
    stats = []
    for key in UPDATE_FIGURES.values():
        values = _finite_values(metrics.get(key, []))
        stats += [sum(values), float(len(values))]
    return torch.tensor(stats, dtype=torch.float64)


def _finite_values(value) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _finite_values(item)]
    try:
        value = value.item() if hasattr(value, "item") else value
    except (TypeError, ValueError, RuntimeError):  # a tensor of several values is no figure
        return []
    v = finite_float(value)
    return [] if v is None else [v]


# -- the old-log-prob pass (TrainingWorker.infer_batch): verl's actor/entropy ------------------
def old_log_prob_entropy_stats(output, data) -> torch.Tensor:
    """``[sum, count]`` of the per-token entropy verl's old-log-prob pass returns, over the response mask.

    verl's driver logs ``actor/entropy`` from these values (token-mean over the batch, under the default
    ``loss_agg_mode``) and drops them before the update; this reads them on the worker, from the same
    output and batch, with verl's own unpadding (V1's nested batch: ``response_from_nested``, as its driver
    does; V0's padded one: ``no_padding_2_padding``, as its PPO loss does). A rank
    without outputs (not a model-parallel source rank) or without an ``entropy`` output adds 0.
    """
    if output is None:
        return torch.zeros(2, dtype=torch.float64)
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    entropy = tu.get(output, "entropy")
    if entropy is None:
        return torch.zeros(2, dtype=torch.float64)
    mask = data["response_mask"]
    if mask.is_nested:  # V1's padding-free batch: verl's own response slice, as its driver takes it
        from verl.workers.utils.padding import response_from_nested

        per_token = response_from_nested(entropy, mask).values().double()
        mask = mask.values().to(per_token.device).double()
    else:  # V0: left/right-padded prompts and responses, unpadded by verl's PPO loss's own function
        per_token = no_padding_2_padding(entropy, data).double()
        mask = mask.to(per_token.device).double()[:, : per_token.shape[1]]
    finite = torch.isfinite(per_token)
    mask = mask * finite
    return torch.stack([(torch.where(finite, per_token, 0.0) * mask).sum(), mask.sum()]).cpu()


def old_log_prob_entropy(output, data) -> Optional[float]:
    """The global mean entropy of an old-log-prob pass (verl's ``actor/entropy``), or None (on every rank alike).

    Every rank of the default group calls it, each such pass (one collective).
    """
    try:
        local = old_log_prob_entropy_stats(output, data)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        logger.warning("verl_lrstab: could not read the old-log-prob pass's entropy (%s)", exc)
        local = None
    reduced = all_reduce_or_none(local, 2)
    return None if reduced is None or reduced[1].item() <= 0 else reduced[0].item() / reduced[1].item()
