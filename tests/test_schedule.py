"""The decay rule, the schedule's state and replay (pure Python)."""

import math

import pytest

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.decay import decay_period_from_surge, decay_scale, num_decays, warmup_scale
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures
from verl_lrstab.log_replay import replay


def test_paper_example_origin_start():
    # arXiv 2602.01826: surge at 110 -> P = 198; LR 1e-6 until 197, 5e-7 from 198,
    # 2.5e-7 from 396. The write-ups say "1e-7 (the floor) from 594", but their own formula
    # max(0.1, 0.5 ** (t // P)) gives 0.125 there and reaches the floor at 4 P = 792 (docs/configuration.md).
    period = decay_period_from_surge(110, 1.8)
    assert period == 198
    scale = {u: decay_scale(u, period, 0.5, 0.1) for u in (1, 110, 197, 198, 395, 396, 593, 594, 791, 792, 2000)}
    assert scale == {1: 1.0, 110: 1.0, 197: 1.0, 198: 0.5, 395: 0.5, 396: 0.25, 593: 0.25, 594: 0.125,
                     791: 0.125, 792: 0.1, 2000: 0.1}


def test_origin_surge_decays_right_after_the_surge():
    assert [num_decays(u, 20, "surge", surge_step=50) for u in (50, 51, 70, 71, 90, 91)] == [0, 1, 1, 2, 2, 3]


def test_no_period_no_decay():
    assert decay_scale(10_000, None) == 1.0


def test_period_rounds_half_up_and_is_at_least_one():
    assert decay_period_from_surge(5, 1.5) == 8  # 7.5 -> 8 (Python's round() would give 8 too, 6.5 -> 6)
    assert decay_period_from_surge(5, 1.3) == 7  # 6.5 -> 7
    assert decay_period_from_surge(1, 0.1) == 1


def test_warmup_matches_verl_constant_schedule():
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    verl_sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=4)
    for k in range(8):
        assert warmup_scale(k, 4) == pytest.approx(verl_sched.lr_lambdas[0](k))


def surge_series(onset=100, before=1000.0, after=3500.0, n=700):
    return [before] * onset + [after] * (n - onset)


def test_replay_reports_surge_period_and_scale_in_force_paper_form():
    res = replay(range(1, 701), surge_series(), {"origin": "start"})
    assert res.surge_step is not None and 100 < res.surge_step < 110
    assert res.decay_period == decay_period_from_surge(res.surge_step, 1.8)
    p = res.decay_period
    by_step = dict(zip(res.steps, res.lr_scale))
    assert by_step[p - 1] == 1.0 and by_step[p] == 0.5 and by_step[2 * p] == 0.25
    assert by_step[3 * p - 1] == 0.25 and by_step[3 * p] == 0.125 and by_step[700] == 0.125


def test_the_default_halves_right_after_the_detection_then_every_period():
    """Issue 37: left unset, the first cut is in force at the detection step + 1 (not at P = 1.8 x t_surge)."""
    res = replay(range(1, 301), surge_series(n=300))
    by_step = dict(zip(res.steps, res.lr_scale))
    t, p = res.surge_step, res.decay_period
    assert t is not None and 100 < t < 110 and p == decay_period_from_surge(t, 1.8)
    assert all(by_step[s] == 1.0 for s in range(1, t + 1))
    assert by_step[t + 1] == 0.5  # the first cut: before a crash at ~1.1 x t_surge
    assert by_step[t + p] == 0.5 and by_step[t + p + 1] == 0.25
    # the paper's form on the same series: nothing until P, long after t + 1
    paper = dict(zip(res.steps, replay(range(1, 301), surge_series(n=300), {"origin": "start"}).lr_scale))
    assert paper[t + 1] == 1.0 and paper[p - 1] == 1.0 and paper[p] == 0.5


def test_replay_origin_surge():
    res = replay(range(1, 301), surge_series(n=300), {"origin": "surge"})
    by_step = dict(zip(res.steps, res.lr_scale))
    t = res.surge_step
    assert by_step[t] == 1.0 and by_step[t + 1] == 0.5
    assert by_step[t + res.decay_period] == 0.5 and by_step[t + res.decay_period + 1] == 0.25


def test_fixed_decay_period_decays_from_start_detector_only_reports():
    res = replay(range(1, 301), surge_series(n=300), {"decay_period": 100, "origin": "surge"})
    by_step = dict(zip(res.steps, res.lr_scale))
    assert res.decay_period == 100 and res.surge_step is not None  # reported, not used
    assert by_step[99] == 1.0 and by_step[100] == 0.5 and by_step[200] == 0.25 and by_step[300] == 0.125


def test_replay_with_nan_and_empty_steps_never_crashes_or_fires():
    values = [1000.0, math.nan, None, 0.0, float("inf")] * 60
    res = replay(range(1, 301), values)
    assert res.surge_step is None and set(res.lr_scale) == {1.0}


def test_schedule_state_round_trip():
    values = surge_series(n=400)
    a = LengthSurgeSchedule()
    for u in range(1, 105):
        a.observe(u, UpdateFigures(values[u - 1]))
    b = LengthSurgeSchedule()
    b.load_state_dict(a.state_dict())
    for u in range(105, 401):
        a.observe(u, UpdateFigures(values[u - 1]))
        b.observe(u, UpdateFigures(values[u - 1]))
        assert a.scale(u) == b.scale(u)
    assert a.state_dict() == b.state_dict() and a.trigger_step is not None


def test_metrics_keys_and_no_invented_values():
    s = LengthSurgeSchedule()
    s.observe(1, UpdateFigures(math.nan))
    m = s.metrics(1)
    assert m["lrstab/surge_step"] == -1 and m["lrstab/decay_period"] == -1 and m["lrstab/lr_scale"] == 1.0
    assert "lrstab/response_length" not in m and "lrstab/baseline" not in m  # nothing measured, nothing logged
    s.observe(2, UpdateFigures(123.0))
    assert s.metrics(2)["lrstab/response_length"] == 123.0


@pytest.mark.parametrize(
    "options,key",
    [
        ({"period_factor": 0}, "period_factor"),
        ({"period_factor": -1.8}, "period_factor"),
        ({"gamma": 1.0}, "gamma"),
        ({"gamma": 0}, "gamma"),
        ({"min_lr_ratio": 0}, "min_lr_ratio"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"decay_period": 0}, "decay_period"),
        ({"decay_period": 2.5}, "decay_period"),
        ({"origin": "middle"}, "origin"),
        ({"trigger": "loss"}, "trigger"),
        ({"ratio_threshold": 0.9}, "ratio_threshold"),
        ({"patience": 0}, "patience"),
        ({"horizon": "30"}, "horizon"),
        ({"perod_factor": 1.8}, "perod_factor"),
        ({"monitor_only": "yes"}, "monitor_only"),
        ({"mismatch_metric": "k1"}, "mismatch_metric"),
        ({"detector": "zscore"}, "detector"),
        ({"detector": None}, "detector"),
        ({"cusum_span": 0}, "cusum_span"),
        ({"cusum_lag": -1}, "cusum_lag"),
        ({"cusum_lag": 1.5}, "cusum_lag"),
        ({"cusum_drift": 0}, "cusum_drift"),
        ({"cusum_threshold": "5"}, "cusum_threshold"),
        ({"cusum_min_rise": 1.0}, "cusum_min_rise"),
        ({"cusum_noise_floor": -0.05}, "cusum_noise_floor"),
        ({"cusum_rebound_margin": 0.5}, "cusum_rebound_margin"),
        ({"cusum_rebound_memory": 0}, "cusum_rebound_memory"),
        ({"cusum_confirm_steps": True}, "cusum_confirm_steps"),
        ({"cusum_score_z": float("nan")}, "cusum_score_z"),
        ({"cusum_kl_rise": float("inf")}, "cusum_kl_rise"),
        ({"cusum_clip_rise": 0}, "cusum_clip_rise"),
        # an option the chosen detector never reads is refused, not ignored
        ({"horizon": 8}, "horizon"),
        ({"fast_window": 3}, "fast_window"),
        ({"baseline_window": 3}, "baseline_window"),
        ({"ratio_threshold": 2.0}, "ratio_threshold"),
        ({"detector": "ratio", "cusum_span": 10}, "cusum_span"),
        # the mismatch trigger's options with trigger: length (the default), and patience with cusum + length
        ({"mismatch_budget": 1e-3}, "mismatch_budget"),
        ({"mismatch_budget_factor": 2.0}, "mismatch_budget_factor"),
        ({"mismatch_calibration_steps": 5}, "mismatch_calibration_steps"),
        ({"patience": 5}, "patience"),
    ],
)
def test_bad_options_name_the_key_and_allowed_values(options, key):
    with pytest.raises(ValueError, match=rf"length_surge\.{key}.*allowed"):
        LengthSurgeConfig.from_dict(options)


def test_monitor_only_reports_the_surge_but_never_decays():
    res = replay(range(1, 401), surge_series(n=400), {"monitor_only": True})
    assert res.surge_step is not None and res.decay_period is None
    assert set(res.lr_scale) == {1.0}
    sched = LengthSurgeSchedule({"monitor_only": True})
    for u, v in enumerate(surge_series(n=400), start=1):
        sched.observe(u, UpdateFigures(v))
    m = sched.metrics(400)
    assert m["lrstab/surge_step"] == res.surge_step and m["lrstab/decay_period"] == -1 and m["lrstab/lr_scale"] == 1.0


def test_mismatch_trigger_starts_the_decay_only_when_asked():
    lengths = [1000.0] * 100
    kl = [1e-4] * 30 + [1e-2] * 70
    fired = replay(range(1, 101), lengths, {"trigger": "mismatch", "mismatch_budget": 1e-3}, mismatch_kl=kl)
    assert fired.surge_step is None and fired.trigger_step is not None and 30 < fired.trigger_step <= 35
    assert fired.decay_period == decay_period_from_surge(fired.trigger_step, 1.8)
    # trigger: length never reads the mismatch: its budget is refused rather than silently ignored
    with pytest.raises(ValueError, match=r"length_surge\.mismatch_budget=0\.001 is invalid: allowed values are its "
                                         r"default None with trigger='length'"):
        replay(range(1, 101), lengths, {"trigger": "length", "mismatch_budget": 1e-3}, mismatch_kl=kl)
    ignored = replay(range(1, 101), lengths, {"trigger": "length"}, mismatch_kl=kl)
    assert ignored.trigger_step is None and set(ignored.lr_scale) == {1.0}


@pytest.mark.parametrize("options", [
    {"trigger": "mismatch", "mismatch_budget": 1e-3, "patience": 5},  # read by the mismatch trigger
    {"trigger": "either", "mismatch_budget_factor": 2.0, "mismatch_calibration_steps": 5},
    {"detector": "ratio", "patience": 5},  # read by the ratio detector
])
def test_options_read_by_the_chosen_trigger_or_detector_are_accepted(options):
    config = LengthSurgeConfig.from_dict(options)
    assert {k: getattr(config, k) for k in options} == options


# -- detector choice, co-signals, resume (detector: cusum is the default) -----------------------------
def test_default_detector_is_cusum_and_ratio_replays_the_old_rule_exactly():
    import random

    from verl_lrstab.cusum import CusumDetector
    from verl_lrstab.ratio import RatioDetector

    assert LengthSurgeConfig().detector == "cusum" and isinstance(LengthSurgeSchedule().detector, CusumDetector)
    rng = random.Random(3)
    values = [1000.0 * (1 + rng.gauss(0, 0.05)) * (1 + 1.5 * min(max(s - 120, 0), 20) / 20) for s in range(1, 301)]
    options = {"detector": "ratio", "horizon": 20, "patience": 2}
    det = RatioDetector(LengthSurgeConfig(**options))
    old = [s for s, v in enumerate(values, 1) if det.update(s, v)]
    res = replay(range(1, 301), values, options)
    assert old == [res.surge_step] == [130]
    # cusum, length only, on the same run: inside the ramp (steps 121-140), no later than the ratio rule
    assert 120 < replay(range(1, 301), values).surge_step <= 130


def test_cusum_state_round_trip_mid_surge_and_metrics_are_plain_numbers():
    import json

    rng = __import__("random").Random(5)
    lengths = [1000.0 * (1.8 if u >= 80 else 1.0) * (1 + rng.gauss(0, 0.04)) for u in range(1, 301)]
    score = [0.6 + (0.004 * (u - 75) if u >= 75 else 0.0) + rng.gauss(0, 0.01) for u in range(1, 301)]
    kl = [1e-3 * (1 + 0.01 * u) for u in range(1, 301)]
    a = LengthSurgeSchedule({"origin": "surge"})
    for u in range(1, 86):
        a.observe(u, UpdateFigures(lengths[u - 1], kl[u - 1], score=score[u - 1], clip_ratio=0.01))
    # armed on the rise's first step (1.8x, far beyond the noise), held since: the score rises
    assert a.detector.armed_step == 80 and a.trigger_step is None
    m = a.metrics(85)
    assert m["lrstab/armed_step"] == 80 and m["lrstab/cusum"] > 5 and m["lrstab/ratio"] > 1.5
    assert all(type(v) in (int, float) and math.isfinite(v) for v in m.values()), m  # averageable by verl
    b = LengthSurgeSchedule({"origin": "surge"})
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for u in range(86, 301):
        sc = score[u - 1] - (0.3 if u >= 90 else 0.0)  # then the score crashes, the length still up
        fa = a.observe(u, UpdateFigures(lengths[u - 1], kl[u - 1], score=sc, clip_ratio=0.01))
        fb = b.observe(u, UpdateFigures(lengths[u - 1], kl[u - 1], score=sc, clip_ratio=0.01))
        assert fa == fb and a.scale(u) == b.scale(u) and a.metrics(u) == b.metrics(u)
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())
    # the fall (from step 90) moves the median of the last 5 scores once 3 of them have fallen: 92
    assert a.trigger_step == 92 and a.detector.fired_by == ["score"]
    assert a.metrics(300)["lrstab/fired_by/score"] == 92


def test_resuming_with_another_detector_is_refused_by_name():
    state = LengthSurgeSchedule({"detector": "ratio"}).state_dict()
    with pytest.raises(ValueError, match=r"detector 'ratio'.*length_surge\.detector='cusum'.*set detector: ratio"):
        LengthSurgeSchedule().load_state_dict(state)
    old = LengthSurgeSchedule({"detector": "ratio"}).state_dict()
    del old["detector_kind"]  # no older state format is read: refused naming the field
    with pytest.raises(ValueError, match="detector_kind=<missing>"):
        LengthSurgeSchedule({"detector": "ratio"}).load_state_dict(old)


def test_replay_feeds_the_cosignals():
    lengths = [1000.0] * 60 + [1800.0] * 60
    rising = [0.4 + (0.01 * (s - 58) if s >= 58 else 0.0) + 0.002 * (s % 3) for s in range(1, 121)]
    held = replay(range(1, 121), lengths, score=rising)
    assert held.surge_step is None and set(held.lr_scale) == {1.0}
    assert replay(range(1, 121), lengths).surge_step == 63
    with pytest.raises(ValueError, match="steps and score differ in length"):
        replay(range(1, 121), lengths, score=rising[:-1])


def test_scheduler_passes_the_handed_cosignals_once():
    # The glue hands the score and the clip ratio through observe_update before verl's bare step().
    import torch

    from verl_lrstab.scheduler import LengthSurgeLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LengthSurgeLR(opt, {"skip_first_steps": 0})
    sched.observe_update(UpdateFigures(response_length=500.0, score=0.75, clip_ratio=0.125))
    assert sched.figures_waiting
    opt.step()
    sched.step()
    m = sched.metrics()
    assert m["lrstab/score"] == 0.75 and m["lrstab/clip_ratio"] == 0.125
    assert not sched.figures_waiting
    opt.step()
    sched.step()  # not set again: unavailable, not reused
    assert "lrstab/score" not in sched.metrics() and sched.schedule.detector.rows.score == [[1, 0.75]]
