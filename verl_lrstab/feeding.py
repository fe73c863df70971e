"""What the torch and megatron-core schedulers share: the schedule fed by verl, and restored from a checkpoint.

verl's trainer calls the worker's ``update_actor``, where the glue measures the batch, and verl's
engine then steps the LR scheduler with no argument: the batch never reaches ``step()``. So the glue
hands the update's figures first (:meth:`FedSchedule.observe_update`, the glue's one way in), and the
scheduler keeps them in one attribute, ``_figures_for_next_step``, until that ``step()`` takes them
(once: never reused) and hands them to the schedule's one way in,
:meth:`verl_lrstab.detectors.LengthSurgeSchedule.observe`. It is the one value kept between two calls on
the figures' way to the detector, and it stays because the decision belongs to the step: it is taken
under the update the step counts, a step verl does not take decides nothing (the glue then finds the
figures still waiting: :attr:`FedSchedule.figures_waiting`), and in bypass mode the mismatch figure
comes at the update's first optimizer step, after the hand-over and before the step, and replaces the
figures handed (``glue/steps.py``). The update's own figures (the co-signals) exist only once it ran,
after its step: they go to the schedule at once, under the update last decided. Figures given to
``step(...)`` itself (a training loop of one's own) win over those handed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional

from verl_lrstab.config import OPTIONS_KEY, LengthSurgeConfig
from verl_lrstab.decay import decay_period_from_surge
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures

logger = logging.getLogger("verl_lrstab")


class FedSchedule:
    """What the torch (``LengthSurgeLR``) and megatron-core schedulers share: a ``schedule``
    (:class:`~verl_lrstab.detectors.LengthSurgeSchedule`) fed through :meth:`observe_update` (the verl glue's
    one way in) before verl's engine steps the scheduler without arguments; explicit ``step()`` arguments win."""

    schedule: LengthSurgeSchedule
    _held: bool = False
    # the batch figures handed by observe_update, taken by the next step() (the module docstring says why)
    _figures_for_next_step: Optional[UpdateFigures] = None
    _updates_per_step: int = 1
    _warmup_in_updates: Optional[int] = None  # the warmup as configured (in actor updates)

    def metrics(self) -> dict:
        """The ``lrstab/*`` figures of the last step: each scheduler's own (the glue logs them)."""
        raise NotImplementedError

    def observe_update(self, figures: UpdateFigures) -> None:
        """Hand the scheduler one trainer step's figures.

        The batch's figures wait for the next ``step()``, which feeds them to the schedule once
        (handed again before that step, they replace the waiting ones). The co-signals exist
        only once the update ran, after its step: they are observed at once, under the update
        last decided (the detector reads them from its next decision on).
        """
        if figures.updates_per_step is not None:
            self.set_updates_per_step(figures.updates_per_step)
        if figures.has_batch_figures:
            self._figures_for_next_step = figures
        last = self.schedule.last_update
        if (figures.cosignals or not figures.has_batch_figures) and last is not None:
            self.schedule.observe(last, UpdateFigures(cosignals=figures.cosignals))

    def _step_figures(self, given: UpdateFigures) -> UpdateFigures:
        """The figures a ``step()`` feeds: those handed for it by :meth:`observe_update` (taken: never reused)
        under those ``given`` to it, which win figure by figure, with ``given``'s co-signals (the update's own,
        observed after its decision: both ways in decide alike)."""
        handed, self._figures_for_next_step = self._figures_for_next_step or UpdateFigures(), None
        return handed.overridden_by(given)

    @property
    def figures_waiting(self) -> bool:
        """Batch figures were handed and no step has consumed them yet."""
        return self._figures_for_next_step is not None

    def set_updates_per_step(self, count: int) -> None:
        """Run ``count`` actor updates per trainer step (verl's ``separate_async``), the LR held within a step.

        verl resolves the warmup in actor updates (V1 multiplies its total by the updates per
        step); the scheduler steps once per trainer step, so its warmup becomes
        ``ceil(warmup / count)`` trainer steps. The LR of the next update follows at once (a resumed
        run's first step, whose LR was put in before the count was known).
        """
        if self._count_updates_per_step(count):
            self._apply_lr()

    def _count_updates_per_step(self, count: int) -> bool:
        """Take ``count`` updates per trainer step (the warmup converted, the LR left as it is); whether it changed."""
        if count <= 1 or count == self._updates_per_step:
            return False
        if self._warmup_in_updates is None:
            self._warmup_in_updates = self.schedule.warmup_steps
        self._updates_per_step = count
        self.schedule.warmup_steps = -(-self._warmup_in_updates // count)
        return True

    @property
    def updates_per_step(self) -> int:
        return self._updates_per_step

    @contextlib.contextmanager
    def holding(self):
        """Within the block ``step()`` keeps the LR and feeds nothing: the actor updates of one
        trainer step (verl's ``separate_async``) share one LR, and the step's figures are fed once."""
        self._held = True
        try:
            yield self
        finally:
            self._held = False

    def _restore_schedule(self, own: Optional[dict], step) -> None:
        """Restore the schedule's state from a checkpoint (one behaviour for both engines).

        Args:
            own: ``{"schedule": ..., "options": ...}`` as saved, or None for a checkpoint saved by
                another LR schedule (``constant``, ``cosine``, Megatron's styles): the length_surge
                state then starts afresh, with a warning naming the checkpoint's step.
            step: the checkpoint's update counter (for the messages).
        """
        if own is None or own.get("schedule") is None:
            logger.warning("verl_lrstab: the checkpoint at update %s was saved by another LR schedule (it has no "
                           "length_surge state): the surge detector starts afresh from there", step)
            return
        saved = own["options"]  # every option (checked with the state: verl_lrstab.scheduler_state_checks)
        if saved["origin"] != self.config.origin and not self.config.is_given("origin"):
            # origin left unset: a running schedule keeps the rule it was started with
            logger.warning("verl_lrstab: the checkpoint at update %s was written with origin %r; this run's "
                           "default is origin %r. Keeping the checkpoint's origin %r so the running LR schedule "
                           "does not change; set %s.origin explicitly to switch", step, saved["origin"],
                           self.config.origin, saved["origin"], OPTIONS_KEY)
            self.schedule.config = _with_origin(self.config, saved["origin"])
        changed = {k: (saved[k], v) for k, v in self.config.to_dict().items() if saved[k] != v}
        if changed:
            logger.warning("verl_lrstab: length_surge options changed since the checkpoint at update %s "
                           "(key: (checkpoint, now)) %s; the configured ones apply from now on, so the decay "
                           "period and the LR may change at once", step, changed)
        self.schedule.load_state_dict(own["schedule"])
        self._warn_of_a_monitored_surge(saved, step)
        dismissed = self.config.dismiss_trigger_step
        if dismissed is not None and self.schedule.trigger_step == dismissed:
            logger.warning("verl_lrstab: the decay that started at update %s is dismissed (%s.dismiss_trigger_step): "
                           "resuming from update %s at the initial LR, the surge detector re-armed from there",
                           dismissed, OPTIONS_KEY, step)
            self.rearm()

    def _warn_of_a_monitored_surge(self, saved: dict, step) -> None:
        """A surge a monitor run saw is not acted on once the decay is turned on: the detector reports one a run."""
        surge = self.schedule.surge_step
        if not saved["monitor_only"] or self.config.monitor_only or surge is None or self.schedule.trigger_step:
            return
        period = decay_period_from_surge(surge, self.config.period_factor)
        logger.warning("verl_lrstab: the checkpoint at update %s was written with monitor_only: true and its detector "
                       "saw a surge at update %s; turning monitor_only off does not act on it (the detector reports "
                       "one surge a run) and the LR stays verl's constant schedule. To decay from that surge, resume "
                       "with %s.decay_from_step=%s and %s.decay_period=%s (what lrstab guard's rollback sets)",
                       step, surge, OPTIONS_KEY, step, OPTIONS_KEY, period)

    def rearm(self) -> None:
        """Clear a fired decay: the LR returns to the initial LR (warmup as configured) from the next
        update, and the surge detector starts afresh from the current update, as in a new run."""
        self.schedule = LengthSurgeSchedule(self.config, warmup_steps=self.schedule.warmup_steps)
        self._apply_lr()

    def _apply_lr(self) -> None:
        """Put the LR the schedule gives for the next update into the optimizer (the engine's own override)."""

    @property
    def config(self) -> LengthSurgeConfig:
        return self.schedule.config

    @property
    def surge_step(self) -> Optional[int]:
        return self.schedule.surge_step

    @property
    def decay_period(self) -> Optional[int]:
        return self.schedule.decay_period


def _with_origin(config: LengthSurgeConfig, origin: str) -> LengthSurgeConfig:
    kept = dataclasses.replace(config, origin=origin)
    return kept._with_given(config.given_keys or ()) if config.given_keys is not None else kept
