"""Every documented option of ``detector: cusum`` pinned by its behaviour (pure Python).

Each test builds a series on each side of the option's default and checks that the default
detector fires on one and not on the other: a default changed by about 40 % either way (a
threshold scaled by 0.6 or 1.4, a window of 18 instead of 30 steps, a factor's excess over 1
scaled so) flips one of them. The series are deterministic: a length at 1000 tokens with an
alternating +-a % (``a`` = 0: noiseless; its noise is then ``noise_floor``), a score at 0.6 +- 0.01.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.cusum import CusumDetector

logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
N = 200
AT = 60  # the step a built rise starts at


def alt(s: int, a: float) -> float:
    return math.exp(a if s % 2 else -a)


HOLD = ...  # a pattern ending in HOLD holds its last factor to the end


def length(pattern=(), at=AT, a=0.0, early=None, n=N):
    """1000 tokens (x exp(+-a), alternating), ``pattern`` factors from step ``at`` on, ``early`` =
    (factor, last step): an early high."""
    hold = bool(pattern) and pattern[-1] is HOLD
    pat = pattern[:-1] if hold else pattern
    out = []
    for s in range(1, n + 1):
        k, f = s - at, 1.0
        if 0 <= k < len(pat):
            f = pat[k]
        elif hold and k >= len(pat):
            f = pat[-1]
        if early and s <= early[1]:
            f = early[0]
        out.append(1000.0 * f * alt(s, a))
    return out


def held(factor):
    return (factor, HOLD)


def flat_score(n=N):
    return [0.6 + (0.01 if s % 2 else -0.01) for s in range(1, n + 1)]


def fires(lengths, score=None, kl=None, clip=None, **options):
    det = CusumDetector(options)
    out = []
    for i, v in enumerate(lengths):
        feeds = {k: col[i] for k, col in (("score", score), ("kl", kl), ("clip_ratio", clip)) if col is not None}
        if det.update(i + 1, v, **feeds):
            out.append(i + 1)
    return out


def test_the_options_pinned_here_are_every_documented_cusum_option():
    # a new option of LengthSurgeConfig read by cusum needs its test here
    pinned = {"skip_first_steps", "max_surges", "cusum_span", "cusum_lag", "cusum_drift", "cusum_threshold",
              "cusum_min_rise", "cusum_noise_floor", "cusum_rebound_margin", "cusum_rebound_memory",
              "cusum_confirm_steps", "cusum_score_z", "cusum_kl_rise", "cusum_clip_rise", "cusum_runaway_rise",
              "cusum_spike_rise"}
    read = {f.name for f in dataclasses.fields(LengthSurgeConfig) if f.name.startswith("cusum_")}
    assert read | {"skip_first_steps", "max_surges"} == pinned
    # each read under its own name: one name for one thing
    options = LengthSurgeConfig(**{name: LengthSurgeConfig().__dict__[name] * 2 for name in read})
    det = CusumDetector(options)
    assert all(getattr(det, name) == getattr(options, name) for name in pinned)


# -- the length alarm ---------------------------------------------------------------------------
def test_threshold_and_drift_a_rise_must_last_long_enough():
    # noise scale 0.1 (+-6.74 %: 1.4826 x MAD); a pulse at 1.3x adds z - drift = 2.62 - 1 = 1.62 a row:
    # 3 rows sum to 4.9 (< 5: no alarm), 4 rows to 6.5 (alarm, and with no co-signal the surge)
    pulse3 = [v if not AT <= s < AT + 3 else 1300.0 for s, v in enumerate(length(a=0.0674), 1)]
    pulse4 = [v if not AT <= s < AT + 4 else 1300.0 for s, v in enumerate(length(a=0.0674), 1)]
    assert fires(pulse3) == []
    assert fires(pulse4) == [AT + 3]


def test_min_rise_the_level_must_reach_1_2x_the_baseline():
    # a noiseless run: every row of a step up is 3.6+ noise units, the CUSUM crosses at once; only
    # the level decides
    assert fires(length(held(1.18))) == []
    assert fires(length(held(1.23))) == [AT + 2]


def test_noise_floor_a_noiseless_run_is_measured_in_5_percent_units():
    # 3 rows at 1.202x: z = ln(1.202) / 0.05 = 3.68 a row, 3 x 2.68 = 8.0 >= 5. With a 7 % floor
    # z would be 2.63 and 3 rows 4.9: held. (A lower floor changes no decision of the length alone:
    # at the 1.2x the level needs, a row is already 3.6 units at 5 %, and the CUSUM crosses before
    # the 5-step level does.)
    assert fires(length((1.202, 1.202, 1.202))) == [AT + 2]


def test_skip_first_steps_and_span_a_baseline_needs_fifteen_steps_after_the_warm_up():
    # a baseline needs rows after skip_first_steps (10) covering half the span (30 -> 15 steps), ending lag
    # (10) steps back: steps 11-26 at step 36. A run that grows at step 16 has its rise in most of them: never
    # a surge
    assert fires(length(held(1.5), at=16)) == []
    # a rise at step 20: at step 36 the baseline (steps 11-26) holds 7 of its 16 rows, the median is the
    # run's level: a surge on the first step with a baseline. With 14 skipped steps, or a 42-step span, the
    # baseline waits for step 40 or 42 and holds more rows of the rise than before it: no surge
    assert fires(length(held(1.5), at=20)) == [36]
    assert fires(length(held(1.5), at=20), skip_first_steps=14) == []
    assert fires(length(held(1.5), at=20), cusum_span=42) == []
    assert fires(length(held(1.5), at=40)) == [42]


def test_lag_a_slow_ramp_stays_out_of_its_own_baseline():
    # noise scale 0.1; a ramp to 1.25x over 12 steps, then held. The baseline ends 10 steps back, so the
    # ramp's rows stay out of it until its level is at 1.2x (step 73); a baseline ending 6 steps back has
    # taken in the ramp's first rows and waits 2 steps more, one ending 3 back 6 steps more
    ramp = length(tuple(1 + 0.25 * min(k, 12) / 12 for k in range(13)) + (HOLD,), a=0.0674)
    assert fires(ramp) == [73]
    assert fires(ramp, cusum_lag=6) == [75]
    assert fires(ramp, cusum_lag=3) == [79]


# -- the rebound test ----------------------------------------------------------------------------
def test_rebound_margin_a_return_below_1_3x_the_earlier_high_is_no_surge():
    # an early high of 1.6x until step 30, 1000 tokens after it; from step 80 a return to R x the
    # plateau. Below 1.3 x 1.6 = 2.08 it is a rebound (no alarm on its first steps); above, a surge
    def first_steps(r):
        fired = fires(length(held(r), at=80, a=0.01, early=(1.6, 30)))
        return bool(fired) and fired[0] <= 80 + 5
    assert not first_steps(2.0)
    assert first_steps(2.2)


def test_rebound_memory_the_earlier_high_is_remembered_for_100_steps():
    # the early high (1.6x until step 30: its last 5-row median at step 34) and a return to 1.9x
    # (a rebound while remembered): 66 steps later it is remembered, 101 steps later not
    def first_steps(at):
        fired = fires(length(held(1.9), at=at, a=0.01, early=(1.6, 30)))
        return bool(fired) and fired[0] <= at + 5
    assert not first_steps(100)
    assert first_steps(135)


# -- the co-signals -------------------------------------------------------------------------------
STEP = length(held(1.6), a=0.01)  # the length alarm at AT + 2, the score flat: held


def test_an_alarm_is_confirmed_only_while_the_length_is_above_its_baseline():
    # a score fall 5 steps into a held 1.6x rise fires once 3 of the last 5 scores have fallen; one 25
    # steps in does not: the trailing baseline (30 steps ending 10 back) has caught up with the new level
    def fall_at(d):
        return [v - (0.1 if s >= AT + d else 0.0) for s, v in enumerate(flat_score(), 1)]
    assert fires(STEP, flat_score()) == []
    assert fires(STEP, fall_at(5)) == [AT + 7]
    assert fires(STEP, fall_at(25)) == []


def test_score_z_a_score_fall_confirms_beyond_3_5_noise_units():
    # score noise: +-0.01 alternating, a unit of a 5-step median 1.2533 x 1.2533 x 0.01 x sqrt(1/5 + 1/21)
    # = 0.0078, 3.5 of them 0.027: a fall of 0.005 stays within them against either reference (0.59 or
    # 0.61), one of 0.04 passes once 3 of the last 5 scores have fallen
    def fall(delta):
        return [v - (delta if s >= AT + 2 else 0.0) for s, v in enumerate(flat_score(), 1)]
    assert fires(STEP, fall(0.005)) == []
    assert fires(STEP, fall(0.04)) == [AT + 4]


def test_kl_rise_a_mismatch_kl_grown_1_5x_confirms_and_2_25x_against_its_older_level():
    # k3 steps up with the length: against the baseline window, kl_rise x confirms
    def kl(f, at):
        return [1e-3 * (f if s >= at else 1.0) * alt(s, 0.02) for s in range(1, N + 1)]
    assert fires(STEP, flat_score(), kl(1.4, AT)) == []
    assert fires(STEP, flat_score(), kl(1.6, AT))[:1] == [AT + 2]
    # k3 steps up at step 20, before the length and before its baseline window (steps 23-52 at step 62):
    # only its level before that window (after the skipped steps) is lower, and there it must have grown
    # kl_rise x twice over (2.25x)
    assert fires(STEP, flat_score(), kl(2.0, 20)) == []
    assert fires(STEP, flat_score(), kl(2.5, 20)) == [AT + 2]


def test_clip_rise_a_share_at_the_cap_up_by_0_25_confirms():
    def clip(delta):  # +-0.005 a step (a share logged as measured, not a constant)
        return [0.02 + (delta if s >= AT else 0.0) + (0.005 if s % 2 else -0.005) for s in range(1, N + 1)]
    assert fires(STEP, flat_score(), clip=clip(0.2)) == []
    assert fires(STEP, flat_score(), clip=clip(0.3)) == [AT + 2]


def test_runaway_rise_a_held_alarm_fires_at_2_5x():
    # the score flat (held), no KL: only the runaway fires
    assert fires(length(held(2.4), a=0.01), flat_score()) == []
    assert fires(length(held(2.6), a=0.01), flat_score()) == [AT + 2]


# -- one-step spikes -------------------------------------------------------------------------------
def test_spike_rise_single_long_batches_that_revert_are_not_the_level():
    # rows at 1.25x the steps around them, every other step: each is back the next step, none is the level
    spikes = length((1.25, 1.0) * 4)
    assert fires(spikes) == []
    # a rise whose rows zigzag by 13 % (1.3x / 1.15x) is a rise: its high rows are no one-step spikes
    assert fires(length((1.3, 1.15) * 10)) == [AT + 4]


def test_a_same_step_score_dip_on_a_one_step_spike_never_confirms():
    # a learning run (score 0.8 +- 0.01) whose level drifts up 1.2x over steps 40-70; at step 70 one batch
    # is +45 % long and scores 0.2 lower, the next step both are back. The control: the same batch
    # and score, but the length stays up and the score stays down: a surge
    drift = [1000.0 * 1.2 ** min(max(s - 40, 0) / 30, 1) * alt(s, 0.02) for s in range(1, N + 1)]
    score = [0.8 + (0.01 if s % 2 else -0.01) for s in range(1, N + 1)]
    spike_len = [v * (1.45 if s == 70 else 1.0) for s, v in enumerate(drift, 1)]
    spike_score = [v - (0.2 if s == 70 else 0.0) for s, v in enumerate(score, 1)]
    assert fires(spike_len, spike_score) == []
    held_len = [v * (1.45 if s >= 70 else 1.0) for s, v in enumerate(drift, 1)]
    held_score = [v - (0.2 if s >= 70 else 0.0) for s, v in enumerate(score, 1)]
    fired = fires(held_len, held_score)
    assert fired and 71 <= fired[0] <= 74, fired


def fires_rows(steps, lengths, score=None, kl=None, co=None, **options):
    """:func:`fires` for a log with rows at ``steps`` only; ``co``: verl's co-signals ``{name: column}``."""
    det = CusumDetector(options)
    out = []
    for i, (s, v) in enumerate(zip(steps, lengths)):
        feeds = {k: col[i] for k, col in (("score", score), ("kl", kl)) if col is not None}
        if det.update(s, v, **feeds, **{k: col[i] for k, col in (co or {}).items()}):
            out.append(s)
    return out


EVERY5 = list(range(1, N + 1, 5))  # a log written every 5 steps
RISE_ROW = 101


def test_max_surges_reports_one_surge_unless_asked_for_more():
    two = length((2.0,) * 60 + (5.0, HOLD), a=0.01)
    assert fires(two) == [AT + 2]
    assert fires(two, max_surges=2) == [AT + 2, AT + 62]


@pytest.mark.parametrize("key", ["cusum_spike_rise"])
def test_the_new_options_are_validated_by_name(key):
    with pytest.raises(ValueError, match=key):
        LengthSurgeConfig(**{key: 1.0})
    with pytest.raises(ValueError, match=key):
        LengthSurgeConfig(**{key: float("nan")})
    assert CusumDetector(LengthSurgeConfig(**{key: 1.3})).cusum_spike_rise == 1.3


def test_a_mismatch_metric_nothing_reads_is_refused():
    # the ratio detector reads the length alone; with trigger: length no mismatch figure is read at all
    with pytest.raises(ValueError, match=r"mismatch_metric='max_abs_diff' is invalid.*trigger: mismatch or either "
                                         r"or detector: cusum"):
        LengthSurgeConfig.from_dict({"detector": "ratio", "mismatch_metric": "max_abs_diff"})
    for reads in ({"detector": "cusum"}, {"detector": "ratio", "trigger": "either"}):
        LengthSurgeConfig.from_dict({**reads, "mismatch_metric": "max_abs_diff"})
