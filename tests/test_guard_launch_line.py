"""The user's launch line reaches verl as verl reads it: ``trainer.logger`` as a string or a list, a
checkpoint folder whose path has spaces, commas and non-ASCII letters, every override the guard adds
read back through Hydra's own parser and composed into verl's real config; a launch line Hydra or
the guard's config checks refuse is one error naming the override, status 2, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_guard_supervisor import LR0, Run, expected_scale
from verl_lrstab.guard.overrides import override, read_back
from verl_lrstab.guard.plan import GuardOptions, plan_run, rollback_overrides
from verl_lrstab.guard.supervisor import compose_config

MAIN = ["python", "-m", "verl.trainer.main_ppo"]
BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.save_freq=4",
        "trainer.total_training_steps=20"]
ODD = "ck a,b=c [ü] d'e"  # a space, a comma, an equals sign, brackets, a non-ASCII letter, a quote


def test_every_override_the_guard_adds_reads_back_through_hydra_and_verls_config(tmp_path):
    ck = tmp_path / ODD
    user = [*BASE, override("trainer.default_local_dir", str(ck)), "trainer.logger=console",
            "actor_rollout_ref.rollout.seed=7"]
    plan = plan_run(compose_config(MAIN, user, tmp_path), tmp_path)
    assert plan.checkpoint_dir == ck
    added = rollback_overrides(plan.checkpoint_dir, 8, 27, 2, GuardOptions(reseed=True), plan, decay_from_step=5)
    added.append(override("trainer.logger", ["console", "file"]))
    optim = "actor_rollout_ref.actor.optim"
    meant = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(ck / "global_step_8"),
             f"{optim}.lr_scheduler_type": "length_surge", f"{optim}.length_surge.decay_from_step": 5,
             f"{optim}.length_surge.decay_period": 27, f"{optim}.length_surge.monitor_only": False,
             f"{optim}.length_surge.guard_rollbacks": 2, "actor_rollout_ref.rollout.seed": 2007,
             "trainer.logger": ["console", "file"]}
    assert {o.split("=", 1)[0].lstrip("+"): read_back(o) for o in added} == meant  # Hydra's own parser
    cfg = compose_config(MAIN, user + added, tmp_path)  # and verl's config, as its Hydra main composes it
    for key, value in meant.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert (list(node) if key == "trainer.logger" else node) == value, key


def test_a_string_logger_and_an_odd_checkpoint_path_roll_back_and_finish_on_the_standin(tmp_path):
    # verl takes trainer.logger=console (Tracking wraps a string in a list); the stand-in asserts each backend as
    # verl's Tracking does, and reads every override through Hydra's parser
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}}, ckpt=tmp_path / ODD)
    run.command = [c if not c.startswith(("trainer.logger=", "trainer.default_local_dir=")) else
                   "trainer.logger=console" if c.startswith("trainer.logger=") else
                   override("trainer.default_local_dir", str(run.ckpt)) for c in run.command]
    res = run.guard()
    assert res.returncode == 0, res.stderr
    (rb,) = run.events("rollback")
    assert rb["checkpoint_step"] == 8 and run.launches() == 2
    log = (run.run_dir / "segment-2.log").read_text()
    assert "Load from checkpoint folder: " + str(run.ckpt / "global_step_8") in log  # verl got the path whole
    final = run.final()
    assert sorted(final) == list(range(1, 21))
    for u in range(9, 21):
        assert final[u]["actor/lr"] == pytest.approx(LR0 * expected_scale(u, rb["decay_from_step"], rb["decay_period"]))


@pytest.mark.parametrize("bad,named", [
    ("trainer.save_freq=abc", "trainer.save_freq=abc: expected a whole number"),
    ("trainer.total_training_steps=2.5", "trainer.total_training_steps=2.5: expected a whole number"),
    ("trainer.max_actor_ckpt_to_keep=[1]", "trainer.max_actor_ckpt_to_keep=[1]: expected a whole number"),
    ("actor_rollout_ref.actor.optim.lr=abc", "actor_rollout_ref.actor.optim.lr=abc: expected a number"),
    ("trainer.foo=1", "override 'trainer.foo=1' is refused by Hydra"),
    ("trainer.default_hdfs_dir=~", "override 'trainer.default_hdfs_dir=~' is refused by Hydra"),
    ("default_hdfs_dir=~", "override 'default_hdfs_dir=~' is refused by Hydra"),
    ("+trainer.save_freq=3", "override '+trainer.save_freq=3' is refused by Hydra"),
])
def test_a_launch_line_hydra_or_the_config_refuses_is_one_error_and_status_2(tmp_path, bad, named):
    run_dir = tmp_path / "guard"
    res = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run_dir), "--",
                          *MAIN, *BASE, f"trainer.default_local_dir={tmp_path / 'ck'}", bad],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("lrstab guard: error: ")]
    assert len(errors) == 1 and named in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not run_dir.exists() and not (tmp_path / "ck").exists()  # nothing started, nothing made


def test_a_path_hydra_cannot_carry_unchanged_is_refused_naming_the_key():
    from verl_lrstab.guard.plan import GuardError

    with pytest.raises(GuardError, match=r"trainer\.resume_from_path: the value '/x/\$\{y\}/global_step_4'"):
        override("trainer.resume_from_path", str(Path("/x/${y}/global_step_4")))
