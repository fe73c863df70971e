"""``detector: ratio``: the ratio rule, a surge in the per-step mean response length as a level against a baseline (pure Python).

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
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Mapping, Optional, Union, cast

from verl_lrstab._numbers import finite_float
from verl_lrstab.config import LengthSurgeConfig, options_for
from verl_lrstab.dataclass_reader import Row, from_state, require

logger = logging.getLogger("verl_lrstab")

_NAN = float("nan")


@dataclass
class RatioState:
    """:meth:`RatioDetector.state_dict` as a dataclass (saved as plain types: ``dataclasses.asdict``)."""

    history: list[Row]  # the steps the windows can still reach
    first_step: Optional[int]  # the first step after skip_first_steps, and its baseline_window values
    first_values: list[float]
    streak_start: Optional[int]  # the first step of the current run of steps at the threshold
    surge_steps: list[int]
    num_skipped: int
    last_step: Optional[int]
    # the last step's measurements (NaN: not formed), reported until the next step forms them
    level: float
    baseline: float
    ratio: float

    def __post_init__(self):
        require(all(math.isfinite(v) for v in self.first_values), "first_values", self.first_values, "finite numbers")
        require(all(s >= 0 for s in self.surge_steps), "surge_steps", self.surge_steps, "integer steps >= 0")
        require(self.num_skipped >= 0, "num_skipped", self.num_skipped, "an integer >= 0")


class RatioDetector:
    """Detects a response-length surge from one value per step (``detector: ratio``).

    Args:
        config (LengthSurgeConfig | Mapping | None): the options (:class:`verl_lrstab.config.LengthSurgeConfig`,
            where each is documented and checked) this detector reads: ``skip_first_steps``,
            ``fast_window``, ``horizon``, ``baseline_window``, ``ratio_threshold``, ``patience`` and
            ``max_surges``. A mapping is checked as a YAML node is; ``detector`` must be ``ratio``. None:
            the defaults.

    Until ``horizon`` steps of history exist, the baseline is the first ``baseline_window`` steps
    after ``skip_first_steps`` (once they no longer overlap the current window), so early runaways
    are caught too. The condition must hold on consecutive valid observations spanning at least
    ``patience`` steps (3 observations when every step is logged; 2 in a log written every 5 steps).
    While more surges may come (``max_surges``), the history is cleared after a surge, so the next
    one is measured against the post-surge level; otherwise level, baseline and ratio keep being
    reported.

    Example:
        >>> det = RatioDetector({"skip_first_steps": 0, "horizon": 5, "baseline_window": 3, "fast_window": 2,
        ...                      "patience": 2})
        >>> [det.update(s, v) for s, v in enumerate([100] * 8 + [300] * 4, start=1)][-4:]
        [False, True, False, False]
    """

    def __init__(self, config: Union[LengthSurgeConfig, Mapping[str, Any], None] = None):
        c = options_for(config, "RatioDetector", detector=("ratio",))
        self.skip_first_steps, self.max_surges, self.patience = c.skip_first_steps, c.max_surges, c.patience
        self.fast_window, self.horizon, self.baseline_window = c.fast_window, c.horizon, c.baseline_window
        self.ratio_threshold = c.ratio_threshold
        self._reset_history()
        self.level = _NAN
        self.baseline = _NAN
        self.ratio = _NAN
        self.surge_steps: list[int] = []
        self.num_skipped = 0
        self.last_step: Optional[int] = None

    #: The fed figures this detector reads (the schedule logs the ones it is fed): the length alone.
    reads = ("response_length",)
    # the windows' state, set by _reset_history and load_state_dict
    _history: list[tuple[int, float]]
    _first_step: Optional[int]
    _first_values: list[float]
    _streak_start: Optional[int]

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

    def add_cosignals(self, step: int, **cosignals: Optional[float]) -> None:
        """Co-signals of step ``step`` (verl's own figures of the update): accepted, not read."""

    def metrics(self) -> dict:
        """The detector's own figures (``{name: value}``), the non-finite ones left out."""
        return {k: v for k, v in (("baseline", self.baseline), ("ratio", self.ratio), ("level", self.level))
                if math.isfinite(v)}

    def state_dict(self) -> dict:
        """The full state, :class:`RatioState` as plain Python types (safe for ``torch.load(weights_only=True)``)."""
        rows = cast("list[Row]", [[s, v] for s, v in self._history])  # saved as lists: from_state reads them back
        return asdict(RatioState(history=rows, first_step=self._first_step,
                                 first_values=list(self._first_values), streak_start=self._streak_start,
                                 surge_steps=list(self.surge_steps), num_skipped=self.num_skipped,
                                 last_step=self.last_step, level=self.level, baseline=self.baseline, ratio=self.ratio))

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a state this detector cannot read (a field missing, unknown or of another
        type) raises :class:`~verl_lrstab.dataclass_reader.StateFieldError` naming the field."""
        s = from_state(RatioState, state, "detector")
        self._history = [(step, value) for step, value in s.history]
        self._first_step, self._first_values, self._streak_start = s.first_step, s.first_values, s.streak_start
        self.surge_steps, self.num_skipped, self.last_step = s.surge_steps, s.num_skipped, s.last_step
        self.level, self.baseline, self.ratio = s.level, s.baseline, s.ratio

    # -- helpers ----------------------------------------------------------------------------
    def _reset_history(self) -> None:
        self._history = []
        self._first_step = None
        self._first_values = []
        self._streak_start = None

