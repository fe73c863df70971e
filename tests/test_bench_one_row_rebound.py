"""scripts/bench_one_row_rebound.py's experimental rule (not the product's): a rebound decided on its newest row alone.
It must fire on the first row of a return to an earlier high, where ``cusum`` itself does not, and only at a rebound."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_one_row_rebound as bench  # noqa: E402

from verl_lrstab.cusum import CusumDetector  # noqa: E402


def lengths(early_high: bool) -> list[float]:
    """100 tokens +-2 %, one row at 200 at step 81; with ``early_high`` steps 1-15 at 500 (an early excursion)."""
    rng = np.random.default_rng(0)
    out = list(100 * np.exp(0.02 * rng.standard_normal(90)))
    if early_high:
        out[:15] = [500.0] * 15
    out[80] = 200.0
    return out


def first_fire(detector, values) -> int | None:
    return next((step for step, v in enumerate(values, start=1) if detector.update(step, v)), None)


def test_a_return_to_an_earlier_high_fires_on_its_first_row():
    assert first_fire(bench.one_row_detector(6.0)(), lengths(early_high=True)) == 81
    assert first_fire(CusumDetector(), lengths(early_high=True)[:81]) is None  # cusum needs more than one row


def test_one_row_without_an_earlier_high_is_no_rebound():
    assert first_fire(bench.one_row_detector(6.0)(), lengths(early_high=False)[:81]) is None


def test_a_bar_above_the_jump_does_not_fire():
    # the row at 200 is log(2) / 0.05 (the noise floor) ~ 13.9 noise units above 100 tokens
    assert first_fire(bench.one_row_detector(16.0)(), lengths(early_high=True)[:81]) is None
