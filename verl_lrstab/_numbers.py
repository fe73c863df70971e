"""Small numeric helpers shared by the detectors, the schedule and the glue (pure Python)."""

from __future__ import annotations

import math
from typing import Optional


def finite_float(value) -> Optional[float]:
    """``float(value)`` if it is a finite number (bools, text such as ``"1200"`` and other non-numbers
    are not), else None."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None

