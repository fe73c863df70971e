"""Values that would break a run later are refused when given, naming the key: option bounds, Hydra-like
keys, text figures, a loaded scheduler state, an update counter that goes back, negative replay steps."""

from __future__ import annotations

import copy
import logging
import math
import re

import pytest
import torch

from verl_lrstab.cli import main
from verl_lrstab.config import MAX_DECAY_PERIOD, LengthSurgeConfig
from verl_lrstab.detectors import LengthSurgeSchedule, UpdateFigures
from verl_lrstab.scheduler import LengthSurgeLR
from verl_lrstab.scheduler_state_checks import SchedulerStateError

KEY = "actor_rollout_ref.actor.optim.length_surge"
FAST = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3, "patience": 1}


# -- options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("period_factor", 1e308), ("period_factor", 1001.0),
                                       ("decay_period", MAX_DECAY_PERIOD + 1), ("decay_period", 10**30)])
def test_a_decay_period_past_any_run_is_refused_at_config_time(key, value):
    with pytest.raises(ValueError, match=re.escape(f"{KEY}.{key}={value!r} is invalid")):
        LengthSurgeConfig.from_dict({key: value})


def test_the_largest_period_factor_cannot_overflow_at_any_surge_step():
    from verl_lrstab.decay import decay_period_from_surge

    cfg = LengthSurgeConfig.from_dict({"period_factor": 1000.0})
    assert decay_period_from_surge(10**6, cfg.period_factor) == 10**9  # an int, no OverflowError


@pytest.mark.parametrize("key", ["_gamma", "_", "__period_factor"])
def test_unknown_underscore_keys_are_refused_like_any_unknown_key(key):
    with pytest.raises(ValueError, match=rf"unknown key\(s\) \['{KEY}\.{key}'\]"):
        LengthSurgeConfig.from_dict({key: 0.25})


def test_hydras_own_keys_are_accepted():
    cfg = LengthSurgeConfig.from_dict({"_target_": "verl_lrstab.glue.configs.LengthSurgeOptimizerConfig",
                                       "gamma": 0.25})
    assert cfg.gamma == 0.25


# -- figures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("detector", ["cusum", "ratio"])
def test_a_length_given_as_text_is_skipped_with_the_nan_warning(detector, caplog):
    options = {"detector": detector, **({k: v for k, v in FAST.items() if k != "detector"} if detector == "ratio"
                                        else {})}
    text, nan = LengthSurgeSchedule(options), LengthSurgeSchedule(options)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        text.observe(1, UpdateFigures("1200"))
        nan.observe(1, UpdateFigures(math.nan))
    assert text.detector.num_skipped == nan.detector.num_skipped == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("'1200' is not a positive finite number" in m for m in messages), messages
    assert any("nan is not a positive finite number" in m for m in messages), messages
    assert math.isnan(text.response_length)


def test_a_co_signal_given_as_text_is_not_fed():
    s = LengthSurgeSchedule({})
    s.observe(1, UpdateFigures(1000.0, score="0.5", clip_ratio="0.1", mismatch_kl="0.01"))
    assert math.isnan(s.score) and math.isnan(s.clip_ratio) and math.isnan(s.mismatch_kl)
    assert s.detector.state_dict()["rows"]["score"] == [] and s.detector.state_dict()["rows"]["clip"] == []


def test_an_update_counter_that_goes_back_is_warned_about_not_absorbed(caplog):
    s = LengthSurgeSchedule(FAST)
    for u in range(1, 11):
        s.observe(u, UpdateFigures(1000.0))
    before = copy.deepcopy(s.detector.state_dict())
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        fired = s.observe(3, UpdateFigures(3800.0))  # a 3.8x length, at a counter that went back from 10 to 3
    assert not fired and s.detector.state_dict() == before  # not fed out of order
    assert any("update counter went back from 10 to 3" in r.getMessage() for r in caplog.records)
    # the next update in order is fed and reports the surge
    assert s.observe(11, UpdateFigures(3800.0)) and s.trigger_step == 11


# -- a loaded scheduler state ----------------------------------------------------------------------
def trained_state():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    sched = LengthSurgeLR(opt, config=FAST)
    for length in [100.0] * 6 + [300.0] * 4:
        opt.step()
        sched.step(length)
    return sched.state_dict()


def fresh():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    return LengthSurgeLR(opt, config=FAST)


def _set(state, path, value):
    node = state
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value


@pytest.mark.parametrize("path,value,field", [
    (("base_lrs", 0), math.nan, r"base_lrs\[0\]=nan"),
    (("base_lrs", 0), -1e-6, r"base_lrs\[0\]=-1e-06"),
    (("base_lrs", 0), math.inf, r"base_lrs\[0\]=inf"),
    (("base_lrs",), [], r"base_lrs=\[\]"),
    (("last_epoch",), -5, r"last_epoch=-5"),
    (("last_epoch",), KeyError, r"last_epoch=<missing>"),
    (("updates_per_step",), 0, r"updates_per_step=0, expected an integer >= 1"),
    (("updates_per_step",), True, r"updates_per_step=True"),
    (("_last_lr", 0), math.inf, r"_last_lr\[0\]=inf"),
    (("schedule", "detector"), KeyError, r"detector=<missing>"),
    (("schedule", "detector", "history"), KeyError, r"detector\.history=<missing>"),
    (("schedule", "detector", "history", 0), [1], r"detector\.history\[0\]=\[1\]"),
    (("schedule", "detector", "history", 0), ["a", 1.0], r"detector\.history\[0\]=\['a', 1\.0\]"),
    (("schedule", "detector", "num_skipped"), -1, r"detector\.num_skipped=-1"),
    (("schedule", "trigger_step"), "7", r"trigger_step='7'"),
    (("schedule", "trigger_source"), "loss", r"trigger_source='loss', expected null or one of"),
    (("schedule", "detector_kind"), KeyError, r"detector_kind=<missing>"),
    (("schedule", "mismatch_trigger"), KeyError, r"mismatch_trigger=<missing>"),
    (("options",), KeyError, r"options=<missing>"),
    (("options", "origin"), KeyError, r"options\.origin=<missing>"),
    (("options", "cusum_spam"), 20, r"options\.cusum_spam=20, expected absent \(not a length_surge option\)"),
])
def test_a_damaged_scheduler_state_is_refused_naming_the_step_and_field(path, value, field):
    state = trained_state()
    step = state["last_epoch"]
    _set(state, path, value)
    with pytest.raises(SchedulerStateError, match=rf"the checkpoint at update ({step}|-5|\?): .*{field}"):
        fresh().load_state_dict(state)


def test_a_cusum_state_missing_a_field_or_with_an_unknown_one_is_refused_naming_it():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    sched = LengthSurgeLR(opt)
    for _ in range(12):
        opt.step()
        sched.step(1000.0)
    state = sched.state_dict()
    older = copy.deepcopy(state)
    del older["schedule"]["detector"]["fired_by"]  # no older in-repo state format is kept alive
    with pytest.raises(SchedulerStateError, match=r"detector\.fired_by=<missing>"):
        LengthSurgeLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)).load_state_dict(older)
    unknown = copy.deepcopy(state)
    unknown["schedule"]["detector"]["watch"] = None
    with pytest.raises((SchedulerStateError, ValueError), match=r"watch"):
        LengthSurgeLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)).load_state_dict(unknown)
    del state["schedule"]["detector"]["cusum"]
    with pytest.raises(SchedulerStateError, match=r"the checkpoint at update 12: .*detector\.cusum=<missing>"):
        LengthSurgeLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)).load_state_dict(state)


def cusum_state():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    sched = LengthSurgeLR(opt)
    for s in range(1, 41):  # a length step up at 30 with a rising score: an alarm armed, held
        opt.step()
        sched.step(1000.0 * (1.6 if s >= 30 else 1.0) * (1.01 if s % 2 else 0.99), score=0.5 + 0.01 * max(0, s - 28))
    state = sched.state_dict()
    assert state["schedule"]["detector"]["alarm"] is not None
    return state


@pytest.mark.parametrize("path,value,field", [
    (("alarm",), 5, r"detector\.alarm=5, expected null or a mapping of \['baseline', 'is_return', 'step'\]"),
    (("alarm", "step"), "31", r"detector\.alarm\.step='31', expected an integer"),
    (("alarm", "is_return"), 1, r"detector\.alarm\.is_return=1, expected true or false"),
    (("alarm", "armed"), True, r"detector\.alarm\.armed=True, expected absent"),
    (("alarm", "baseline"), KeyError, r"detector\.alarm\.baseline=<missing>"),
    (("watch",), None, r"detector\.watch=None, expected absent \(not a field of CusumState\)"),
    (("cusum",), -1.0, r"detector\.cusum=-1\.0, expected a finite number >= 0"),
    (("fired_by",), ["scores"], r"detector\.fired_by=\['scores'\], expected ways among"),
    (("rows", "co", "entropy"), KeyError, r"detector\.rows\.co=\[.*\], expected a mapping of"),
    (("rows", "score", 0), [1, "x"], r"detector\.rows\.score\[0\]=\[1, 'x'\], expected a row"),
    (("level",), "1000", r"detector\.level='1000', expected a number"),
])
def test_a_cusum_state_it_cannot_read_is_refused_naming_the_field(path, value, field):
    state = cusum_state()
    if path[:2] == ("rows", "score"):
        assert state["schedule"]["detector"]["rows"]["score"]
    _set(state["schedule"]["detector"], path, value)
    with pytest.raises(SchedulerStateError, match=rf"the checkpoint at update 40: .*{field}"):
        fresh_default().load_state_dict(state)


def test_the_detector_alone_refuses_what_it_cannot_read_naming_the_field():
    from verl_lrstab.cusum import CusumDetector
    from verl_lrstab.ratio import RatioDetector
    from verl_lrstab.mismatch_trigger import MismatchTrigger
    from verl_lrstab.dataclass_reader import StateFieldError

    state = cusum_state()["schedule"]["detector"]
    state["alarm"]["step"] = 31.0
    with pytest.raises(StateFieldError, match=r"detector\.alarm\.step=31\.0, expected an integer"):
        CusumDetector().load_state_dict(state)
    ratio = RatioDetector(FAST).state_dict()
    ratio["streak_start"] = "3"
    with pytest.raises(StateFieldError, match=r"detector\.streak_start='3', expected null or an integer"):
        RatioDetector(FAST).load_state_dict(ratio)
    trigger = MismatchTrigger().state_dict()
    del trigger["streak"]
    with pytest.raises(StateFieldError, match=r"mismatch_trigger\.streak=<missing>"):
        MismatchTrigger().load_state_dict(trigger)


def fresh_default():
    return LengthSurgeLR(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6))


def test_a_sound_state_still_round_trips():
    state = trained_state()
    sched = fresh()
    sched.load_state_dict(copy.deepcopy(state))
    assert sched.state_dict() == state


# -- lrstab replay ---------------------------------------------------------------------------------
def test_replay_refuses_negative_steps(tmp_path, capsys):
    run = tmp_path / "run.csv"
    run.write_text("step,response_length/mean\n" + "".join(f"{s},{100 + max(0, s) * 5}\n" for s in range(-200, 40)))
    assert main(["replay", str(run)]) == 1
    err = capsys.readouterr().err
    assert "200 negative step number(s) (first: -200)" in err and "LR scale" not in err


def test_a_damaged_megatron_scheduler_state_is_refused_naming_the_step_and_field():
    pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
    from verl_lrstab.scheduler_state_checks import check_megatron_scheduler_state

    saved = trained_state()
    state = {"max_lr": 1e-6, "min_lr": 0.0, "num_steps": 12,
             "length_surge": {"schedule": saved["schedule"], "options": saved["options"]}}
    check_megatron_scheduler_state(copy.deepcopy(state))
    with pytest.raises(SchedulerStateError, match=r"the checkpoint at update 12: .*max_lr=nan"):
        check_megatron_scheduler_state({**state, "max_lr": math.nan})
    no_options = copy.deepcopy(state)
    del no_options["length_surge"]["options"]
    with pytest.raises(SchedulerStateError, match=r"length_surge\.options=<missing>"):
        check_megatron_scheduler_state(no_options)
    state["length_surge"]["schedule"]["detector"]["history"].append("x")
    with pytest.raises(SchedulerStateError, match=r"the checkpoint at update 12: .*detector\.history\[\d+\]='x'"):
        check_megatron_scheduler_state(state)


def test_the_dataclass_reader_reader_imports_nothing_of_the_package_so_the_states_need_no_cycle():
    # cusum, ratio, mismatch_trigger and detectors read their states with dataclass_reader; scheduler_state_checks reads the
    # schedule's state through detectors, so dataclass_reader must import neither (an import cycle otherwise)
    import ast
    from pathlib import Path

    import verl_lrstab.dataclass_reader as dataclass_reader

    def imports(module: str) -> set:
        tree = ast.parse((Path(dataclass_reader.__file__).parent / f"{module}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    assert not {m for m in imports("dataclass_reader") if m and m.startswith("verl_lrstab")}
    for module in ("cusum", "ratio", "mismatch_trigger", "detectors"):
        assert "verl_lrstab.dataclass_reader" in imports(module) and "verl_lrstab.scheduler_state_checks" not in imports(module), module
