"""The reward-crash rule: one definition, the guard's trigger and compare's ``crash_step`` agree on it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from verl_lrstab.cli import main
from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.guard.plan import GuardOptions, find_trouble

# (name, scores, score/min or None, the crash step the rule asks for: the first step whose 5-point
# median has fallen below floor + 0.6 x (peak - floor))
SERIES = [
    # 0/1 reward: floor 0; median 0.8 until step 10, then 0.2 from step 11: the median of steps 9..13
    # (0.8, 0.8, 0.2, 0.2, 0.2) is 0.2 < 0.48 at step 13
    ("zero-one", [0.8] * 10 + [0.2] * 8, [0.0] * 18, 13),
    # +-1 reward: accuracy 0.44 -> 0.05, score -0.12 -> -0.9, floor -1: the median is -0.9 at step 13,
    # below -1 + 0.6 x 0.88 = -0.472
    ("plus-minus-one", [-0.12] * 10 + [-0.9] * 8, [-1.0] * 18, 13),
    # a mild fall (0.44 -> 0.31: score -0.38, 0.62 of the height above -1) is no crash
    ("mild", [-0.12] * 10 + [-0.38] * 8, [-1.0] * 18, None),
    # no score/min logged: the floor is min(0, the lowest score) = 0
    ("no-min", [0.9] * 10 + [0.3] * 8, None, 13),
]


@pytest.mark.parametrize("name,score,low,expected", SERIES, ids=[s[0] for s in SERIES])
def test_the_guard_and_compare_find_the_same_crash(tmp_path, name, score, low, expected, capsys):
    records = {s: {"critic/score/mean": v, **({"critic/score/min": low[s - 1]} if low else {})}
               for s, v in enumerate(score, start=1)}
    trouble = find_trouble(records, GuardOptions(on_surge=False, on_non_finite=False), LengthSurgeConfig())
    assert (trouble.step if trouble else None) == expected
    run = tmp_path / "metrics.jsonl"
    run.write_text("".join(json.dumps({"step": s, "data": {"response_length/mean": 100.0, **d}}) + "\n"
                           for s, d in records.items()))
    assert main(["compare", str(run), "--out", str(tmp_path / "out")]) == 0
    table = pd.read_csv(tmp_path / "out" / "summary.csv")
    crash = table["crash_step"].iloc[0]
    assert (None if pd.isna(crash) else int(crash)) == expected


def test_the_onset_is_the_peak_the_score_fell_from():
    from verl_lrstab.reward_crash import reward_crash

    score = pd.Series([0.2, 0.4, 0.7, 0.6, 0.6, 0.6, 0.1, 0.1, 0.1, 0.1], index=range(1, 11))
    # medians: 0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6, 0.1 (step 9: 0.1 < 0.36); the highest before it first at 5
    assert reward_crash(score, 0.6) == (9, 5)
    assert reward_crash(score, 0.6, after=9) == (10, 5)  # still below at step 10
    assert reward_crash(score, 0.6, after=10) is None
