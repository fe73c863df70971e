"""``LengthSurgeLR``: the torch ``LRScheduler`` verl's FSDP engine steps once per actor update."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures, cosignal_figures
from verl_lrstab.feeding import FedSchedule
from verl_lrstab.scheduler_state_checks import check_lr_scheduler_state

logger = logging.getLogger("verl_lrstab")


class LengthSurgeLR(FedSchedule, LRScheduler):
    """Decay the LR when the mean response length surges (arXiv 2602.01826).

    Shaped like ``ReduceLROnPlateau``: call ``step(response_length, ...)`` once per actor update,
    after ``optimizer.step()``, with the figures the detector reads (:meth:`step`). ``lr = lr0 * warmup * max(min_lr_ratio, gamma ** n)``.

    Args:
        optimizer (Optimizer): wrapped optimizer.
        config (LengthSurgeConfig | Mapping | None): options (see ``LengthSurgeConfig``);
            None gives the paper's defaults.
        warmup_steps (int): linear warmup from 0, as verl's constant schedule. Default 0.
        last_epoch (int): the index of the last completed update; -1 (default) to start.

    The verl glue hands the figures through :meth:`observe_update` before verl's engine calls
    ``step()`` without arguments; explicit arguments win.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        >>> sched = LengthSurgeLR(opt, {"origin": "surge"})
        >>> for batch in batches:
        ...     train(batch); opt.step()
        ...     sched.step(batch_mean_response_length)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ):
        self.schedule = LengthSurgeSchedule(config, warmup_steps=warmup_steps)
        # The LR the run was configured with, before a checkpoint may restore another one.
        self._configured_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, last_epoch)

    def step(self, response_length: Optional[float] = None, mismatch_kl: Optional[float] = None, *,
             score: Optional[float] = None, clip_ratio: Optional[float] = None, entropy: Optional[float] = None,
             grad_norm: Optional[float] = None, kl_loss: Optional[float] = None,
             pg_clipfrac: Optional[float] = None) -> None:
        """Advance one actor update, fed every figure the detector reads (None or NaN: not logged).

        The figures the verl glue feeds, so a training loop that passes them here gets the decisions a
        verl run gets from the same figures.

        Args:
            response_length (float | None): the update's batch mean response length (verl's
                ``response_length/mean``). None or NaN is skipped with a warning.
            mismatch_kl (float | None): the batch's mismatch KL (``mismatch/k3``, or the figure
                ``mismatch_metric`` names): the mismatch trigger's, and a witness of ``detector: cusum``.
            score (float | None): the batch's mean score (verl's ``critic/score/mean``).
            clip_ratio (float | None): the share of the batch's responses at the response cap.
            entropy, grad_norm, kl_loss, pg_clipfrac (float | None): the update's own figures (verl's
                ``actor/entropy``, ``actor/grad_norm``, ``actor/kl_loss``, ``actor/pg_clipfrac``), known
                once it ran: read from the next update's decision on, as the glue feeds them.
        """
        if self._held:
            return
        if not self._is_initial:
            self.schedule.observe(self.last_epoch + 1, self._step_figures(UpdateFigures(
                response_length=response_length, mismatch_kl=mismatch_kl, score=score, clip_ratio=clip_ratio,
                cosignals=cosignal_figures(entropy=entropy, grad_norm=grad_norm, kl_loss=kl_loss,
                                           pg_clipfrac=pg_clipfrac))))
        super().step()

    def get_lr(self) -> list[float | torch.Tensor]:  # torch's type: a base LR may be a tensor
        scale = self.schedule.scale(self.last_epoch)
        return [base_lr * scale for base_lr in self.base_lrs]

    def lr_scale(self) -> float:
        """LR / initial LR in force for the next update (what ``get_last_lr`` reflects)."""
        return self.schedule.scale(self.last_epoch)

    def metrics(self) -> dict:
        """The ``lrstab/*`` figures of the last step (see docs/metrics.md for each key)."""
        return self.schedule.metrics(self.last_epoch)

    def state_dict(self) -> dict:
        """Plain Python types only, so ``torch.load(weights_only=True)`` can read it."""
        return {
            "base_lrs": [float(lr) for lr in self.base_lrs],
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_last_lr": [float(lr) for lr in self._last_lr],
            "warmup_steps": self.schedule.warmup_steps,
            "updates_per_step": self.updates_per_step,
            "schedule": self.schedule.state_dict(),
            "options": self.config.to_dict(),
        }

    def _checkpoint_base_lrs(self, saved) -> list[float | torch.Tensor]:
        """The checkpoint's initial LRs, which win over a changed ``optim.lr`` (a WARNING gives both)."""
        base_lrs: list[float | torch.Tensor] = [float(lr) for lr in saved]
        if any(abs(a - b) > 1e-12 * max(abs(a), abs(b), 1.0) for a, b in zip(base_lrs, self._configured_lrs)):
            logger.warning("verl_lrstab: resuming with the checkpoint's initial LR %s; the configured "
                           "optim.lr %s is ignored (same as verl's stock schedulers)", base_lrs, self._configured_lrs)
        return base_lrs

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the exact trajectory, including a surge seen before the checkpoint.

        Like torch's schedulers (and upstream verl), the checkpoint's ``base_lrs`` win over a
        changed ``optim.lr``, for our checkpoints and for verl's constant/cosine ones alike; a
        warning gives both values.
        """
        check_lr_scheduler_state(state_dict, param_groups=len(self.optimizer.param_groups))
        if "schedule" not in state_dict:  # saved by verl's constant/cosine (a LambdaLR): restart the detector
            self._restore_schedule(None, state_dict.get("last_epoch"))
            if state_dict.get("base_lrs"):  # the same LR rule as for our own checkpoints, below
                self.base_lrs = self._checkpoint_base_lrs(state_dict["base_lrs"])
            self.last_epoch = int(state_dict.get("last_epoch", self.last_epoch))
            self._step_count = int(state_dict.get("_step_count", self._step_count))
            self._last_lr = [float(lr) for lr in self.get_lr()]
            for group, lr in zip(self.optimizer.param_groups, self._last_lr):
                group["lr"] = lr
            return
        # the warmup in trainer steps before any LR is put in below (a dismissed decay, the guard's rule)
        self._count_updates_per_step(int(state_dict.get("updates_per_step", 1)))
        self.base_lrs = self._checkpoint_base_lrs(state_dict["base_lrs"])
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        self._last_lr = list(state_dict["_last_lr"])
        self._restore_schedule({"schedule": state_dict["schedule"], "options": state_dict["options"]},
                               self.last_epoch)
        if self.config.decay_from_step is not None:
            # the guard's rollback: the decay is in force from the first update after the resume, not
            # from the next step() (verl loads the optimizer, with the checkpoint's LR, before this)
            self._apply_lr()

    def _apply_lr(self) -> None:
        if self.last_epoch < 0:  # before the first step (the constructor's own): torch sets the LR there
            return
        self._last_lr = [float(lr) for lr in self.get_lr()]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
