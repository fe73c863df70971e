"""The Megatron arms of the experiment kit compose against verl's real config tree, pass verl's
checks, and lay a dense and an MoE model out on one 8-GPU node as Megatron requires.

The model shapes are those of the models' published ``config.json`` (Qwen3-8B-Base,
Qwen3-30B-A3B-Base); no download here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_lrstab.config import LengthSurgeConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "experiments"
MODELS = {  # megatron_model option -> (HF path, layers, attention heads, KV heads, experts)
    "qwen3_8b": ("Qwen/Qwen3-8B-Base", 36, 32, 8, 0),
    "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B-Base", 48, 32, 4, 128),
}
CASES = [(arm, model) for arm in ("megatron_constant", "megatron_length_surge") for model in MODELS]


def _compose(arm, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=arm, overrides=list(overrides))


@pytest.mark.parametrize("arm,model", CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_megatron_arm_passes_verl_checks(arm, model):
    cfg = _compose(arm, [f"megatron_model={model}"])
    OmegaConf.to_container(cfg, resolve=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.strategy == "megatron" and cfg.actor_rollout_ref.model.path == MODELS[model][0]
    optim = actor.optim
    assert optim.lr == pytest.approx(1e-6) and optim.use_checkpoint_opt_param_scheduler is True
    assert actor.megatron.use_distributed_optimizer
    if arm == "megatron_length_surge":
        # the paper's defaults, with the paper's origin (the arm names it)
        assert optim.lr_decay_style == "length_surge" and optim.length_surge == LengthSurgeConfig(origin="start")
    else:
        # a stock arm's optim is verl's own class, built by verl's own checks
        assert optim.lr_decay_style == "constant" and not hasattr(optim, "length_surge")
        assert type(optim).__module__ == "verl.workers.config.optimizer"
    # The paper's setting, as the FSDP arms: one update per step, 64 x 16 samples, 8k responses.
    assert cfg.data.train_batch_size == actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.data.max_response_length == 8192
    assert cfg.trainer.experiment_name == arm and "file" in cfg.trainer.logger


def layout_problems(cfg, model) -> list:
    """What breaks Megatron's rules (or verl's batch split) in the arm's layout for ``model``."""
    _, layers, heads, kv_heads, experts = MODELS[model]
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    problems = []
    for role in ("actor", "ref"):
        engine = omega_conf_to_dataclass(cfg.actor_rollout_ref[role].megatron)
        tp, pp = engine.tensor_model_parallel_size, engine.pipeline_model_parallel_size
        cp = engine.context_parallel_size
        ep = engine.expert_model_parallel_size
        etp = engine.expert_tensor_parallel_size or tp
        checks = {
            "TP x PP x CP tiles the node": world % (tp * pp * cp) == 0,
            "PP splits the layers": layers % pp == 0,
            "TP splits the heads and KV heads": heads % tp == 0 and kv_heads % tp == 0,
            # Megatron's expert grid: EP x ETP x PP tiles the world, and the experts split evenly.
            "EP x ETP x PP tiles the node": world % (ep * etp * pp) == 0,
            "EP splits the experts (EP 1 for a dense model)": experts % ep == 0 if experts else ep == 1,
        }
        if world % (tp * pp * cp) == 0:
            dp = world // (tp * pp * cp)
            # verl splits each mini-batch of prompts x n samples evenly over the data-parallel ranks.
            samples = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
            checks["DP splits the mini-batch"] = samples % dp == 0
        problems += [f"{role}: {name}" for name, ok in checks.items() if not ok]
    rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if world % rollout_tp or kv_heads % rollout_tp:
        problems.append("rollout TP")
    return problems


@pytest.mark.parametrize("model", MODELS)
def test_parallel_layout_fits_one_8_gpu_node(model):
    cfg = _compose("megatron_length_surge", [f"megatron_model={model}"])
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 8
    assert layout_problems(cfg, model) == []


def test_the_moe_layout_is_what_the_yaml_says():
    """Pins the layouts docs/megatron.md states (a changed YAML must change that page too)."""
    dense = _compose("megatron_length_surge").actor_rollout_ref.actor.megatron
    moe = _compose("megatron_length_surge", ["megatron_model=qwen3_30b_a3b"]).actor_rollout_ref.actor.megatron
    assert (dense.tensor_model_parallel_size, dense.pipeline_model_parallel_size,
            dense.expert_model_parallel_size) == (2, 1, 1)
    assert (moe.tensor_model_parallel_size, moe.pipeline_model_parallel_size, moe.expert_model_parallel_size,
            moe.expert_tensor_parallel_size) == (4, 1, 8, 1)


def test_a_broken_layout_is_caught():
    """The layout check can fail: TP 3 does not tile 8 GPUs, EP 6 does not split 128 experts."""
    cfg = _compose("megatron_length_surge", ["megatron_model=qwen3_30b_a3b",
                                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                                             "actor_rollout_ref.actor.megatron.expert_model_parallel_size=6"])
    assert layout_problems(cfg, "qwen3_30b_a3b") == [
        "actor: TP x PP x CP tiles the node", "actor: TP splits the heads and KV heads",
        "actor: EP x ETP x PP tiles the node", "actor: EP splits the experts (EP 1 for a dense model)"]
    cfg = _compose("megatron_length_surge", ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    # ref's layout follows the actor's (verl's oc.select defaults)
    assert layout_problems(cfg, "qwen3_8b") == ["actor: EP splits the experts (EP 1 for a dense model)",
                                                "ref: EP splits the experts (EP 1 for a dense model)"]
