"""The README's quick start, command by command, against verl's real config and the package's real output.

- the ``main_ppo`` command: its overrides compose verl's own ``ppo_trainer`` config (Hydra), pass
  verl's ``validate_config``, and verl's ``omega_conf_to_dataclass`` builds the actor with the
  ``length_surge`` scheduler and the rollout with its log-probs; the watch-only and the
  false-alarm overrides likewise (the false alarm's behaviour on verl's trainer:
  ``tests/e2e/test_main_ppo_cpu.py``); the CPU end-to-end runs use the same two settings
  (``configs/cpu_demo.yaml``);
- ``lrstab check-verl``: run, its last line is the README's;
- the log line: printed by the glue's own builder from verl's optimizer config;
- the panel's metric names: logged by the scheduler, the mismatch figures and verl;
- the WARNING quoted under "When it fires": the schedule's own, through a provoked surge.

Installing the wheel into an existing verl environment (``pip install``): ``tests/test_install.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import logging
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
QUICK = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 5)]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", QUICK, re.S)


def overrides(block: str) -> list[str]:
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    assert words[:3] == ["python", "-m", "verl.trainer.main_ppo"], words[:3]
    return [w for w in words[3:] if w != "..."]


def verl_config(args: list[str]):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=args)


def run_command() -> list[str]:
    (block,) = [b for b in blocks("bash") if "algorithm.adv_estimator" in b]
    return overrides(block)


def test_the_quick_start_command_builds_verls_config_with_the_scheduler_and_the_log_probs():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from verl_lrstab.config import LengthSurgeConfig

    args = run_command()
    assert args[-2:] == ["actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge",
                         "actor_rollout_ref.rollout.calculate_log_probs=true"], "the last two lines are the added ones"
    cfg = verl_config(args)
    assert cfg.actor_rollout_ref.model.path.startswith("Qwen/Qwen2.5-") and "gsm8k" in cfg.data.train_files
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert actor.optim.lr_scheduler_type == "length_surge" and rollout.calculate_log_probs is True
    assert isinstance(actor.optim.length_surge, LengthSurgeConfig) and actor.optim.length_surge == LengthSurgeConfig()

    # watch only: the override the quick start names
    (watch,) = re.findall(r"`(\+actor_rollout_ref\.actor\.optim\.length_surge\.monitor_only=true)`", QUICK)
    actor = omega_conf_to_dataclass(verl_config(args + [watch]).actor_rollout_ref.actor)
    assert actor.optim.length_surge.monitor_only is True


def test_the_false_alarm_command_resumes_with_the_decay_named():
    from verl.utils.config import omega_conf_to_dataclass

    (block,) = [b for b in blocks("bash") if "dismiss_trigger_step" in b]
    resume = [w.replace("=N", "=17") for w in overrides(block)]
    cfg = verl_config(run_command() + resume)
    assert cfg.trainer.resume_mode == "auto"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.optim.length_surge.dismiss_trigger_step == 17


def test_the_cpu_runs_use_the_quick_starts_two_settings():
    cpu = OmegaConf.load(ROOT / "configs" / "cpu_demo.yaml")
    assert cpu.actor_rollout_ref.actor.optim.lr_scheduler_type == "length_surge"
    assert cpu.actor_rollout_ref.rollout.calculate_log_probs is True


def test_lrstab_check_verl_ends_with_the_line_the_readme_quotes():
    from verl_lrstab.cli import check_verl

    (quoted,) = re.findall(r"`lrstab check-verl` ends with\s+`([^`]+)`", QUICK)
    out = io.StringIO()
    assert check_verl.run(out) == 0
    last = out.getvalue().splitlines()[-1]
    if importlib.util.find_spec("megatron") is None:  # `make install` alone: Megatron's engine check cannot run
        assert last.startswith("verl-lrstab serves this verl only where it could check it: 1 check(s) could not run")
    else:  # every runtime extra installed (make test): the README's line
        assert last == quoted
    assert "pip install verl-lrstab" in blocks("bash")[0] and "lrstab check-verl" in blocks("bash")[0]


def test_the_log_line_is_what_the_glue_prints_when_it_builds_the_scheduler(capsys):
    from verl.workers.config import FSDPOptimizerConfig

    from verl_lrstab.glue.engine import build_length_surge_scheduler

    (quoted,) = blocks("text")
    prefix = quoted.strip().split("{")[0]
    config = FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge", total_training_steps=100)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-6)
    build_length_surge_scheduler(optimizer, config, verbose=True)
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(prefix + "{'period_factor': 1.8, "), (prefix, printed)


def test_the_panels_metric_names_are_logged():
    from verl.trainer.ppo import metric_utils

    from verl_lrstab import mismatch
    from verl_lrstab.detectors import UpdateFigures
    from verl_lrstab.scheduler import LengthSurgeLR

    panel = QUICK[QUICK.index("**4. Put these on"):QUICK.index("**5. When it fires")]
    names = set(re.findall(r"`((?:actor|critic|response_length)/[\w/]+)`", panel))
    assert len(names) >= 7, names
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3))
    scheduler.observe_update(UpdateFigures(response_length=100.0, score=0.5))
    scheduler.step()
    logged = {f"actor/{k}" for k in scheduler.metrics()}
    stats = mismatch.compute_stats(torch.zeros(2, 3), torch.full((2, 3), -0.01), torch.ones(2, 3))
    logged |= {f"actor/{k}" for k in mismatch.finalize(stats)}
    verl_source = inspect.getsource(metric_utils.compute_data_metrics)
    logged |= {k for k in ("response_length/mean", "critic/score/mean") if f'"{k}"' in verl_source}
    # verl's worker logs the LR under the actor's prefix; the CPU end-to-end tests read it from its log
    e2e = (ROOT / "tests" / "e2e" / "test_main_ppo_cpu.py").read_text()
    logged |= {"actor/lr"} if '"actor/lr"' in e2e else set()
    assert names <= logged, sorted(names - logged)


def test_the_warning_quoted_when_it_fires_is_the_schedules(caplog):
    from verl_lrstab.scheduler import LengthSurgeLR

    (quoted,) = re.findall(r"logs `(verl_lrstab: length surge at update N; decay period P, origin surge)`", QUICK)
    fast = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3,
            "patience": 1}
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), fast)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        for length in [100.0] * 6 + [300.0]:
            scheduler.step(length)
    n, p = scheduler.metrics()["lrstab/trigger_step"], scheduler.decay_period
    assert n == 7 and quoted.replace("N", str(n)).replace("P", str(p)) in caplog.text, caplog.text
