"""``LengthSurgeParamScheduler``: the ``length_surge`` schedule on verl's Megatron engine.

verl's Megatron engine steps a megatron-core ``OptimizerParamScheduler`` over a
``ChainedOptimizer`` (not a torch optimizer), once per actor update (``step(1)``). This
subclass keeps everything the stock scheduler does (per-group ``max_lr``, weight decay
``wd * wd_mult`` per group, the checkpoint keys) and changes only the LR rule::

    lr(group) = constant_lr(group) * decay_scale(update)

``constant_lr`` is Megatron's own ``constant`` style, warmup included (``init_lr`` ->
the group's ``max_lr`` over ``lr_warmup_steps``); ``decay_scale`` is the same
:class:`verl_lrstab.detectors.LengthSurgeSchedule` the FSDP scheduler uses. Megatron's
``min_lr`` is not used, as in its ``constant`` style: the floor is
``length_surge.min_lr_ratio`` x the group's ``max_lr``.

Needs megatron-core (0.16.x and 0.19.x tested); no verl import here.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Union, cast

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from verl_lrstab.config import OPTIM_KEY, SCHEDULER_NAME, LengthSurgeConfig
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures, cosignal_figures
from verl_lrstab.feeding import FedSchedule
from verl_lrstab.scheduler_state_checks import check_megatron_scheduler_state

logger = logging.getLogger("verl_lrstab")

STATE_KEY = "length_surge"  # our state, one key of the stock state_dict


class LengthSurgeParamScheduler(FedSchedule, OptimizerParamScheduler):
    """megatron-core's ``OptimizerParamScheduler`` with the ``length_surge`` LR rule.

    Args:
        optimizer: a megatron-core optimizer (anything with ``param_groups``).
        config (LengthSurgeConfig | Mapping | None): the ``length_surge`` options; None gives
            the paper's defaults.
        init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, start_wd, end_wd,
        wd_incr_steps, wd_incr_style, use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler: as for ``OptimizerParamScheduler`` (``lr_decay_style``
            is ``"length_surge"``; ``lr_decay_steps`` is only checked, as the stock class does).

    One ``step(increment)`` with ``increment > 0`` is one actor update: it consumes the figures
    handed by :meth:`observe_update` (the verl glue's), the ones given to it winning. ``step(0)`` (the constructor's) and the
    replay inside ``load_state_dict`` only set the LR: they never feed the detector.
    """

    def __init__(
        self,
        optimizer,
        config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None,
        *,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
    ) -> None:
        self.schedule = LengthSurgeSchedule(config)
        self._replaying = False
        super().__init__(
            optimizer,
            init_lr=init_lr,
            max_lr=max_lr,
            min_lr=min_lr,
            lr_warmup_steps=lr_warmup_steps,
            lr_decay_steps=lr_decay_steps,
            lr_decay_style=SCHEDULER_NAME,
            start_wd=start_wd,
            end_wd=end_wd,
            wd_incr_steps=wd_incr_steps,
            wd_incr_style=wd_incr_style,
            use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=override_opt_param_scheduler,
        )

    def step(self, increment: int = 1, response_length: Optional[float] = None,
             mismatch_kl: Optional[float] = None, *, score: Optional[float] = None,
             clip_ratio: Optional[float] = None, entropy: Optional[float] = None, grad_norm: Optional[float] = None,
             kl_loss: Optional[float] = None, pg_clipfrac: Optional[float] = None) -> None:
        """Advance ``increment`` steps (verl: 1 per actor update) and set every group's LR and WD; the
        figures as :meth:`verl_lrstab.scheduler.LengthSurgeLR.step` takes them."""
        if self._held:
            return
        if increment > 0 and not self._replaying:
            self.schedule.observe(self.num_steps + increment, self._step_figures(UpdateFigures(
                response_length=response_length, mismatch_kl=mismatch_kl, score=score, clip_ratio=clip_ratio,
                cosignals=cosignal_figures(entropy=entropy, grad_norm=grad_norm, kl_loss=kl_loss,
                                           pg_clipfrac=pg_clipfrac))))
        super().step(increment)

    def constant_lr(self, max_lr: float) -> float:
        """Megatron's ``constant`` style at ``num_steps`` (linear warmup from ``init_lr``)."""
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        return max_lr

    def get_lr(self, param_group: dict) -> float:
        """The LR of the next update for ``param_group`` (its own ``max_lr``, as the stock class)."""
        max_lr = cast(float, param_group.get("max_lr", self.max_lr))  # megatron-core sets both
        return self.constant_lr(max_lr) * self.schedule.decay_scale(self.num_steps + 1)

    def get_last_lr(self) -> list:
        """Each group's LR in force for the next update (as torch's ``LRScheduler.get_last_lr``)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def lr_scale(self) -> float:
        """LR / ``max_lr`` in force for the next update."""
        warmup = self.constant_lr(self.max_lr) / self.max_lr if self.max_lr > 0 else 1.0
        return warmup * self.schedule.decay_scale(self.num_steps + 1)

    def metrics(self) -> dict:
        """The ``lrstab/*`` figures of the last step (the same keys as on FSDP)."""
        out = self.schedule.metrics(self.num_steps)
        out["lrstab/lr_scale"] = self.lr_scale()
        return out

    def state_dict(self) -> dict:
        """The stock keys plus ours under ``"length_surge"`` (plain Python types only)."""
        state = super().state_dict()
        state[STATE_KEY] = {"schedule": self.schedule.state_dict(), "options": self.config.to_dict()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the exact trajectory: our schedule first, then the stock keys and LR replay."""
        check_megatron_scheduler_state(state_dict, STATE_KEY)
        self._restore_schedule(state_dict.get(STATE_KEY), state_dict.get("num_steps"))
        configured_max_lr = self.max_lr
        self._replaying = True
        try:
            super().load_state_dict(state_dict)
        finally:
            self._replaying = False
        self.lr_decay_style = SCHEDULER_NAME  # a stock checkpoint's style must not stick
        if self.max_lr != configured_max_lr:
            logger.warning("verl_lrstab: resuming with the checkpoint's max LR %s; the configured optim.lr %s is "
                           "ignored (same as verl's stock schedulers)", self.max_lr, configured_max_lr)


def build_length_surge_param_scheduler(optimizer, optim_config, verbose: bool = False) -> LengthSurgeParamScheduler:
    """Build the scheduler from verl's ``McoreOptimizerConfig`` as verl's own builder does.

    The steps are resolved as in ``verl.utils.megatron.optimizer.get_megatron_optimizer_param_scheduler``
    (verl 0.9.1): ``lr_decay_steps`` defaults to ``total_training_steps``; ``lr_warmup_steps <= 0``
    takes ``lr_warmup_steps_ratio x lr_decay_steps``. The checkpoint's scheduler state is
    always used (exact resume), so ``use_checkpoint_opt_param_scheduler`` must be true.
    """
    get = optim_config.get if hasattr(optim_config, "get") else lambda k, d=None: getattr(optim_config, k, d)
    if not get("use_checkpoint_opt_param_scheduler", False):
        raise ValueError(f"{OPTIM_KEY}.use_checkpoint_opt_param_scheduler=False: length_surge on "
                         "Megatron needs it true, else a resumed run restarts its LR schedule and surge detector "
                         "at step 0 (verl loads the scheduler state only with it). Allowed values: true")
    lr_decay_steps = get("lr_decay_steps", None)
    if lr_decay_steps is None:
        lr_decay_steps = optim_config.total_training_steps
    lr_warmup_steps = optim_config.lr_warmup_steps
    ratio = get("lr_warmup_steps_ratio", None)
    if ratio is not None and (lr_warmup_steps is None or lr_warmup_steps <= 0):
        lr_warmup_steps = int(ratio * lr_decay_steps)
    scheduler = LengthSurgeParamScheduler(
        optimizer,
        get("length_surge", None),
        init_lr=optim_config.lr_warmup_init,
        max_lr=optim_config.lr,
        min_lr=optim_config.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        start_wd=optim_config.weight_decay,
        end_wd=optim_config.weight_decay,
        wd_incr_steps=optim_config.total_training_steps,
        wd_incr_style=optim_config.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
    if verbose:
        print(f"verl_lrstab: length_surge scheduler (Megatron), warmup {lr_warmup_steps} steps from "
              f"{optim_config.lr_warmup_init}, options {scheduler.config.to_dict()}")
    return scheduler
