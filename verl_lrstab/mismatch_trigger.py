"""Mismatch-budget trigger: fires once the mismatch KL stays above a budget (pure Python).

The budget is either given (``mismatch_budget``), or calibrated from the run's own early steps:
after ``skip_first_steps``, the first ``mismatch_calibration_steps`` valid values give a robust
baseline (their median) and ``budget = max(mismatch_budget_factor * baseline, min_budget)``. The trigger then
fires when the value exceeds the budget on ``patience`` consecutive valid steps, at most once.

Why calibrate: the mismatch between two engines depends on the model, the dtypes and the
kernels (bf16 vs fp32, vLLM vs FSDP), so no absolute number fits every run; what the paper
ties to instability is the mismatch *growing* as training goes on. A multiple of the run's
own early level detects that growth. The median ignores an odd early spike; ``patience``
ignores a single bad batch. These defaults are our choice (the paper publishes no mismatch
test); the same shape as the length detector (3 steps of patience, warmup skipped).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Mapping, Optional, Union

from verl_lrstab._numbers import finite_float
from verl_lrstab.config import LengthSurgeConfig, options_for
from verl_lrstab.dataclass_reader import from_state, require

logger = logging.getLogger("verl_lrstab")


@dataclass
class MismatchTriggerState:
    """:meth:`MismatchTrigger.state_dict` as a dataclass (saved as plain types: ``dataclasses.asdict``)."""

    calibration: list[float]  # the valid values seen while calibrating
    baseline: Optional[float]  # their median, once calibrated
    calibrated_budget: Optional[float]
    streak: int  # consecutive valid steps above the budget
    fired_step: Optional[int]
    num_skipped: int
    last_step: Optional[int]

    def __post_init__(self):
        require(self.streak >= 0, "streak", self.streak, "an integer >= 0")
        require(self.num_skipped >= 0, "num_skipped", self.num_skipped, "an integer >= 0")


class MismatchTrigger:
    """Fires when a mismatch figure (``mismatch/k3`` by default, chosen by the caller) exceeds a budget.

    Args:
        config (LengthSurgeConfig | Mapping | None): the options (:class:`verl_lrstab.config.LengthSurgeConfig`,
            where each is documented and checked) this trigger reads: ``mismatch_budget`` (fixed; None:
            calibrated), ``mismatch_budget_factor``, ``mismatch_calibration_steps``, ``skip_first_steps``
            (steps ignored entirely, as by the length detector) and ``patience`` (consecutive valid steps
            above the budget). A mapping is checked as a YAML node is; ``trigger`` must be ``mismatch`` or
            ``either``. None: the defaults.

    The calibrated budget has a floor, :attr:`min_budget`, so a run whose engines agree (almost)
    exactly, baseline ~0, does not fire on the first rounding difference. NaN, inf, None and
    non-numbers are skipped with a warning: they neither count as an exceedance nor break a streak.

    Example:
        >>> trig = MismatchTrigger({"skip_first_steps": 0, "mismatch_calibration_steps": 3, "patience": 2})
        >>> [trig.update(s, v) for s, v in enumerate([1e-4, 2e-4, 1e-4, 3e-4, 9e-4, 9e-4, 9e-4], start=1)]
        [False, False, False, False, False, True, False]
        >>> trig.budget, trig.fired_step
        (0.0004, 6)
    """

    #: Floor of the calibrated budget: 1e-6 nats/token, below the bf16-vs-fp32 k3 measured even on
    #: random-init tiny Qwen2 models (1.3e-6 and 4.4e-6, ``scripts/bench_overhead.py``).
    min_budget = 1e-6

    def __init__(self, config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None):
        c = options_for(config, "MismatchTrigger", trigger=("mismatch", "either"))
        # each option under its own name
        self.mismatch_budget, self.mismatch_budget_factor = c.mismatch_budget, c.mismatch_budget_factor
        self.mismatch_calibration_steps, self.skip_first_steps = c.mismatch_calibration_steps, c.skip_first_steps
        self.patience = c.patience
        self._calibration: list[float] = []
        self.baseline: Optional[float] = None  # median of the calibration values
        self._calibrated_budget: Optional[float] = None
        self._streak = 0
        self.fired_step: Optional[int] = None
        self.num_skipped = 0
        self.last_step: Optional[int] = None

    @property
    def budget(self) -> Optional[float]:
        """The budget in force: the fixed one, the calibrated one, or None while calibrating."""
        return self.mismatch_budget if self.mismatch_budget is not None else self._calibrated_budget

    @property
    def fired(self) -> bool:
        return self.fired_step is not None

    def update(self, step: int, value: Optional[float]) -> bool:
        """Feed the figure logged for ``step``; return True only at the step where it fires."""
        self.last_step = step
        number = finite_float(value)
        if number is None:
            self.num_skipped += 1
            logger.warning("verl_lrstab: step %s: mismatch figure %r is not a finite number; "
                           "the mismatch trigger skips it", step, value)
            return False
        value = number
        if step <= self.skip_first_steps or self.fired:
            return False
        if self.budget is None:
            self._calibration.append(value)
            if len(self._calibration) >= self.mismatch_calibration_steps:
                self.baseline = median(self._calibration)
                self._calibrated_budget = max(self.mismatch_budget_factor * self.baseline, self.min_budget)
                logger.info("verl_lrstab: mismatch budget calibrated at step %s: %.3g (%.3g x median %.3g)",
                            step, self._calibrated_budget, self.mismatch_budget_factor, self.baseline)
            return False
        self._streak = self._streak + 1 if value > self.budget else 0
        if self._streak >= self.patience:
            self.fired_step = step
            logger.warning("verl_lrstab: mismatch trigger fired at step %s: %.3g > budget %.3g for %d steps",
                           step, value, self.budget, self._streak)
            return True
        return False

    def state_dict(self) -> dict:
        """The state, :class:`MismatchTriggerState` as plain Python types (safe for
        ``torch.load(weights_only=True)``)."""
        return asdict(MismatchTriggerState(calibration=list(self._calibration), baseline=self.baseline,
                                           calibrated_budget=self._calibrated_budget, streak=self._streak,
                                           fired_step=self.fired_step, num_skipped=self.num_skipped,
                                           last_step=self.last_step))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a field missing, unknown or of another type raises
        :class:`~verl_lrstab.dataclass_reader.StateFieldError` naming it). A fixed ``mismatch_budget`` given now
        still wins over a calibrated one."""
        s = from_state(MismatchTriggerState, state, "mismatch_trigger")
        self._calibration, self.baseline, self._calibrated_budget = s.calibration, s.baseline, s.calibrated_budget
        self._streak, self.fired_step = s.streak, s.fired_step
        self.num_skipped, self.last_step = s.num_skipped, s.last_step
