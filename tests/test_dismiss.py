"""``dismiss_trigger_step``: a decay judged a false alarm is cleared when the run resumes from a checkpoint.

On the torch scheduler (FSDP) and on megatron-core's real ``OptimizerParamScheduler`` (where
installed), through the schedulers' own ``state_dict`` / ``load_state_dict``, as verl's checkpoint
managers call them. verl's trainer resuming with the option: ``tests/e2e/test_main_ppo_cpu.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.scheduler import LengthSurgeLR

LR = 1e-3
# A small ratio detector: a jump from 100 to 300 tokens is reported on the step it happens.
FAST = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3,
        "patience": 1, "period_factor": 1.0}
FIRST_JUMP = 7  # updates 1-6 at 100 tokens, from 7 on at 300
LENGTHS = [100.0] * (FIRST_JUMP - 1) + [300.0] * 8  # 14 updates: the checkpoint after the last


def torch_scheduler(options: dict) -> LengthSurgeLR:
    return LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR), options)


def fired_checkpoint() -> dict:
    sched = torch_scheduler(FAST)
    for length in LENGTHS:
        sched.step(length)
    assert sched.metrics()["lrstab/trigger_step"] == FIRST_JUMP and sched.get_last_lr()[0] < LR, \
        "the fixture's jump must fire the detector"
    return sched.state_dict()


def test_the_named_decay_is_cleared_on_resume_and_the_detector_rearms(caplog):
    state = fired_checkpoint()
    resumed = torch_scheduler({**FAST, "dismiss_trigger_step": FIRST_JUMP})
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        resumed.load_state_dict(state)
    assert f"the decay that started at update {FIRST_JUMP} is dismissed" in caplog.text
    # the initial LR at once: in the optimizer (verl has already loaded the checkpoint's decayed one) and logged
    assert resumed.get_last_lr() == [LR] and resumed.optimizer.param_groups[0]["lr"] == LR
    assert resumed.metrics()["lrstab/trigger_step"] == -1 and resumed.metrics()["lrstab/surge_step"] == -1
    assert resumed.last_epoch == len(LENGTHS), "the update counter is the checkpoint's"

    # the detector is armed again: the run's new level (300) is its baseline, a new jump fires it
    for _ in range(4):
        resumed.step(300.0)
    assert resumed.get_last_lr() == [LR]
    resumed.step(900.0)
    second = len(LENGTHS) + 5
    assert resumed.metrics()["lrstab/trigger_step"] == second and resumed.get_last_lr()[0] == LR / 2


def test_a_checkpoint_with_another_decay_or_none_resumes_unchanged():
    state = fired_checkpoint()
    other = torch_scheduler({**FAST, "dismiss_trigger_step": FIRST_JUMP + 1})
    other.load_state_dict(state)
    assert other.metrics()["lrstab/trigger_step"] == FIRST_JUMP and other.get_last_lr() == state["_last_lr"]

    early = torch_scheduler(FAST)  # a checkpoint before the surge: nothing to dismiss
    for length in LENGTHS[: FIRST_JUMP - 1]:
        early.step(length)
    resumed = torch_scheduler({**FAST, "dismiss_trigger_step": FIRST_JUMP})
    resumed.load_state_dict(early.state_dict())
    for length in LENGTHS[FIRST_JUMP - 1:]:
        resumed.step(length)
    # the option names a past decay, not a future one: the same jump fires again, at the same update
    assert resumed.metrics()["lrstab/trigger_step"] == FIRST_JUMP and resumed.get_last_lr()[0] < LR


@pytest.mark.parametrize("value", [0, -3, 2.5, "7", True])
def test_a_bad_value_is_refused_naming_the_key(value):
    with pytest.raises(ValueError) as err:
        LengthSurgeConfig.from_dict({"dismiss_trigger_step": value})
    assert f"length_surge.dismiss_trigger_step={value!r} is invalid" in str(err.value)
    assert "allowed values are null or an integer in [1, " in str(err.value)


def test_it_is_refused_with_the_guards_forced_decay():
    with pytest.raises(ValueError, match="dismiss_trigger_step.*null with decay_from_step set"):
        LengthSurgeConfig.from_dict({"dismiss_trigger_step": 5, "decay_from_step": 5, "decay_period": 10})


def test_megatron_scheduler_resumes_at_its_max_lr_with_the_decay_dismissed():
    pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
    from verl_lrstab.megatron import LengthSurgeParamScheduler

    def make(options):
        opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.ones(2))], "wd_mult": 1.0, "lr_mult": 1.0,
                                  "max_lr": LR, "min_lr": 0.0}], lr=LR)
        return opt, LengthSurgeParamScheduler(
            opt, options, init_lr=0.0, max_lr=LR, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=1000,
            start_wd=0.0, end_wd=0.0, wd_incr_steps=1000, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)

    opt, sched = make(FAST)
    for length in LENGTHS:
        sched.step(1, response_length=length)
    assert sched.metrics()["lrstab/trigger_step"] == FIRST_JUMP and opt.param_groups[0]["lr"] < LR
    opt2, resumed = make({**FAST, "dismiss_trigger_step": FIRST_JUMP})
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # verl loads the optimizer (decayed LR) first
    resumed.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == LR and resumed.metrics()["lrstab/trigger_step"] == -1
    assert resumed.num_steps == len(LENGTHS)


@pytest.mark.parametrize("other", [{"decay_period": 40}, {"monitor_only": True}])
def test_it_is_refused_in_training_where_no_detection_starts_a_decay(other):
    # a fixed period decays from step 0 whatever the detector says; a monitor never decays: nothing to dismiss
    config = LengthSurgeConfig.from_dict({"dismiss_trigger_step": 5, **other})
    with pytest.raises(ValueError, match=r"length_surge\.dismiss_trigger_step=5 is invalid in training.*none to "
                                         r"dismiss"):
        config.check_training()  # what a verl run's optimizer config runs


def test_a_surge_a_monitor_saw_is_named_on_resume_with_the_rule_that_decays_from_it(caplog):
    monitor = torch_scheduler({**FAST, "monitor_only": True})
    for length in LENGTHS:
        monitor.step(length)
    assert monitor.metrics()["lrstab/surge_step"] == FIRST_JUMP and monitor.get_last_lr() == [LR]
    state = monitor.state_dict()
    plain = torch_scheduler(FAST)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        plain.load_state_dict(state)
    period = round(FAST["period_factor"] * FIRST_JUMP)
    assert f"saw a surge at update {FIRST_JUMP}" in caplog.text
    assert f"length_surge.decay_from_step={len(LENGTHS)} and " in caplog.text
    assert f"length_surge.decay_period={period} " in caplog.text
    plain.step(300.0)
    assert plain.get_last_lr() == [LR]  # as the warning says: not acted on
    # the rule it names decays from the next update on
    advised = torch_scheduler({**FAST, "decay_from_step": len(LENGTHS), "decay_period": period})
    advised.load_state_dict(state)
    assert advised.get_last_lr() == [LR / 2]
