"""The reward-crash rule, one definition for ``lrstab guard`` (a rollback trigger) and ``lrstab compare``
(the ``crash_step`` column).

A crash is the first logged step at which the rolling median of the last :data:`CRASH_WINDOW`
logged scores has fallen below ``fraction`` of its earlier peak's height above the score's
**floor**: ``median - floor < fraction x (peak - floor)``. The floor is the low end of the score's
range (:func:`score_floor`): verl's lowest ``critic/score/min`` when it is logged (-1 for a +-1
reward), else min(0, the lowest score). With scores >= 0 the floor is 0 and the rule reads
"below ``fraction`` x the peak"; with a +-1 reward an accuracy falling from 44 % to 5 % (score
-0.12 -> -0.9) is a crash, where "x the peak" could never fire on a negative score.

Pure: a function of a score series (indexed by step); no verl, no I/O.
"""

from __future__ import annotations

import math

from typing import Optional

import pandas as pd

CRASH_WINDOW = 5  # logged points in the rolling median
DEFAULT_FRACTION = 0.6


def score_floor(score: pd.Series, score_min: Optional[pd.Series] = None) -> Optional[float]:
    """The low end of the score's range: the lowest of ``score_min`` (verl's ``critic/score/min``,
    the worst response's score) when it holds a number, else min(0, the lowest score); None when
    there is no score at all."""
    low = pd.to_numeric(score_min, errors="coerce").dropna() if score_min is not None else pd.Series(dtype=float)
    if len(low):
        return float(low.min())
    score = pd.to_numeric(score, errors="coerce").dropna()
    return min(0.0, float(score.min())) if len(score) else None


def reward_crash(score: pd.Series, fraction: float = DEFAULT_FRACTION, floor: Optional[float] = None,
                 after: int = -1, window: int = CRASH_WINDOW) -> Optional[tuple[int, int]]:
    """``(crash step, peak step)`` of the first crash after step ``after``, or None.

    Args:
        score: the score by step (non-numbers and NaN are left out).
        fraction: the share of the peak's height above the floor below which the median has crashed.
        floor: the score's floor; None: :func:`score_floor` of ``score`` alone.
        after: only a crash at a step after this one counts (the guard's steps already answered).
        window: logged points of the rolling median.
    """
    score = pd.to_numeric(score, errors="coerce").dropna().sort_index()
    if floor is None:
        floor = score_floor(score)
    if not len(score) or floor is None:
        return None
    # the rule is unchanged by a positive scale; scaled to at most 1, the median of two scores near
    # the float limit (their sum) and the height above the floor cannot overflow to inf
    scale = max(1.0, float(score.abs().max()), abs(float(floor)))
    if math.isfinite(scale):
        score, floor = score / scale, floor / scale
    rolling = score.rolling(window, min_periods=1).median()
    peak = rolling.cummax().shift(1)
    crashed = (peak > floor) & (rolling - floor < fraction * (peak - floor)) & (rolling.index > after)
    if not crashed.any():
        return None
    step = int(crashed.idxmax())
    before = rolling.loc[:step].iloc[:-1]
    return step, int(before.idxmax())
