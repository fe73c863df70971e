"""The surge detector on synthetic length series (pure Python)."""

import logging
import math
import random

import pytest

from verl_lrstab.detector import SurgeDetector


def run(values, start=1, **kwargs):
    det = SurgeDetector(**kwargs)
    fired = [s for s, v in enumerate(values, start=start) if det.update(s, v)]
    return det, fired


def noisy(levels, cv=0.05, seed=0):
    rng = random.Random(seed)
    return [lvl * (1 + rng.gauss(0, cv)) for lvl in levels]


def test_flat_noisy_run_never_fires():
    _, fired = run(noisy([1000.0] * 400, cv=0.1))
    assert fired == []


@pytest.mark.parametrize("seed", range(5))
def test_slow_healthy_growth_does_not_fire(seed):
    # 1000 -> 1500 over 150 steps: the model learning to reason longer.
    levels = [1000.0] * 20 + [1000.0 + 500.0 * i / 150 for i in range(150)] + [1500.0] * 100
    _, fired = run(noisy(levels, cv=0.08, seed=seed))
    assert fired == []


@pytest.mark.parametrize("rise,duration", [(1.8, 30), (1.8, 20), (2.5, 30), (4.0, 40), (3.0, 10)])
def test_fast_rise_fires_soon_after_onset(rise, duration):
    onset = 100
    levels = [1000.0] * onset + [1000.0 * (1 + (rise - 1) * i / duration) for i in range(duration)]
    levels += [1000.0 * rise] * 100
    _, fired = run(noisy(levels, cv=0.05))
    assert len(fired) == 1
    assert onset < fired[0] <= onset + duration + 10


def test_single_long_batches_are_not_a_surge():
    levels = [1000.0] * 300
    for s in (50, 120, 121, 200):
        levels[s] = 5000.0
    _, fired = run(levels)
    assert fired == []


def test_length_collapse_to_short_answers_does_not_fire():
    levels = [1000.0] * 100 + [1000.0 - 900.0 * i / 20 for i in range(20)] + [100.0] * 100
    _, fired = run(noisy(levels))
    assert fired == []


def test_warmup_transients_are_ignored():
    # A format-learning jump in the first steps, then flat.
    levels = [100.0] * 5 + [400.0] * 5 + [400.0] * 200
    _, fired = run(levels, skip_first_steps=10)
    assert fired == []
    _, fired = run(levels, skip_first_steps=0, horizon=5, baseline_window=3)
    assert fired  # the same transient counts once warmup is not skipped


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 0.0, -3.0, None, "x"])
def test_bad_values_are_skipped_never_fire(bad, caplog):
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    det = SurgeDetector(skip_first_steps=0, horizon=3, baseline_window=2, fast_window=1, patience=1)
    for s in range(1, 10):
        assert det.update(s, 100.0) is False
    for s in range(10, 40):
        assert det.update(s, bad) is False
    assert det.num_skipped == 30
    assert "skips it" in caplog.text
    assert det.update(40, 100.0) is False  # still healthy, state intact


def test_fires_at_most_max_surges():
    levels = [100.0] * 60 + [400.0] * 60 + [1600.0] * 60
    _, fired = run(levels)
    assert len(fired) == 1
    _, fired = run(levels, max_surges=2)
    assert len(fired) == 2 and fired[1] > fired[0] + 30


def test_decision_uses_only_past_data():
    levels = noisy([1000.0] * 80 + [3000.0] * 40, seed=3)
    det_full, fired_full = run(levels)
    # Replaying a prefix ending at the firing step fires at the same step.
    _, fired_prefix = run(levels[: fired_full[0]])
    assert fired_prefix == fired_full


def test_sparse_steps_use_step_numbers():
    # Steps 4, 16, 36, ... as in the sparse public traces: windows are in steps, not rows.
    steps = [12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52]
    values = [1000, 1050, 980, 1020, 1010, 1900, 2900, 3500, 3600, 3700, 3650]
    det = SurgeDetector()
    fired = [s for s, v in zip(steps, values) if det.update(s, v)]
    assert fired and fired[0] <= 44


def test_state_dict_round_trip_continues_identically():
    levels = noisy([1000.0] * 70 + [1000.0 + 60 * i for i in range(40)] + [3400.0] * 30, seed=7)
    ref, fired_ref = run(levels)
    a = SurgeDetector()
    fired = []
    for s, v in enumerate(levels[:75], start=1):
        if a.update(s, v):
            fired.append(s)
    b = SurgeDetector()
    b.load_state_dict(a.state_dict())
    for s, v in enumerate(levels[75:], start=76):
        if b.update(s, v):
            fired.append(s)
    assert fired == fired_ref
    assert b.state_dict() == ref.state_dict()


@pytest.mark.parametrize("kwargs", [dict(ratio_threshold=1.0), dict(horizon=0), dict(patience=0),
                                    dict(fast_window=2.5), dict(skip_first_steps=-1), dict(max_surges=True)])
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SurgeDetector(**kwargs)


def test_reports_baseline_and_ratio():
    det, _ = run([100.0] * 50)
    assert det.baseline == pytest.approx(100.0) and det.ratio == pytest.approx(1.0)
    assert math.isnan(SurgeDetector().baseline)
