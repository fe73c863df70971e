"""The paper's decay rule as small pure functions (cf. transformers/optimization.py).

Conventions (the same as verl's): ``u`` is the 1-based index of an actor update
(verl's global step when every step updates the actor). The torch scheduler's
``last_epoch`` counts completed updates, so while update ``u`` runs,
``last_epoch == u - 1`` and the LR in force is::

    lr0 * warmup_scale(u - 1, W) * decay_scale(u, ...)

verl logs ``actor/lr`` after stepping the scheduler, i.e. the LR of the next update.
Which update starts the decay is the schedule's (:mod:`verl_lrstab.detectors`).
"""

from __future__ import annotations

import math
from typing import Optional


def decay_period_from_surge(surge_step: int, period_factor: float = 1.8) -> int:
    """``P = round(period_factor * surge_step)`` (half up), at least 1. Paper: 110 -> 198."""
    return max(1, int(math.floor(period_factor * surge_step + 0.5)))


def num_decays(update: int, period: Optional[int], origin: str = "start", surge_step: Optional[int] = None) -> int:
    """How many times the LR has been multiplied by ``gamma`` when update ``update`` runs.

    ``origin="start"``: ``update // period``. ``origin="surge"``: 0 up to the surge's own
    update, 1 from the next update on, then one more every ``period`` updates.
    """
    if period is None:
        return 0
    if origin == "surge" and surge_step is not None:
        return 0 if update <= surge_step else 1 + (update - surge_step - 1) // period
    return max(0, update) // period


def decay_scale(update: int, period: Optional[int], gamma: float = 0.5, min_lr_ratio: float = 0.1,
                origin: str = "start", surge_step: Optional[int] = None) -> float:
    """``max(min_lr_ratio, gamma ** n)`` with ``n = num_decays(...)``; 1.0 before any decay."""
    n = num_decays(update, period, origin, surge_step)
    return 1.0 if n == 0 else max(min_lr_ratio, gamma**n)


def warmup_scale(completed_updates: int, warmup_steps: int) -> float:
    """verl's constant-with-warmup factor (``get_constant_schedule_with_warmup``)."""
    if completed_updates < warmup_steps:
        return float(completed_updates) / float(max(1, warmup_steps))
    return 1.0
