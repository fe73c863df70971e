"""Scheduler state round trip with the mismatch trigger: a resumed run fires where the uninterrupted one does.

The checkpoint is taken after the trigger calibrated its budget and in the middle of a streak
above it, so a state that lost the trigger's calibration or streak (or the whole mismatch
trigger part) would fire later after the resume, and these tests would fail.
"""

import io
import json

import pytest
import torch

from verl_lrstab.scheduler import LengthSurgeLR

OPTIONS = {"skip_first_steps": 2, "mismatch_calibration_steps": 4, "mismatch_budget_factor": 4.0, "patience": 2}
STEPS = 20
# k3 per update: 1e-4 (calibration: steps 3-6, budget 4e-4), then 3e-3 from update 12: fires at 13
KL = [1e-4] * 11 + [3e-3] * (STEPS - 11)
LENGTHS = [1000.0] * STEPS  # flat: the length detector never fires
SAVE_AT = 12  # calibrated, one step into the streak
FIRED_AT = 13


def make(trigger):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    return opt, LengthSurgeLR(opt, {**OPTIONS, "trigger": trigger})


def drive(opt, sched, first, last):
    lrs = []
    for u in range(first, last + 1):
        opt.step()
        sched.step(LENGTHS[u - 1], KL[u - 1])
        lrs.append(sched.get_last_lr()[0])
    return lrs


def save_and_load(sched, opt, trigger):
    buf = io.BytesIO()
    torch.save({"lr_scheduler": sched.state_dict()}, buf)  # as verl's FSDPCheckpointManager
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["lr_scheduler"]
    opt2, fresh = make(trigger)
    opt2.load_state_dict(opt.state_dict())
    fresh.load_state_dict(state)
    return opt2, fresh


@pytest.mark.parametrize("trigger", ["mismatch", "either"])
def test_resume_continues_the_mismatch_triggers_exact_trajectory(trigger):
    opt_ref, ref = make(trigger)
    reference = drive(opt_ref, ref, 1, STEPS)
    assert ref.schedule.trigger_step == FIRED_AT and ref.schedule.trigger_source == "mismatch"
    assert ref.schedule.mismatch_trigger.budget == pytest.approx(4e-4)

    opt, sched = make(trigger)
    first = drive(opt, sched, 1, SAVE_AT)
    assert sched.schedule.mismatch_trigger.state_dict()["streak"] == 1  # saved mid-streak
    opt2, resumed = save_and_load(sched, opt, trigger)
    assert resumed.schedule.mismatch_trigger.budget == pytest.approx(4e-4)
    rest = drive(opt2, resumed, SAVE_AT + 1, STEPS)
    assert resumed.schedule.trigger_step == FIRED_AT
    assert first + rest == reference
    assert json.dumps(resumed.state_dict(), sort_keys=True) == json.dumps(ref.state_dict(), sort_keys=True)


def test_a_state_without_the_mismatch_trigger_part_would_be_caught():
    # what the round trip above guards against: dropping the trigger's state changes the trajectory
    opt, sched = make("mismatch")
    drive(opt, sched, 1, SAVE_AT)
    state = sched.state_dict()
    del state["schedule"]["mismatch_trigger"]
    opt2, fresh = make("mismatch")
    try:
        fresh.load_state_dict(state)
    except (KeyError, ValueError):
        return  # refusing such a state is also fine
    drive(opt2, fresh, SAVE_AT + 1, STEPS)
    assert fresh.schedule.trigger_step != FIRED_AT


@pytest.mark.parametrize("options", [{"gamma": "float64"}, {"gamma": "float32"}, {"mismatch_calibration_steps": "int64"},
                                     {"skip_first_steps": "int32"}])
def test_options_given_as_numpy_numbers_train_and_checkpoint_as_python_ones(options):
    """A sweep's grid hands numpy scalars: they are the same options, and the checkpoint they make loads
    with ``weights_only=True`` (a numpy scalar in the state would be refused there)."""
    import numpy as np

    (key, dtype), = options.items()
    plain = {"gamma": 0.25, "mismatch_calibration_steps": 5, "skip_first_steps": 3}[key]
    given = np.dtype(dtype).type(plain)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    sched = LengthSurgeLR(opt, {**OPTIONS, "trigger": "either", key: given})
    assert type(getattr(sched.config, key)) is type(plain) and getattr(sched.config, key) == plain
    drive(opt, sched, 1, SAVE_AT)
    buf = io.BytesIO()
    torch.save({"lr_scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["lr_scheduler"]["options"][key]
    assert type(saved) is type(plain) and saved == plain


@pytest.mark.parametrize("key, value", [("patience", "bool_"), ("patience", "float64")])
def test_numpy_values_that_are_not_the_options_type_stay_refused(key, value):
    import numpy as np

    with pytest.raises(ValueError, match=f"length_surge.{key}=.*allowed values are an integer >= 1"):
        LengthSurgeLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                      {"detector": "ratio", key: getattr(np, value)(3)})
