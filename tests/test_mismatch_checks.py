"""The rollout configuration checks on verl's real config tree, composed by Hydra."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

from verl_lrstab.mismatch_checks import check_rollout_config


def verl_config(*overrides):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def codes(*overrides):
    return [f.code for f in check_rollout_config(verl_config(*overrides))]


def test_verls_defaults_raise_nothing():
    assert codes() == []
    assert codes("actor_rollout_ref.rollout.temperature=0.7") == []  # processed log-probs include the temperature


def test_no_rollout_log_probs_is_named():
    (f,) = check_rollout_config(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false"))
    assert f.code == "no_rollout_log_probs" and "calculate_log_probs=false" in f.message and "Set it to true" in f.message


@pytest.mark.parametrize("shaping", ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.9",
                                     "actor_rollout_ref.rollout.top_k=20"])
def test_raw_log_probs_with_a_distribution_changing_sampler(shaping):
    got = codes("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", shaping)
    assert got[0] == "raw_logprobs_with_shaped_sampling"
    assert codes("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs") == []  # plain sampling: raw == processed


@pytest.mark.parametrize("correction", ["algorithm.rollout_correction.rollout_is=token",
                                        "algorithm.rollout_correction.rollout_rs=token_k3",
                                        "algorithm.rollout_correction.bypass_mode=true"])
def test_top_p_or_top_k_with_rollout_correction(correction):
    assert "truncated_sampling_with_rollout_correction" in codes("actor_rollout_ref.rollout.top_p=0.95", correction)
    assert "truncated_sampling_with_rollout_correction" not in codes(correction)


def test_the_v0_bypass_pitfall_is_named_with_the_fix():
    bad = ["trainer.use_v1=false", "algorithm.rollout_correction.bypass_mode=true",
           "algorithm.rollout_correction.rollout_is=token"]
    (f,) = check_rollout_config(verl_config(*bad))
    assert f.code == "v0_bypass_correction_not_applied" and "policy_loss.loss_mode=bypass_mode" in f.message
    assert codes(*bad, "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode") == []  # the recipe's fix
    assert codes("trainer.use_v1=true", *bad[1:]) == []  # V1 hands them to the workers
    assert codes("trainer.use_v1=false", "algorithm.rollout_correction.bypass_mode=true") == []  # nothing to hand


def test_a_length_surge_run_warns_about_its_rollout_config_when_its_trainer_is_built(caplog):
    from verl_lrstab.glue import driver

    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    cfg = verl_config("actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge",
                      "actor_rollout_ref.rollout.calculate_log_probs=false")
    driver.check_run(cfg, require=lambda engine, trainer=None: None)
    assert "calculate_log_probs=false" in caplog.text and "[no_rollout_log_probs]" in caplog.text


def test_a_broken_check_only_warns(caplog, monkeypatch):
    from verl_lrstab import mismatch_checks
    from verl_lrstab.glue import driver

    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    monkeypatch.setattr(mismatch_checks, "check_rollout_config", lambda cfg: 1 / 0)
    driver.warn_about_rollout_config(SimpleNamespace())
    assert "could not run" in caplog.text
