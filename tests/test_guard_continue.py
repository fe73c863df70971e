"""A guarded run whose restarts were used up (status 4) continues once the cause is fixed, on its
rollback's LR rule: ``lrstab guard --resume`` relaunches verl with the rule's ``decay_from_step`` and
``decay_period``; the same command again, or a new run folder on its checkpoints, is refused
naming the ``--resume`` that keeps the rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_guard_faults import resume
from test_guard_supervisor import LR0, Run, expected_scale


def test_a_run_whose_restarts_were_used_up_continues_on_the_rollbacks_lr_rule(tmp_path):
    # NaN at steps 10, 11 -> rollback to step 8 (the rule); the resumed verl crashes at step 14, is restarted from
    # step 12 once, and crashes there again: restarts used up, status 4
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "crash_at": {"2": 14, "3": 14}})
    failed = run.guard("--max-restarts", "1")
    assert failed.returncode == 4, failed.stderr
    (rb,) = run.events("rollback")
    rule = f"decay_from_step={rb['decay_from_step']}", f"decay_period={rb['decay_period']}"
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "failed"

    again = run.guard("--max-restarts", "1")  # the same command: pointed at --resume
    assert again.returncode == 2 and f"lrstab guard --resume {run.run_dir}" in again.stderr
    other = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(tmp_path / "new"),
                            "--", *run.command], cwd=tmp_path, env=run.env, capture_output=True, text=True,
                           timeout=120)  # a new run folder would drop the rule
    assert other.returncode == 2 and f"lrstab guard --resume {run.run_dir}" in other.stderr
    assert all(r in other.stderr for r in rule)
    assert run.launches() == 3

    (tmp_path / "script.json").write_text("{}")  # the cause fixed
    res = resume(run)
    assert res.returncode == 0, res.stderr
    (resumed,) = run.events("resumed")
    assert resumed["after_failure"] and resumed["checkpoint_step"] == 12
    relaunch = (run.run_dir / "segment-4.log").read_text().splitlines()[0]  # the command line verl got
    assert all(f"length_surge.{r}" in relaunch for r in rule), relaunch
    final = run.final()
    assert sorted(final) == list(range(1, 21))
    for u in range(13, 21):  # verl ran them on the rollback's rule
        assert final[u]["actor/lr"] == pytest.approx(LR0 * expected_scale(u, rb["decay_from_step"], rb["decay_period"]))
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "done"
