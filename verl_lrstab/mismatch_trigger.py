"""Mismatch-budget trigger: fires once the mismatch KL stays above a budget (pure Python).

The budget is either given (``budget``), or calibrated from the run's own early steps: after
``skip_first_steps``, the first ``calibration_steps`` valid values give a robust baseline
(their median) and ``budget = max(budget_factor * baseline, min_budget)``. The trigger then
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
import math
from statistics import median
from typing import Optional

from verl_lrstab._numbers import finite_float

logger = logging.getLogger("verl_lrstab")


class MismatchTrigger:
    """Fires when a mismatch figure (``mismatch/k3`` by default, chosen by the caller) exceeds a budget.

    Args:
        budget (float | None): fixed budget (> 0). Default None: calibrated.
        budget_factor (float): calibrated budget = ``budget_factor`` x median of the calibration
            values. Default 4.0 (> 0).
        calibration_steps (int): valid values after ``skip_first_steps`` that calibrate the
            budget; they are never tested against it. Default 10 (>= 1). Ignored with ``budget``.
        skip_first_steps (int): steps ``<= skip_first_steps`` are ignored entirely (warmup:
            the first updates move the policy most). Default 10 (>= 0), as the length detector.
        patience (int): consecutive valid steps above the budget needed to fire. Default 3 (>= 1).
        min_budget (float): floor of the calibrated budget (>= 0), so a run whose engines agree
            (almost) exactly, baseline ~0, does not fire on the first rounding difference.
            Default 1e-6 nats/token: below the bf16-vs-fp32 k3 measured even on random-init tiny
            Qwen2 models (1.3e-6 and 4.4e-6, ``scripts/bench_overhead.py``).

    NaN, inf, None and non-numbers are skipped with a warning: they neither count as an
    exceedance nor break a streak.

    Example:
        >>> trig = MismatchTrigger(skip_first_steps=0, calibration_steps=3, patience=2)
        >>> [trig.update(s, v) for s, v in enumerate([1e-4, 2e-4, 1e-4, 3e-4, 9e-4, 9e-4, 9e-4], start=1)]
        [False, False, False, False, False, True, False]
        >>> trig.budget, trig.fired_step
        (0.0004, 6)
    """

    def __init__(
        self,
        budget: Optional[float] = None,
        budget_factor: float = 4.0,
        calibration_steps: int = 10,
        skip_first_steps: int = 10,
        patience: int = 3,
        min_budget: float = 1e-6,
    ):
        for name, value, low in (
            ("calibration_steps", calibration_steps, 1),
            ("skip_first_steps", skip_first_steps, 0),
            ("patience", patience, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if budget is not None and not (finite_float(budget) is not None and budget > 0):
            raise ValueError(f"mismatch budget must be null or a finite number > 0, got {budget!r}")
        if not (finite_float(budget_factor) is not None and budget_factor > 0):
            raise ValueError(f"budget_factor must be a finite number > 0, got {budget_factor!r}")
        if not (finite_float(min_budget) is not None and min_budget >= 0):
            raise ValueError(f"min_budget must be a finite number >= 0, got {min_budget!r}")
        self.fixed_budget = None if budget is None else float(budget)
        self.budget_factor = float(budget_factor)
        self.calibration_steps = calibration_steps
        self.skip_first_steps = skip_first_steps
        self.patience = patience
        self.min_budget = float(min_budget)
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
        return self.fixed_budget if self.fixed_budget is not None else self._calibrated_budget

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
            if len(self._calibration) >= self.calibration_steps:
                self.baseline = median(self._calibration)
                self._calibrated_budget = max(self.budget_factor * self.baseline, self.min_budget)
                logger.info("verl_lrstab: mismatch budget calibrated at step %s: %.3g (%.3g x median %.3g)",
                            step, self._calibrated_budget, self.budget_factor, self.baseline)
            return False
        self._streak = self._streak + 1 if value > self.budget else 0
        if self._streak >= self.patience:
            self.fired_step = step
            logger.warning("verl_lrstab: mismatch trigger fired at step %s: %.3g > budget %.3g for %d steps",
                           step, value, self.budget, self._streak)
            return True
        return False

    def state_dict(self) -> dict:
        """The state as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        return {
            "calibration": list(self._calibration),
            "baseline": self.baseline,
            "calibrated_budget": self._calibrated_budget,
            "streak": self._streak,
            "fired_step": self.fired_step,
            "num_skipped": self.num_skipped,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. A fixed ``budget`` given now still wins over a calibrated one."""
        self._calibration = [float(v) for v in state["calibration"]]
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
        cb = state["calibrated_budget"]
        self._calibrated_budget = None if cb is None else float(cb)
        self._streak = int(state["streak"])
        self.fired_step = None if state["fired_step"] is None else int(state["fired_step"])
        self.num_skipped = int(state["num_skipped"])
        self.last_step = state["last_step"]
