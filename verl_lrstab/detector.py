"""Online detector of a surge in the per-step mean response length (pure Python).

A surge is a fast rise: the current level (median of the last ``fast_window``
steps) reaches ``ratio_threshold`` x the baseline (median of a
``baseline_window``-step span that ends ``horizon`` steps earlier), on
``patience`` consecutive steps. Medians make a single long batch
harmless; comparing against the level ``horizon`` steps ago makes the test
about speed, so slow healthy growth (~1.5x over 100+ steps) stays well under
the threshold while the runaways that precede collapse (1.8x-4x within 20-40
steps) cross it. Every decision uses data up to the current step only.
"""

from __future__ import annotations

import logging
import math
from statistics import median
from typing import Optional

from verl_lrstab._numbers import finite_float

logger = logging.getLogger("verl_lrstab")

_NAN = float("nan")


class SurgeDetector:
    """Detects a response-length surge from one value per step.

    Args:
        skip_first_steps (int): steps ``<= skip_first_steps`` are ignored (warmup, format
            learning). Default 10.
        fast_window (int): span in steps of the median giving the current level. Default 5.
        horizon (int): the baseline span ends this many steps before the current step.
            Default 30. Until ``horizon`` steps of history exist, the baseline is the first
            ``baseline_window`` steps after ``skip_first_steps`` (once they no longer overlap
            the current window), so early runaways are caught too.
        baseline_window (int): span in steps of the median giving the baseline. Default 10.
        ratio_threshold (float): surge condition ``level >= ratio_threshold * baseline``.
            Default 1.5, must be > 1.
        patience (int): the condition must hold on consecutive valid observations spanning at
            least ``patience`` steps (3 observations when every step is logged; 2 in a log
            written every 5 steps, so sparse logs are not penalised). Default 3.
        max_surges (int): surges reported at most. Default 1. While more may come, the history
            is cleared after a surge, so the next one is measured against the post-surge level;
            otherwise level, baseline and ratio keep being reported.

    Example:
        >>> det = SurgeDetector(skip_first_steps=0, horizon=5, baseline_window=3, fast_window=2, patience=2)
        >>> [det.update(s, v) for s, v in enumerate([100] * 8 + [300] * 4, start=1)][-4:]
        [False, True, False, False]
    """

    def __init__(
        self,
        skip_first_steps: int = 10,
        fast_window: int = 5,
        horizon: int = 30,
        baseline_window: int = 10,
        ratio_threshold: float = 1.5,
        patience: int = 3,
        max_surges: int = 1,
    ):
        for name, value, low in (
            ("skip_first_steps", skip_first_steps, 0),
            ("fast_window", fast_window, 1),
            ("horizon", horizon, 1),
            ("baseline_window", baseline_window, 1),
            ("patience", patience, 1),
            ("max_surges", max_surges, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(ratio_threshold, (int, float)) and ratio_threshold > 1.0):
            raise ValueError(f"ratio_threshold must be a number > 1, got {ratio_threshold!r}")
        self.skip_first_steps = skip_first_steps
        self.fast_window = fast_window
        self.horizon = horizon
        self.baseline_window = baseline_window
        self.ratio_threshold = float(ratio_threshold)
        self.patience = patience
        self.max_surges = max_surges
        self._reset_history()
        self.level = _NAN
        self.baseline = _NAN
        self.ratio = _NAN
        self.surge_steps: list[int] = []
        self.num_skipped = 0
        self.last_step: Optional[int] = None

    #: The fed figures this detector reads (the schedule logs the ones it is fed): the length alone.
    reads = ("response_length",)

    # -- public API (the one :class:`verl_lrstab.cusum.CusumDetector` has too) -----------------
    @property
    def surge_step(self) -> Optional[int]:
        """The step of the first surge, or None."""
        return self.surge_steps[0] if self.surge_steps else None

    def update(self, step: int, value: Optional[float], score: Optional[float] = None, kl: Optional[float] = None,
               clip_ratio: Optional[float] = None, **cosignals: Optional[float]) -> bool:
        """Feed the value logged for ``step``; return True if a surge is reported at this step.

        NaN, inf, non-positive and missing values (an empty or failed batch) are skipped with a
        warning: they never raise and never count towards a surge. ``score``, ``kl``,
        ``clip_ratio`` and ``cosignals`` are accepted and not read: the length alone decides.
        """
        self.last_step = step
        number = finite_float(value)
        if number is None or number <= 0:
            self.num_skipped += 1
            logger.warning("verl_lrstab: step %s: response length %r is not a positive finite number; "
                           "the surge detector skips it", step, value)
            return False
        value = number
        if step <= self.skip_first_steps:
            return False

        self._history.append((step, value))
        # Keep only what the baseline and current windows can still reach.
        oldest = step - self.horizon - self.baseline_window
        self._history = [(s, v) for s, v in self._history if s > oldest]
        if self._first_step is None:
            self._first_step = step
        if step < self._first_step + self.baseline_window:
            self._first_values.append(value)

        self.level = median(v for s, v in self._history if s > step - self.fast_window)
        reference = [v for s, v in self._history if s <= step - self.horizon]
        if not reference and self._first_step + self.baseline_window <= step - self.fast_window + 1:
            reference = self._first_values
        if not reference:
            self.baseline, self.ratio, self._streak_start = _NAN, _NAN, None
            return False
        self.baseline = median(reference)
        self.ratio = self.level / self.baseline
        if self.ratio < self.ratio_threshold:
            self._streak_start = None
            return False
        if self._streak_start is None:
            self._streak_start = step
        if step - self._streak_start + 1 >= self.patience and len(self.surge_steps) < self.max_surges:
            self.surge_steps.append(step)
            if len(self.surge_steps) < self.max_surges:
                # A later surge is measured against the post-surge level.
                self._reset_history()
            return True
        return False

    def observe(self, step: int, **cosignals: Optional[float]) -> None:
        """Co-signals of step ``step`` (verl's own figures of the update): accepted, not read."""

    def metrics(self) -> dict:
        """The detector's own figures (``{name: value}``), the non-finite ones left out."""
        return {k: v for k, v in (("baseline", self.baseline), ("ratio", self.ratio), ("level", self.level))
                if math.isfinite(v)}

    def state_dict(self) -> dict:
        """The full state as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        return {
            "history": [[s, v] for s, v in self._history],
            "first_step": self._first_step,
            "first_values": list(self._first_values),
            "streak_start": self._streak_start,
            "surge_steps": list(self.surge_steps),
            "num_skipped": self.num_skipped,
            "last_step": self.last_step,
            "level": self.level,
            "baseline": self.baseline,
            "ratio": self.ratio,
        }

    def load_state_dict(self, state: dict) -> None:
        self._history = [(int(s), float(v)) for s, v in state["history"]]
        self._first_step = state["first_step"]
        self._first_values = [float(v) for v in state["first_values"]]
        self._streak_start = state["streak_start"]
        self.surge_steps = [int(s) for s in state["surge_steps"]]
        self.num_skipped = int(state["num_skipped"])
        self.last_step = state["last_step"]
        self.level, self.baseline, self.ratio = state["level"], state["baseline"], state["ratio"]

    # -- helpers ----------------------------------------------------------------------------
    def _reset_history(self) -> None:
        self._history: list[tuple[int, float]] = []
        self._first_step: Optional[int] = None
        self._first_values: list[float] = []
        self._streak_start: Optional[int] = None

