"""Reward functions for verl's ``reward.custom_reward_function`` hook (CPU demo and tests).

Use them with ``reward.custom_reward_function.path=pkg://verl_lrstab_cpu.rewards`` and
``reward.custom_reward_function.name=<function>``; extra keyword arguments go under
``reward.custom_reward_function.reward_kwargs``. verl calls them once per response with
the decoded response text (``solution_str``) and the dataset's ``ground_truth``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

_INT = re.compile(r"-?\d+")


def _last_int(text: str) -> Optional[int]:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def arithmetic_dense(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs
) -> float:
    """Dense arithmetic reward: some signal even for a barely trained model.

    ``0`` without any integer; else ``0.2 + 0.8 * exp(-|answer - truth| / scale)`` where the
    answer is the last integer of the response (1.0 when exact).

    Args:
        data_source: dataset tag (unused).
        solution_str: decoded response.
        ground_truth: the correct integer (as str or int).
        extra_info: per-sample info (unused).
        **kwargs: ``scale`` (float, default 5.0): distance at which the credit falls to 1/e.

    Returns:
        The reward in [0, 1].
    """
    scale = float(kwargs.get("scale", 5.0))
    answer = _last_int(solution_str)
    if answer is None:
        return 0.0
    return 0.2 + 0.8 * math.exp(-abs(answer - int(ground_truth)) / scale)


def longer_is_better(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs
) -> float:
    """Pays for LONGER responses: ``min(chars, target_chars) / target_chars``.

    Used to provoke a real response-length surge (tests, demo): GRPO then favours the
    longest answers of every group and the policy's mean length climbs.

    Args:
        data_source: dataset tag (unused).
        solution_str: decoded response.
        ground_truth: unused.
        extra_info: unused.
        **kwargs: ``target_chars`` (int, default 120): length that earns the full reward.

    Returns:
        The reward in [0, 1].
    """
    target = int(kwargs.get("target_chars", 120))
    if target <= 0:
        raise ValueError(f"reward_kwargs.target_chars must be > 0, got {target}")
    return min(len(solution_str.strip()), target) / target
