"""No silent no-op: where length_surge would never be fed, naming it fails at config time.

Each case uses verl's real config classes (composed through verl's Hydra configs where verl
composes them) and checks the one error names the key, the engine/role and what is supported.
"""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from verl.utils.config import omega_conf_to_dataclass
from verl_lrstab.glue.refusals import LengthSurgeNotSupported

SUPPORTED = r"Supported: the actor \(actor_rollout_ref.actor.optim\) of the FSDP engine"


def ppo_config(*overrides, config_name="ppo_trainer"):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def refused(match):
    return pytest.raises((LengthSurgeNotSupported, InstantiationException), match=match)


def test_critic_refuses_length_surge(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from engine_harness import build_tiny_model

    critic = [f"critic.model.path={build_tiny_model(tmp_path / 'model')}", "critic.ppo_micro_batch_size_per_gpu=1"]
    cfg = ppo_config("critic.optim.lr_scheduler_type=length_surge", *critic)
    with refused(r"critic\.optim\.lr_scheduler_type=length_surge is not supported for the critic.*" + SUPPORTED):
        omega_conf_to_dataclass(cfg.critic)
    # the stock critic is unaffected
    stock = omega_conf_to_dataclass(ppo_config(*critic).critic)
    assert stock.optim.lr_scheduler_type == "constant"


def test_veomni_refuses_length_surge():
    cfg = ppo_config("model_engine=veomni", "actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge")
    with refused(r"actor_rollout_ref\.actor\.optim\.lr_scheduler_type=length_surge is not supported for the "
                 r"VeOmni engine.*" + SUPPORTED):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    stock = omega_conf_to_dataclass(ppo_config("model_engine=veomni").actor_rollout_ref.actor.optim)
    assert type(stock).__name__ == "VeOmniOptimizerConfig"


def test_torchtitan_refuses_length_surge():
    cfg = ppo_config("model_engine=torchtitan", "+actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge")
    with refused(r"lr_scheduler_type=length_surge is not supported for the TorchTitan engine.*" + SUPPORTED):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    stock = omega_conf_to_dataclass(ppo_config("model_engine=torchtitan").actor_rollout_ref.actor.optim)
    assert type(stock).__name__ == "TorchtitanOptimizerConfig"


@pytest.mark.parametrize("module", ["verl.trainer.sft_trainer", "verl.trainer.sft_trainer_ray"])
def test_sft_trainer_refuses_length_surge(module):
    import importlib

    trainer_cls = importlib.import_module(module).SFTTrainer
    trainer = trainer_cls.__new__(trainer_cls)  # _build_config is the first thing __init__ does
    trainer.config = ppo_config("optim.lr_scheduler_type=length_surge", config_name="sft_trainer_engine")
    with refused(r"optim\.lr_scheduler_type=length_surge is not supported for the SFT trainer.*" + SUPPORTED):
        trainer._build_config()
