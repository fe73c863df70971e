"""Every config of the experiment kit composes against verl's real config tree and passes verl's checks.

Composition uses Hydra's compose API with the arm as primary config (as ``main_ppo --config-path
configs/experiments --config-name ARM`` does); the checks are verl's own: ``validate_config``
(what ``main_ppo`` runs before starting Ray), the config dataclasses built with
``omega_conf_to_dataclass`` (what the workers build), and the rollout-correction settings
through verl's ``compute_rollout_correction_and_rejection_mask`` on a small batch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_rejection_mask,
)
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.torch_dtypes import PrecisionType

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "experiments"
ARMS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("_"))
# Every paper arm also runs on the 8B model and with SGLang: one switch each.
VARIANTS = [[], ["paper_model=qwen3_8b", "actor_rollout_ref.rollout.name=sglang"]]
CASES = [(arm, v) for arm in ARMS for v in (VARIANTS if arm.startswith("paper_") else VARIANTS[:1])]


def _compose(arm: str, overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=arm, overrides=list(overrides))


def _uses_length_surge(cfg) -> bool:
    return cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "length_surge"


def test_the_kit_has_every_arm():
    expected = {"paper_constant", "paper_tis", "paper_mis", "paper_icepop", "paper_fp16", "paper_length_surge",
                "paper_length_surge_tis", "paper_length_surge_fixed", "starter_gsm8k"}
    assert expected <= set(ARMS)


@pytest.mark.parametrize("arm,overrides", CASES, ids=[f"{a}{'-8b-sglang' if v else ''}" for a, v in CASES])
def test_config_passes_verl_checks(arm, overrides):
    cfg = _compose(arm, overrides)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl warns that GRPO runs without a critic
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    algo = omega_conf_to_dataclass(cfg.algorithm)

    # The paper's setting / the starter's, as documented.
    assert actor.optim.lr == pytest.approx(1e-6)
    assert algo.adv_estimator == "grpo"
    assert rollout.name == ("sglang" if overrides else "vllm")
    assert rollout.calculate_log_probs
    if arm.startswith("paper_"):
        assert cfg.data.train_batch_size == actor.ppo_mini_batch_size == 64
        assert rollout.n == 16 and cfg.data.max_response_length == 8192
        model = "Qwen/Qwen3-8B-Base" if overrides else "Qwen/Qwen3-4B-Base"
        assert cfg.actor_rollout_ref.model.path == model
    assert cfg.trainer.experiment_name == arm
    assert "file" in cfg.trainer.logger  # what `lrstab compare` reads

    # Rollout correction: verl's own code accepts the thresholds and does what the arm says.
    rc = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig)
    torch.manual_seed(0)
    old = -torch.rand(4, 6)
    rollout_lp = old + 0.3 * torch.randn(4, 6)
    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout_lp, torch.ones(4, 6), rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)
    expected_is = {"paper_tis": "token", "paper_icepop": "token", "paper_mis": "sequence",
                   "paper_length_surge_tis": "token"}.get(arm)
    assert rc.rollout_is == expected_is
    assert (weights is None) == (expected_is is None)
    assert (rc.rollout_rs is not None) == (arm == "paper_mis")
    if arm == "paper_icepop":
        assert str(rc.rollout_is_threshold) == "0.5_5.0"
    if arm == "paper_fp16":
        for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref):
            engine = omega_conf_to_dataclass(role.fsdp_config)
            assert PrecisionType.to_dtype(engine.mixed_precision["param_dtype"]) == torch.float16
        assert rollout.dtype == "float16"

    if _uses_length_surge(cfg):
        from verl_lrstab.config import LengthSurgeConfig

        # verl's own instantiation of the optim node hands the scheduler a valid config.
        assert isinstance(actor.optim.length_surge, LengthSurgeConfig)
        assert actor.optim.length_surge.decay_period == (198 if arm == "paper_length_surge_fixed" else None)
        # The paper's online arms count the halvings from the start (as published); the others act at the surge.
        paper = arm in ("paper_length_surge", "paper_length_surge_tis", "megatron_length_surge", "paper_length_surge_fixed")
        assert actor.optim.length_surge.origin == ("start" if paper else "surge")
        # The other options the YAML shows are the defaults (the comments say so).
        shown = OmegaConf.to_container(cfg.actor_rollout_ref.actor.optim.length_surge)
        defaults = LengthSurgeConfig().to_dict()
        assert {k: v for k, v in shown.items() if k not in ("decay_period", "origin")} == \
            {k: defaults[k] for k in shown if k not in ("decay_period", "origin")}


def test_verl_rejects_a_broken_arm():
    """The checks above can fail: verl refuses a mini-batch larger than the batch, a bad IcePop band."""
    cfg = _compose("starter_gsm8k", ["data.train_batch_size=32"])
    with pytest.raises(ValueError, match="must be >= actor.ppo_mini_batch_size"):
        validate_config(cfg, use_reference_policy=False, use_critic=False)
    cfg = _compose("paper_icepop", ["algorithm.rollout_correction.rollout_is_threshold='5.0_0.5'"])
    rc = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig)
    with pytest.raises(ValueError, match="lower bound must be <= upper"):
        compute_rollout_correction_and_rejection_mask(
            -torch.rand(2, 3), -torch.rand(2, 3), torch.ones(2, 3), rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold)


def test_bad_length_surge_option_is_refused_by_name():
    cfg = _compose("paper_length_surge", ["actor_rollout_ref.actor.optim.length_surge.origin=middle"])
    # Hydra wraps the plugin's ValueError; the message still names the key and the allowed values.
    with pytest.raises(InstantiationException, match=r"length_surge\.origin='middle'.*allowed values"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_run_arm_launches_verl_main_ppo_with_the_arm():
    """The launcher's command, as verl's own entry point composes it (``--cfg job`` prints the
    config and exits before Ray starts)."""
    import subprocess
    import sys

    import yaml

    sys.path.insert(0, str(CONFIG_DIR.parents[1] / "scripts"))
    from run_arm import command

    cmd = command("paper_length_surge_fixed", ["paper_model=qwen3_8b", "actor_rollout_ref.rollout.name=sglang"])
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
    proc = subprocess.run(cmd + ["--cfg", "job", "--resolve"], capture_output=True, text=True, check=False,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["trainer"]["experiment_name"] == "paper_length_surge_fixed-qwen3_8b-sglang"
    assert cfg["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen3-8B-Base"
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "sglang"
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["length_surge"]["decay_period"] == 198
    with pytest.raises(ValueError, match="unknown arm 'nope'; arms: megatron_constant, .*, paper_constant"):
        command("nope", [])


def test_prepared_rows_are_scored_by_verls_reward():
    """prepare_data's rows carry what verl's default reward needs (data_source, ground_truth)."""
    import sys

    import pandas as pd
    from verl.utils.reward_score import default_compute_score

    sys.path.insert(0, str(CONFIG_DIR.parents[1] / "scripts"))
    from prepare_data import dedupe_prompts, gsm8k_record

    row = gsm8k_record({"question": "2 boxes of 36 pens?", "answer": "2*36=72 pens\n#### 1,072"}, 0, "test")
    assert row["reward_model"]["ground_truth"] == "1072"
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(row["data_source"], "so #### 1072", truth) == 1.0
    assert default_compute_score(row["data_source"], "so #### 1071", truth) == 0.0
    with pytest.raises(ValueError, match="no '#### <answer>'"):
        gsm8k_record({"question": "q", "answer": "no marker"}, 3, "train")

    prompt = [{"role": "user", "content": "Find x. Answer: $Answer"}]
    df = pd.DataFrame({"data_source": ["math_dapo"] * 3, "prompt": [prompt, prompt, [{"role": "user", "content": "y"}]],
                       "reward_model": [{"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}] * 3})
    assert len(dedupe_prompts(df)) == 2
    score = default_compute_score("math_dapo", "work...\nAnswer: 34", "34")
    assert (score["score"] if isinstance(score, dict) else score) == 1.0


# -- every shipped config loads through verl's config classes with the default detector -----------------
REPO_CONFIGS = CONFIG_DIR.parent
#: The options a shipped YAML names at their default, and why: a key the YAML names can be overridden without
#: '+', which a documented command or test does (the two-run workflow's decay_period; the mismatch trigger's
#: runs on the CPU demo). Any other option stays out of the YAMLs: its default is LengthSurgeConfig's.
NAMED_AT_DEFAULT = {"experiments/_length_surge.yaml": {"decay_period"},
                    "cpu_demo.yaml": {"trigger", "mismatch_budget"}}


def _length_surge_nodes():
    for path in sorted(REPO_CONFIGS.rglob("*.yaml")):
        node = OmegaConf.load(path)
        options = OmegaConf.select(node, "actor_rollout_ref.actor.optim.length_surge")
        if options is not None:
            yield str(path.relative_to(REPO_CONFIGS)), OmegaConf.to_container(options)


def test_a_shipped_yaml_names_an_option_only_to_change_it():
    from verl_lrstab.config import LengthSurgeConfig, options

    declared = options()
    named = dict(_length_surge_nodes())
    assert {"experiments/_length_surge.yaml", "cpu_demo.yaml"} <= set(named)
    for path, node in named.items():
        LengthSurgeConfig.from_dict(node)  # every key an option, every value allowed
        at_default = {k for k, v in node.items() if v == declared[k].default}
        assert at_default == NAMED_AT_DEFAULT.get(path, set()), (
            f"{path} names {sorted(at_default)} at LengthSurgeConfig's default: leave them out (or say why here)")
    # the snippet every length_surge arm composes is the defaults: the arms change what they name themselves
    assert set(named["experiments/_length_surge.yaml"]) == NAMED_AT_DEFAULT["experiments/_length_surge.yaml"]


def _compose_in(config_dir: Path, name: str, overrides=()):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("name,overrides", [
    ("cpu_demo", []), ("cpu_demo", ["+cpu_rollout=vllm"]),
    *[(f"experiments/{arm}", []) for arm in ARMS],
])
def test_every_shipped_config_builds_verls_actor_config_with_the_default_detector(name, overrides):
    """verl's own ``omega_conf_to_dataclass`` builds the actor config (optimizer included) of every
    config under configs/; one that names length_surge gets the default detector, every option valid."""
    from verl_lrstab.config import LengthSurgeConfig

    directory, config = (REPO_CONFIGS / name).parent, (REPO_CONFIGS / name).name
    cfg = _compose_in(directory, config, overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    if _uses_length_surge(cfg) or cfg.actor_rollout_ref.actor.optim.get("lr_decay_style") == "length_surge":
        assert isinstance(actor.optim.length_surge, LengthSurgeConfig)
        assert actor.optim.length_surge.detector == "cusum"


def test_every_config_file_is_covered():
    primary = {str(p.relative_to(REPO_CONFIGS).with_suffix("")) for p in REPO_CONFIGS.rglob("*.yaml")
               if not p.name.startswith("_") and p.parent.name not in ("cpu_rollout", "paper_model", "megatron_model")}
    assert primary == {"cpu_demo", *(f"experiments/{arm}" for arm in ARMS)}
