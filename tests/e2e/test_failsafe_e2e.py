"""Fail-safety in every process of verl's real ``main_ppo`` (driver, TaskRunner, workers), V0 and V1.

The ``sitecustomize`` fixture (tests/e2e/conftest.py: a ``sitecustomize.py`` on ``PYTHONPATH``, so
Ray's processes load it too) breaks the plugin the way a verl release or a broken install would,
before verl or the plugin load:

- ``driver_signature``: the driver-side target ``_update_actor`` (V1 ``PPOTrainer``, V0
  ``RayPPOTrainer``) gets another parameter name; verl's own calls still work (positional).
- ``module_import``: the package module ``verl_lrstab.cusum`` fails to import.

Then a stock run (``lr_scheduler_type=constant``) must train on verl's own code, with one
ERROR naming the cause in the log, and a ``length_surge`` run must stop before its second
step naming the verl target (or the module), verl's version and the cause.
``where=ray`` breaks the target only in Ray's processes (TaskRunner and workers): the driver
passes, and the refusal must come from those processes.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CAUSES = {
    "driver_signature": {"v1": "verl.trainer.ppo.v1.trainer_base.PPOTrainer._update_actor",
                         "v0": "verl.trainer.ppo.ray_trainer.RayPPOTrainer._update_actor"},
    "module_import": {"v1": "the package module verl_lrstab.cusum", "v0": "the package module verl_lrstab.cusum"},
}
TRAINER = {"v0": "trainer.use_v1=false", "v1": "trainer.use_v1=true"}


def broken_run(main_ppo_raw, sitecustomize, name, trainer, scheduler, mode, where="all"):
    overrides = [TRAINER[trainer], "trainer.total_training_steps=2",
                 f"actor_rollout_ref.actor.optim.lr_scheduler_type={scheduler}"]
    return main_ppo_raw(name, overrides, env=sitecustomize(break_mode=mode, break_where=where))


CASES = [
    pytest.param("v1", "driver_signature", id="v1-driver_signature"),
    pytest.param("v0", "module_import", id="v0-module_import"),
    pytest.param("v0", "driver_signature", id="v0-driver_signature", marks=pytest.mark.slow),
    pytest.param("v1", "module_import", id="v1-module_import", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("trainer,mode", CASES)
def test_stock_run_trains_on_verls_code_and_says_so(main_ppo_raw, sitecustomize, trainer, mode):
    run = broken_run(main_ppo_raw, sitecustomize, f"stock-{trainer}-{mode}", trainer, "constant", mode)
    log = run.log_path.read_text(errors="replace")
    assert run.returncode == 0 and not run.timed_out, run.log_tail()
    assert sorted(run.metrics) == [1, 2], run.log_tail()
    assert run.metrics[2]["actor/lr"] == pytest.approx(run.metrics[1]["actor/lr"])  # verl's constant schedule
    assert f"verl-lrstab: cannot use {CAUSES[mode][trainer]} with verl 0.9.1" in log  # loud, not DEBUG


@pytest.mark.parametrize("trainer,mode", CASES)
def test_length_surge_run_stops_before_training_with_the_cause(main_ppo_raw, sitecustomize, trainer, mode):
    run = broken_run(main_ppo_raw, sitecustomize, f"ls-{trainer}-{mode}", trainer, "length_surge", mode)
    log = run.log_path.read_text(errors="replace")
    assert run.returncode != 0 and not run.timed_out, run.log_tail()
    assert 2 not in run.metrics and 1 not in run.metrics  # refused before the first update
    assert "GlueUnavailable" in log and "lr_scheduler_type=length_surge cannot be used" in log, run.log_tail()
    assert CAUSES[mode][trainer] in log and "verl 0.9.1" in log
    if mode == "module_import":
        assert "simulated: verl_lrstab.cusum is broken" in log


@pytest.mark.parametrize("trainer", ["v1", pytest.param("v0", marks=pytest.mark.slow)])
def test_a_target_broken_only_in_rays_processes_is_refused_there(main_ppo_raw, sitecustomize, trainer):
    # the driver's own check passes; the TaskRunner (trainer __init__ wrap) or the workers refuse
    run = broken_run(main_ppo_raw, sitecustomize, f"ls-ray-{trainer}", trainer, "length_surge", "driver_signature", "ray")
    log = run.log_path.read_text(errors="replace")
    assert run.returncode != 0 and not run.timed_out, run.log_tail()
    assert 1 not in run.metrics
    assert "GlueUnavailable" in log and CAUSES["driver_signature"][trainer] in log, run.log_tail()
    assert "(TaskRunner" in log or "(WorkerDict" in log or "ray::" in log  # raised in a Ray process
