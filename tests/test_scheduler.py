"""LengthSurgeLR: the torch scheduler protocol (step, get_last_lr, state_dict)."""

import contextlib
import io
import logging
import math

import pytest
import torch

from verl_lrstab.detectors import UpdateFigures
from verl_lrstab.scheduler import LengthSurgeLR


def make(lr=1e-6, **kwargs):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return opt, LengthSurgeLR(opt, **kwargs)


def lengths(n=400, onset=60):
    return [1000.0] * onset + [3000.0] * (n - onset)


def drive(sched, opt, values):
    lrs = []
    for v in values:
        opt.step()
        sched.step(v)
        lrs.append(sched.get_last_lr()[0])
    return lrs


def test_default_lr_is_cut_at_the_update_after_the_detection():
    opt, sched = make()
    lrs = drive(sched, opt, lengths())
    t, p = sched.surge_step, sched.decay_period
    assert t is not None and p == round(1.8 * t)
    # lrs[u - 1] is logged after update u (the LR of update u + 1): update t + 1 runs at half the LR.
    assert lrs[t - 2] == pytest.approx(1e-6) and lrs[t - 1] == pytest.approx(5e-7)
    assert lrs[t + p - 2] == pytest.approx(5e-7) and lrs[t + p - 1] == pytest.approx(2.5e-7)


def test_lr_follows_the_paper_decay_after_a_surge():
    opt, sched = make(config={"origin": "start"})
    lrs = drive(sched, opt, lengths())
    t, p = sched.surge_step, sched.decay_period
    assert t is not None and p == round(1.8 * t)
    # lrs[u - 1] is logged after update u: the LR of update u + 1 (verl's actor/lr convention).
    # The first halving is in force at update p, so it is logged after update p - 1.
    assert lrs[p - 3] == pytest.approx(1e-6) and lrs[p - 2] == pytest.approx(5e-7)
    assert lrs[2 * p - 3] == pytest.approx(5e-7) and lrs[2 * p - 2] == pytest.approx(2.5e-7)
    assert opt.param_groups[0]["lr"] == lrs[-1]
    assert sched.lr_scale() == pytest.approx(lrs[-1] / 1e-6)


def test_warmup_then_constant_like_verl():
    opt, sched = make(lr=1.0, warmup_steps=4)
    assert sched.get_last_lr() == [0.0]  # verl's constant schedule starts at 0 too
    assert drive(sched, opt, [100.0] * 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_updates_per_step_handed_with_the_figures_turn_an_update_warmup_into_trainer_steps():
    # verl's V1 separate_async resolves the warmup in actor updates (8 = 4 trainer steps x 2 updates);
    # the scheduler steps once per trainer step, so the ramp takes ceil(8 / 2) = 4 of them
    opt, sched = make(lr=1.0, warmup_steps=8)
    lrs = []
    for _ in range(6):
        sched.observe_update(UpdateFigures(response_length=100.0, updates_per_step=2))
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0]) and sched.updates_per_step == 2
    # figures without the count leave it as it is
    sched.observe_update(UpdateFigures(response_length=100.0))
    assert sched.updates_per_step == 2


def _lrs_per_trainer_step(count, warmup, resume_at=None, resume_config=None, steps=90):
    """The LR each trainer step's updates run at, ``count`` updates a step as the glue drives them (the LR held
    within a step, the figures handed on its last update); resumed from a checkpoint after ``resume_at``."""
    values = [1000.0] * 60 + [3000.0] * (steps - 60)
    opt, sched = make(lr=1.0, warmup_steps=warmup)
    out = []
    for t in range(1, steps + 1):
        seen = set()
        for i in range(count):
            seen.add(opt.param_groups[0]["lr"])
            with (sched.holding() if i < count - 1 else contextlib.nullcontext()):
                if i == count - 1:
                    sched.observe_update(UpdateFigures(response_length=values[t - 1], updates_per_step=count))
                opt.step()
                sched.step()
        assert len(seen) == 1, (t, seen)  # one LR a trainer step
        out.append(seen.pop())
        if t == resume_at:
            saved_opt, saved = opt.state_dict(), sched.state_dict()
            opt, sched = make(lr=1.0, warmup_steps=warmup, config=resume_config)
            opt.load_state_dict(saved_opt)
            sched.load_state_dict(saved)
    return out


@pytest.mark.parametrize("resume_config", [None, "dismiss", {"decay_from_step": 80, "decay_period": 20}])
def test_a_resumed_run_with_several_updates_a_step_keeps_its_warmup_in_trainer_steps(resume_config):
    # verl resolves the warmup in actor updates (400 = 100 trainer steps x 4 updates): resumed at step 80, in the
    # warmup, whatever LR rule the resume brings, every step runs as a run of one update a step with a warmup of
    # 100 steps does
    if resume_config == "dismiss":
        surge = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), warmup_steps=100)
        for v in [1000.0] * 60 + [3000.0] * 20:
            surge.step(v)
        assert surge.surge_step is not None
        resume_config = {"dismiss_trigger_step": surge.surge_step}
    four = _lrs_per_trainer_step(4, 400, resume_at=80, resume_config=resume_config)
    one = _lrs_per_trainer_step(1, 100, resume_at=80, resume_config=resume_config)
    assert four == pytest.approx(one)
    if resume_config and "dismiss_trigger_step" in resume_config:
        assert four[80] == pytest.approx(80 / 100)  # step 81: the initial LR's warmup, the decay dismissed


def test_a_handed_length_is_consumed_by_a_bare_step():
    opt, sched = make(config={"skip_first_steps": 0})
    sched.observe_update(UpdateFigures(response_length=321.0))
    opt.step()
    sched.step()  # what verl's engine calls
    assert sched.metrics()["lrstab/response_length"] == 321.0 and not sched.figures_waiting
    opt.step()
    sched.step()  # no value this step: skipped, not reused
    assert "lrstab/response_length" not in sched.metrics()


def test_state_dict_round_trip_through_torch_save_weights_only():
    values = lengths()
    opt_a, a = make()
    ref = drive(a, opt_a, values)

    opt_b, b = make()
    first = drive(b, opt_b, values[:100])  # past the surge, before the first decay
    buf = io.BytesIO()
    torch.save({"lr_scheduler": b.state_dict(), "optimizer": opt_b.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    opt_c, c = make()
    opt_c.load_state_dict(saved["optimizer"])
    c.load_state_dict(saved["lr_scheduler"])
    assert c.surge_step == a.surge_step
    assert first + drive(c, opt_c, values[100:]) == ref


def test_changed_lr_on_resume_keeps_checkpoint_lr_and_warns(caplog):
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    opt_a, a = make(lr=1e-6)
    drive(a, opt_a, [1000.0] * 5)
    opt_b, b = make(lr=3e-6)
    b.load_state_dict(a.state_dict())
    assert b.base_lrs == [1e-6]
    assert "ignored" in caplog.text


def test_nan_lengths_do_not_crash_or_decay():
    opt, sched = make()
    lrs = drive(sched, opt, [math.nan, None, 0.0] * 50)
    assert set(lrs) == {1e-6} and sched.surge_step is None


def test_resume_from_a_checkpoint_of_the_old_default_keeps_its_origin(caplog):
    """Issue 37: a checkpoint written when origin's default was 'start' keeps that rule on resume
    (no silent change of a running schedule) unless origin is set explicitly; a WARNING names both."""
    values = lengths(n=300)
    opt, old = make(config={"origin": "start"})  # what a checkpoint of the old default holds
    k = 80  # the checkpoint's update
    drive(old, opt, values[:k])
    t, p = old.surge_step, old.decay_period
    assert t is not None and t < k < p  # the surge is seen, the paper's first halving still to come
    state = old.state_dict()

    opt2, resumed = make(config={})  # the user's YAML names no origin: the new default
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        resumed.load_state_dict(state)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'start'" in said and "'surge'" in said and "origin" in said
    assert resumed.config.origin == "start"
    after = drive(resumed, opt2, values[k:])  # after[i] is logged after update k + i + 1
    # the paper's rule: 1.0 until update P, 0.5 from P (logged after update P - 1)
    assert after[0] == pytest.approx(1e-6)
    assert after[p - k - 3] == pytest.approx(1e-6) and after[p - k - 2] == pytest.approx(5e-7)

    opt3, explicit = make(config={"origin": "surge"})  # set explicitly: the user's choice applies
    explicit.load_state_dict(state)
    assert explicit.config.origin == "surge"
    assert drive(explicit, opt3, values[k:k + 1]) == [pytest.approx(5e-7)]  # already past t: halved at once
