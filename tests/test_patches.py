"""The runtime wraps of patches/README.md still apply to the installed verl."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("check_verl", Path(__file__).parents[1] / "patches" / "check_verl.py")
check_verl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_verl)


@pytest.mark.parametrize("name,ok,detail", list(check_verl.checks()), ids=lambda v: v if isinstance(v, str) else "")
def test_verl_target_has_expected_shape(name, ok, detail):
    if ok is None:  # e.g. Megatron's engine without megatron-core (make install, not install-megatron)
        pytest.skip(f"{name}: {detail}")
    assert ok, f"{name}: {detail}"


def test_wrappers_are_installed_by_the_plugin():
    from verl.workers import engine_workers
    from verl.workers.config import FSDPOptimizerConfig
    from verl.workers.engine.fsdp import transformer_impl

    assert FSDPOptimizerConfig.__name__ == "LengthSurgeOptimizerConfig"
    assert getattr(transformer_impl.FSDPEngine._build_lr_scheduler, "_lrstab_original", None) is not None
    assert getattr(engine_workers.TrainingWorker.train_mini_batch, "_lrstab_original", None) is not None


def test_a_changed_v1_padding_template_refuses_length_surge_loudly(monkeypatch):
    # the V1 length leaves out padding samples by their shape: if verl's template changes, say so
    from verl.trainer.ppo import padding_utils

    from verl_lrstab.glue import batch_figures
    from verl_lrstab.glue.wraps import VerlShapeError

    original = padding_utils.construct_minimal_padding_template

    def two_token_template(*args, **kwargs):
        pad, tag = original(*args, **kwargs)
        pad["responses"] = pad["responses"].repeat(2)
        return pad, tag

    monkeypatch.setattr(padding_utils, "construct_minimal_padding_template", two_token_template)
    monkeypatch.setattr(batch_figures, "_assumptions_checked", False)
    with pytest.raises(VerlShapeError, match="V1 padding samples have one response token"):
        batch_figures.check_assumptions_once()


@pytest.mark.parametrize("mode,is_async", [("sync", 0), ("colocate_async", 1), ("separate_async", 1)])
def test_v1_driver_wrap_tags_the_step_position_and_pre_rejection_stats(mode, is_async):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl_lrstab.glue import driver
    from verl_lrstab.glue.steps import PRE_RS_STATS_KEY, STEP_POSITION_KEY

    seen = []
    wrapper = driver.make_v1_update_actor(lambda self, batch, metrics: seen.append(dict(batch.extra_info)))
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {"lr_scheduler_type": "length_surge"}}},
                               "trainer": {"use_v1": True, "v1": {"trainer_mode": mode}},
                               "data": {"max_response_length": 96}})
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = get_trainer_cls(mode)
    trainer = cls.__new__(cls)  # verl's class; its run-level checks are in tests/test_glue_trainers.py
    trainer.config, trainer.parameter_sync_step, trainer.local_trigger_step = config, 4, 2
    driver._checked[trainer] = driver.run_is_async(config, cls)  # what check_run records, by class
    driver._run.pre_rs = [1.0, 2.0]
    wrapper(trainer, SimpleNamespace(extra_info={"epochs": 1}), {})
    assert seen == [{"epochs": 1, STEP_POSITION_KEY: [2, 4, is_async, 96], PRE_RS_STATS_KEY: [1.0, 2.0]}]
    assert driver._pop_pre_rs_stats() is None  # consumed: never handed to a later batch
    # a stock run's batch is untouched
    config.actor_rollout_ref.actor.optim.lr_scheduler_type = "cosine"
    wrapper(trainer, SimpleNamespace(extra_info={"epochs": 1}), {})
    assert seen[-1] == {"epochs": 1}
