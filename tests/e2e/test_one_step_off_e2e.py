"""End-to-end: verl 0.9.1's real one-step-off-policy trainer (``verl.experimental.one_step_off_policy.main_ppo``,
``OneStepOffRayTrainer``: a rollout pool of its own, sampling one policy version behind) on CPU with
``lr_scheduler_type=length_surge``: cpu_demo.yaml plus the one-step-off overrides
(``verl_lrstab_cpu.launch.ONE_STEP_OFF``: the weight sync between the pools through the CPU backend's
``gloo`` checkpoint engine, registered in verl's ``CheckpointEngineRegistry``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_main_ppo_cpu import (LR0, N_STEPS, PERIOD_FACTOR, RESUME_AT, SURGE, fresh_scheduler, same, series,
                               step_as_logged)
from verl_lrstab_cpu.launch import ONE_STEP_OFF, ONE_STEP_OFF_MODULE

pytestmark = pytest.mark.e2e


def one_step_off(main_ppo, name: str, overrides, **kwargs):
    return main_ppo(name, ONE_STEP_OFF + list(overrides), module=ONE_STEP_OFF_MODULE, **kwargs)


def test_one_step_off_feeds_the_length_and_only_the_fresh_samples_mismatch(main_ppo):
    """The first step trains on the weights synced at fit's start (fresh: the engine's own mismatch, float32
    both sides, fed), every later step on the previous step's (one version back: logged apart, not fed)."""
    run = one_step_off(main_ppo, "one-step-off-short", SURGE + ["trainer.total_training_steps=4",
                                                                  "trainer.test_freq=-1"])
    assert sorted(run.metrics) == [1, 2, 3, 4]
    for step, data in run.metrics.items():
        assert data["actor/lrstab/response_length"] == pytest.approx(data["response_length/mean"], rel=1e-9), step
        assert data["actor/lr"] == LR0  # no surge in 4 steps: the scheduler is fed, the LR still the initial one
    first = run.metrics[1]
    assert first["actor/mismatch/fresh_share"] == 1.0
    assert first["actor/mismatch/k3"] < 1e-8
    assert first["actor/lrstab/mismatch_kl"] == first["actor/mismatch/k3"]
    for step in (2, 3, 4):
        data = run.metrics[step]
        assert data["actor/mismatch/fresh_share"] == 0.0, step
        assert "actor/mismatch/k3" not in data and "actor/lrstab/mismatch_kl" not in data, step
        assert data["actor/mismatch/stale/lag_1/k3"] > 1e3 * max(first["actor/mismatch/k3"], 1e-12), step
        assert not [k for k in data if k.startswith("actor/mismatch/stale/") and "/lag_1/" not in k], step


def resumed_pair(main_ppo):
    """A one-step-off run stopped with a checkpoint at RESUME_AT and resumed (resume_mode=auto) to N_STEPS."""
    base = SURGE + ["trainer.test_freq=-1"]
    first = one_step_off(main_ppo, "one-step-off-resume", base + [
        f"trainer.total_training_steps={RESUME_AT}", f"trainer.save_freq={RESUME_AT}"], metrics_name="segment1.jsonl")
    second = one_step_off(main_ppo, "one-step-off-resume", base + [
        f"trainer.total_training_steps={N_STEPS}", "trainer.resume_mode=auto"], metrics_name="segment2.jsonl")
    assert sorted(first.metrics) == list(range(1, RESUME_AT + 1))
    assert sorted(second.metrics) == list(range(RESUME_AT + 1, N_STEPS + 1)), "did not resume at the checkpoint"
    return first, second


@pytest.mark.slow  # two segments of a 26-step run (about 2 x 2.5 min on 2 cores)
def test_one_step_off_surge_decays_the_lr_as_a_replay_and_resumes_the_schedule_exactly(main_ppo):
    first, second = resumed_pair(main_ppo)
    # every logged lrstab/* figure is what the package's own scheduler makes of the logged feed
    replayed = fresh_scheduler()
    for step in range(1, RESUME_AT + 1):
        step_as_logged(replayed, first.metrics[step])
        assert first.metrics[step]["actor/lr"] == pytest.approx(replayed.get_last_lr()[0], rel=1e-12), step
        for key, value in replayed.metrics().items():
            assert first.metrics[step][f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)
    # the checkpoint (the trainer's own, verl's FSDPCheckpointManager) holds the state of its step
    ckpt = sorted(Path(first.metrics_path.parent, "checkpoints", f"global_step_{RESUME_AT}").rglob(
        "extra_state_world_size_*_rank_0.pt"))
    assert len(ckpt) == 1, ckpt
    saved = torch.load(ckpt[0], weights_only=False)["lr_scheduler"]
    assert same(saved, replayed.state_dict()), (saved, replayed.state_dict())
    # the resumed segment continues from it
    for step in range(RESUME_AT + 1, N_STEPS + 1):
        step_as_logged(replayed, second.metrics[step])
        assert second.metrics[step]["actor/lr"] == pytest.approx(replayed.get_last_lr()[0], rel=1e-12), step
        for key, value in replayed.metrics().items():
            assert second.metrics[step][f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)
    # a surge, and the LR decayed
    surge = replayed.surge_step
    assert surge is not None, json.dumps(series({**first.metrics, **second.metrics}, "response_length/mean"))
    assert replayed.get_last_lr()[0] < LR0 and second.metrics[N_STEPS]["actor/lr"] < LR0
    assert second.metrics[N_STEPS]["actor/lrstab/decay_period"] == max(1, int(PERIOD_FACTOR * surge + 0.5))
    # the resumed segment's first step trains on the weights synced at its fit's start: fresh again
    assert second.metrics[RESUME_AT + 1]["actor/mismatch/fresh_share"] == 1.0


@pytest.mark.slow  # two more runs (2 x 70 s)
def test_a_stock_one_step_off_run_is_the_same_with_the_plugin_and_without(main_ppo):
    """constant LR, the verl-lrstab plugin loaded vs disabled (VERL_USE_EXTERNAL_PLUGINS=none; the CPU backend
    still loads through VERL_USE_EXTERNAL_MODULES): the same keys, no lrstab/mismatch figure, the same numbers."""
    overrides = ["trainer.total_training_steps=3", "trainer.test_freq=-1",
                 "actor_rollout_ref.actor.optim.lr_scheduler_type=constant", "~actor_rollout_ref.actor.optim.length_surge"]
    with_plugin = one_step_off(main_ppo, "one-step-off-stock-plugin", overrides)
    stock = one_step_off(main_ppo, "one-step-off-stock-none", overrides, env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert sorted(with_plugin.metrics) == sorted(stock.metrics) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = with_plugin.metrics[step], stock.metrics[step]
        assert not [k for k in (*a, *b) if k.startswith(("actor/lrstab/", "actor/mismatch/"))]
        assert set(a) == set(b), set(a) ^ set(b)
        for key in ("actor/lr", "actor/grad_norm", "response_length/mean", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (step, key)
