"""The surge detector on synthetic length series (pure Python)."""

import logging
import math
import random
import statistics

import pytest

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.ratio import RatioDetector


def run(values, start=1, **kwargs):
    det = RatioDetector(kwargs)
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
    det = RatioDetector({"skip_first_steps": 0, "horizon": 3, "baseline_window": 2, "fast_window": 1, "patience": 1})
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
    det = RatioDetector()
    fired = [s for s, v in zip(steps, values) if det.update(s, v)]
    assert fired and fired[0] <= 44


def test_state_dict_round_trip_continues_identically():
    levels = noisy([1000.0] * 70 + [1000.0 + 60 * i for i in range(40)] + [3400.0] * 30, seed=7)
    ref, fired_ref = run(levels)
    a = RatioDetector()
    fired = []
    for s, v in enumerate(levels[:75], start=1):
        if a.update(s, v):
            fired.append(s)
    b = RatioDetector()
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
        RatioDetector(kwargs)


def test_reports_baseline_and_ratio():
    det, _ = run([100.0] * 50)
    assert det.baseline == pytest.approx(100.0) and det.ratio == pytest.approx(1.0)
    assert math.isnan(RatioDetector().baseline)


# -- detector: cusum (verl_lrstab.cusum) ------------------------------------------------------------
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from verl_lrstab.cusum import CusumDetector  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "research"))
import phenomena  # noqa: E402

RUNS = {tr.name: tr for tr in phenomena.traces(seeds=[0])}


def feed(tr, every=1, cosignals=True, det=None, start=1, stop=None):
    """Feed a phenomena run (logged every ``every`` steps) from ``start`` to ``stop``; the firing steps."""
    det = det or CusumDetector()
    fired = []
    for i, s in enumerate(tr.steps):
        if (s - 1) % every or s < start or (stop is not None and s > stop):
            continue
        extra = dict(score=tr.score[i], kl=tr.k3[i], clip_ratio=tr.clip[i]) if cosignals else {}
        if det.update(s, tr.length[i], **extra):
            fired.append(s)
    return det, fired


def feed_form(tr, form="dense", every=1):
    """Feed a phenomena run with its score in a :func:`phenomena.sparse_score` form; the firing steps."""
    score = phenomena.sparse_score(tr.score, form, every)
    det = CusumDetector()
    return [s for i, s in enumerate(tr.steps)
            if det.update(s, tr.length[i], score=score[i], kl=tr.k3[i], clip_ratio=tr.clip[i])]


SCORE_FORMS = [("dense", 1), ("every", 4), ("every", 5), ("every", 10), ("filled", 10), ("none", 1)]


def expected_outcome(tr, fired):
    """What each class asks: a detection before the crash (A), during the rise (B), on
    the excursion or the later surge (G); no firing at all on the healthy classes."""
    if tr.expect == "no_fire":
        return fired == []
    if not fired:
        return False
    f = fired[0]
    if tr.cls == "A":
        return tr.onset <= f < tr.crash
    if tr.cls == "B":
        return tr.onset <= f <= tr.rise_end
    e0, e1 = tr.excursion
    return e0 <= f <= e1 + 10 or tr.onset <= f < tr.crash


@pytest.mark.parametrize("cls", "ABCDEFGH")
def test_cusum_decides_each_class_alike_whatever_the_score_form(cls):
    # dense, on every 4th / 5th / 10th row only, forward-filled, or absent: the same verdict
    for tr in phenomena.traces(seeds=range(3), classes=cls):
        for form, every in SCORE_FORMS:
            fired = feed_form(tr, form, every)
            assert expected_outcome(tr, fired), (tr.name, form, every, fired, tr.doc)


@pytest.mark.parametrize("cls", "CDEFH")
def test_cusum_healthy_classes_stay_quiet_in_sparse_logs(cls):
    for tr in phenomena.traces(seeds=range(3), classes=cls):
        for every in (5, 10):
            assert feed(tr, every=every)[1] == [], (tr.name, every)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_cusum_a_forward_filled_score_decides_exactly_as_the_sparse_one(name):
    tr = RUNS[name]
    assert feed_form(tr, "filled", 10) == feed_form(tr, "every", 10)
    assert feed_form(tr, "filled", 4) == feed_form(tr, "every", 4)


def test_cusum_fast_collapse_lead():
    # class A: accuracy below 0.5 12-15 steps after the onset; the bar is a median lead of
    # at least 10 steps (measured over 40 seeds by scripts/research/bench_detector.py); here 8 seeds, none late
    leads = []
    for tr in phenomena.traces(seeds=range(8), classes="A"):
        (f,) = feed(tr)[1]
        assert tr.onset <= f < tr.crash
        leads.append(tr.crash - f)
    assert sorted(leads)[len(leads) // 2] >= 9 and min(leads) >= 5, leads


def test_cusum_an_alarm_never_fires_because_the_score_went_missing():
    # A length rise with a rising score is held (learning). The old detector fired once the score
    # had been missing for 5 steps; a missing score is now held at its last observations.
    rng = random.Random(1)
    lengths = [1000.0 * (1.6 if s >= 60 else 1.0) * (1 + rng.gauss(0, 0.02)) for s in range(1, 161)]
    rising = [0.5 + (0.004 * (s - 55) if s >= 55 else 0) + rng.gauss(0, 0.005) for s in range(1, 161)]
    for gone_from in (63, 70, 90):
        det = CusumDetector()
        fired = [s for s, (v, sc) in enumerate(zip(lengths, rising), 1)
                 if det.update(s, v, score=sc if s < gone_from else math.nan, kl=1e-3)]
        assert fired == [], gone_from


def test_cusum_the_rebound_exemption_holds_with_a_score():
    # class C (the early drop and climb back): the length alarms are raised (or not, a rebound)
    # the same whether the score is dense, sparse or absent (the rebound test no longer skips
    # runs that have a score), and none of them fires
    for tr in phenomena.traces(seeds=range(4), classes="C"):
        alarms = {}
        for form, every in SCORE_FORMS:
            score = phenomena.sparse_score(tr.score, form, every)
            det = CusumDetector()
            armed, fired = set(), []
            for i, s in enumerate(tr.steps):
                if det.update(s, tr.length[i], score=score[i], kl=tr.k3[i], clip_ratio=tr.clip[i]):
                    fired.append(s)
                armed.add(det.armed_step)
            assert fired == [], (tr.name, form)
            alarms[(form, every)] = armed - {None}
        assert len(set(map(frozenset, alarms.values()))) == 1, (tr.name, alarms)


def _collapse_then_recovery(early_level, seed):
    """The shape of real-model pilot 4 (scripts/research/repro/README.md): the base model's ~45 tokens for
    12 noisy steps, a collapse to ~23-token guesses, then from step 81 a climb back to ~35 tokens
    while the mismatch KL doubles (from step 70) and the score stays low and noisy. With
    ``early_level`` 23 there is no early high (and no early noise above the collapse's)."""
    rng = random.Random(seed)
    steps = range(1, 101)
    level = [early_level if s <= 12 else 23.0 if s <= 80 else 35.0 for s in steps]
    cv = [(0.3 if early_level > 23 else 0.12) if s <= 12 else 0.12 if s <= 80 else 0.2 for s in steps]
    length = [max(5.0, lv * (1 + rng.gauss(0, c))) for lv, c in zip(level, cv)]
    kl = [(1.5e-3 if s < 70 else 3.5e-3) * (1 + rng.gauss(0, 0.15)) for s in steps]
    score = [max(0.0, 0.1 + rng.gauss(0, 0.08)) for _ in steps]
    return steps, length, kl, score


@pytest.mark.parametrize("seed", range(5))
def test_cusum_a_climb_back_after_a_length_collapse_is_a_rebound_even_on_half_evidence(seed):
    # a climb back below an earlier high is a rebound whatever the mismatch KL does: a real-model pilot
    # returning from 23 to 30 tokens, below the 45 it started at, with k3 doubling, was recovering
    steps, length, kl, score = _collapse_then_recovery(45.0, seed)
    det = CusumDetector()
    assert [s for s, v, k, sc in zip(steps, length, kl, score) if det.update(s, v, score=sc, kl=k)] == []
    # the control: the same climb to a level the run never had (it started at 23) is a surge
    steps, length, kl, score = _collapse_then_recovery(23.0, seed)
    det = CusumDetector()
    fired = [s for s, v, k, sc in zip(steps, length, kl, score) if det.update(s, v, score=sc, kl=k)]
    assert len(fired) == 1 and 81 <= fired[0] <= 100, fired  # during the climb


def test_cusum_score_decides_between_learning_and_collapse():
    # The same length rise (1000 -> 1600 from step 60, 2 % noise): with a rising score it is held,
    # with a falling score it fires, with a flat score it waits, with no score it fires at once.
    rng = random.Random(1)
    lengths = [1000.0 * (1.6 if s >= 60 else 1.0) * (1 + rng.gauss(0, 0.02)) for s in range(1, 121)]
    noise = [rng.gauss(0, 0.005) for _ in lengths]

    def fired(score):
        det = CusumDetector()
        return [s for s, (v, sc, e) in enumerate(zip(lengths, score, noise), 1) if det.update(s, v, score=sc + e)]

    rising = [0.5 + (0.004 * (s - 55) if s >= 55 else 0) for s in range(1, 121)]
    falling = [0.8 - (0.006 * (s - 58) if s >= 58 else 0) for s in range(1, 121)]
    flat = [0.6] * 120
    assert fired(rising) == []
    assert fired(falling) == [63]
    assert fired(flat) == []
    det = CusumDetector()
    assert [s for s, v in enumerate(lengths, 1) if det.update(s, v)] == [62]


def test_cusum_mismatch_kl_confirms_a_flat_score():
    rng = random.Random(2)
    lengths = [1000.0 * (1.6 if s >= 60 else 1.0) * (1 + rng.gauss(0, 0.02)) for s in range(1, 121)]
    score = [0.6 + rng.gauss(0, 0.01) for _ in lengths]
    # k3 (15 % noise a batch) tripled 20 steps before the length: risen against its level before the
    # baseline window once the 5-step level is up (step 62: three of the last five steps at 1.6x)
    kl_up = [1e-3 * (3.0 if s >= 40 else 1.0) * math.exp(rng.gauss(0, 0.15)) for s in range(1, 121)]
    det = CusumDetector()
    assert [s for s in range(1, 121) if det.update(s, lengths[s - 1], score=score[s - 1], kl=kl_up[s - 1])] == [62]
    assert det.fired_by == ["witnesses"]
    flat = [1e-3 * math.exp(rng.gauss(0, 0.15)) for _ in lengths]
    det = CusumDetector()
    assert [s for s in range(1, 121) if det.update(s, lengths[s - 1], score=score[s - 1], kl=flat[s - 1])] == []


def test_cusum_two_adjacent_long_batches_are_not_a_surge():
    levels = [1000.0] * 300
    for s in (120, 121, 200):
        levels[s] = 3000.0
    _, fired = feed_values(levels)
    assert fired == []


def feed_values(values, det=None, **kw):
    det = det or CusumDetector(kw)
    return det, [s for s, v in enumerate(values, 1) if det.update(s, v)]


def test_cusum_nan_and_empty_steps_never_crash_or_fire(caplog):
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    det = CusumDetector()
    bad = [math.nan, None, 0.0, -1.0, math.inf, "x"]
    for s in range(1, 301):
        value = bad[s % len(bad)] if s % 2 else 1000.0
        score = math.nan if s % 3 else 0.5
        assert det.update(s, value, score=score, kl=None, clip_ratio=math.inf) is False
    assert det.num_skipped == 150 and "skips it" in caplog.text and det.surge_step is None
    # Valid steps after the gap: state intact, a real surge is still caught, on the first step with a
    # baseline (rows after skip_first_steps covering half the span, lag steps back)
    c = LengthSurgeConfig()
    _, fired = feed_values([1000.0] * 30 + [2500.0] * 20, det=CusumDetector())
    assert fired == [c.skip_first_steps + c.cusum_span // 2 + c.cusum_lag + 1]


def test_cusum_nan_steps_inside_a_surge_do_not_hide_it():
    tr = RUNS["A_s0"]
    (dense,) = feed(tr)[1]
    det = CusumDetector()
    fired = []
    for i, s in enumerate(tr.steps):
        value = math.nan if s % 4 == 0 else tr.length[i]  # every 4th batch lost
        if det.update(s, value, score=tr.score[i], kl=tr.k3[i], clip_ratio=tr.clip[i]):
            fired.append(s)
    assert len(fired) == 1 and tr.onset <= fired[0] < tr.crash and fired[0] - dense <= 3


@pytest.mark.parametrize("name,split", [("A_s0", 131), ("G_s0", 110), ("C_s0", 38)])
def test_cusum_resume_mid_surge_continues_identically(name, split):
    tr = RUNS[name]
    ref, fired_ref = feed(tr, cosignals=True)
    det, first = feed(tr, stop=split)
    # mid-surge: the rise is accumulating (A) or its alarm waits for a co-signal (G, C); nothing fired yet
    assert first == [] and det.cusum > 0
    state = json.loads(json.dumps(det.state_dict()))  # plain types only
    fresh = CusumDetector()
    fresh.load_state_dict(state)
    resumed, rest = feed(tr, det=fresh, start=split + 1)
    assert first + rest == fired_ref
    assert json.dumps(resumed.state_dict()) == json.dumps(ref.state_dict())


def test_cusum_armed_state_survives_resume():
    # a length rise held by a rising score: armed, waiting; the state restores it exactly
    rng = random.Random(1)
    det = CusumDetector()
    for s in range(1, 71):
        det.update(s, 1000.0 * (1.6 if s >= 60 else 1.0) * (1 + rng.gauss(0, 0.02)),
                   score=0.5 + (0.004 * (s - 55) if s >= 55 else 0))
    assert det.armed_step is not None and det.surge_step is None
    fresh = CusumDetector()
    fresh.load_state_dict(det.state_dict())
    assert fresh.armed_step == det.armed_step and fresh.cusum == det.cusum


@pytest.mark.parametrize("kwargs,key", [
    (dict(cusum_span=0), "cusum_span"), (dict(cusum_lag=-1), "cusum_lag"), (dict(cusum_drift=0), "cusum_drift"),
    (dict(cusum_threshold=-1), "cusum_threshold"), (dict(cusum_min_rise=1.0), "cusum_min_rise"),
    (dict(cusum_noise_floor=0), "cusum_noise_floor"), (dict(cusum_rebound_margin=0.9), "cusum_rebound_margin"),
    (dict(cusum_rebound_memory=0), "cusum_rebound_memory"), (dict(cusum_confirm_steps=2.5), "cusum_confirm_steps"),
    (dict(cusum_score_z=math.nan), "cusum_score_z"), (dict(cusum_kl_rise=1), "cusum_kl_rise"),
    (dict(cusum_clip_rise=0), "cusum_clip_rise"), (dict(cusum_runaway_rise=1.0), "cusum_runaway_rise"),
    (dict(max_surges=0), "max_surges"), (dict(skip_first_steps=True), "skip_first_steps"),
    (dict(detector="ratio"), "detector"), (dict(horizon=20), "horizon"),
])
def test_cusum_invalid_options_name_the_full_key(kwargs, key):
    # the config's own check, the same a YAML node gets (the detector has none of its own)
    with pytest.raises(ValueError, match=rf"actor_rollout_ref\.actor\.optim\.length_surge\.{key}=.* is invalid"):
        CusumDetector(kwargs)


def test_cusum_max_surges_measures_the_next_surge_from_the_new_level():
    rng = random.Random(0)
    values = [level * (1 + rng.gauss(0, 0.03)) for level, n in ((1000, 60), (2000, 80), (5000, 60)) for _ in range(n)]
    assert feed_values(values)[1] == [63]
    det, fired = feed_values(values, max_surges=2)
    assert fired == [63, 143]  # once per jump: not again while the baseline catches up with 2000
    # still reported after the last surge: the median of the log lengths of the span that ends lag steps back
    # (all at 5000)
    c = LengthSurgeConfig()
    last = len(values) - c.cusum_lag
    span = [math.log(v) for v in values[last - c.cusum_span:last]]
    assert det.baseline == pytest.approx(math.exp(statistics.median(span)), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_cusum_long_run_after_an_early_rebound_stays_quiet(seed):
    # A healthy early rebound (class C) followed by 2700 steps at its new level with a flat, noisy
    # score: an alarm that no co-signal confirms within cusum_confirm_steps is dropped, so the
    # permanently higher length is not tested against the score's noise step after step.
    (tr,) = phenomena.traces(seeds=[seed], classes="C")
    rng = random.Random(seed)
    level, acc = sorted(tr.length[-50:])[25], sorted(tr.score[-50:])[25]
    lengths = list(tr.length) + [level * (1 + rng.gauss(0, 0.08)) for _ in range(2700)]
    score = list(tr.score) + [acc + rng.gauss(0, 0.02) for _ in range(2700)]
    det = CusumDetector()
    fired = [s for s, (v, sc) in enumerate(zip(lengths, score), 1)
             if det.update(s, v, score=sc, kl=5e-4 * (1 + rng.gauss(0, 0.15)))]
    assert fired == []


@pytest.mark.parametrize("cls", "ABCDEGH")
def test_cusum_without_mismatch_kl(cls):
    # Most verl logs have the score and the clip ratio but no mismatch figures. B's accuracy only
    # sags (0.88 -> 0.82) during a slow rise: the fall is measured against the score 20-60 steps back too.
    for tr in phenomena.traces(seeds=range(2), classes=cls):
        det = CusumDetector()
        fired = [s for i, s in enumerate(tr.steps) if det.update(s, tr.length[i], score=tr.score[i], clip_ratio=tr.clip[i])]
        assert expected_outcome(tr, fired), (tr.name, fired)


def _paper_like(seed: int, rise_steps: int):
    """The paper's runs (docs/method.md): ~1000 tokens with 8 % noise and slow drift, then 3.5x from step 101 over
    ``rise_steps`` steps, while the score keeps RISING (accuracy improving through the surge)."""
    rng = random.Random(seed)
    lengths, score = [], []
    for t in range(1, 301):
        base = 1000 * (1 + 0.001 * t) * (1 + 2.5 * min(1.0, max(0, t - 100) / rise_steps))
        lengths.append(base * (1 + rng.gauss(0, 0.08)))
        score.append(0.3 + 0.25 * t / 300 + 0.1 * min(1.0, max(0, t - 100) / 30) + rng.gauss(0, 0.02))
    return lengths, score


@pytest.mark.parametrize("seed,rise_steps,expected", [(0, 10, [109]), (1, 30, [118]), (2, 30, [120])])
def test_cusum_runaway_fires_on_the_papers_surge_even_with_a_rising_score(seed, rise_steps, expected):
    # Without the runaway rule the rising score holds the alarm and nothing ever fires (the
    # paper's own runs would never decay); values computed once with the defaults.
    lengths, score = _paper_like(seed, rise_steps)
    det = CusumDetector()
    assert [s for s, (v, sc) in enumerate(zip(lengths, score), 1) if det.update(s, v, score=sc)] == expected
    held = CusumDetector({"cusum_runaway_rise": 100.0})
    assert [s for s, (v, sc) in enumerate(zip(lengths, score), 1) if held.update(s, v, score=sc)] == []
