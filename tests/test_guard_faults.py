"""``lrstab guard`` around the stand-in verl: what it refuses before a launch (a tracker naming a missing
checkpoint, a launch from scratch over checkpoints, ``--resume`` with the checkpoint folder gone),
and the faults it survives (a watchdog killed, a metrics line it cannot read, abandoned checkpoints
across file systems, a user's folder named like a checkpoint)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from test_guard_supervisor import LR0, Run, alive, expected_scale, start_guard, wait_for
from verl_lrstab.guard.plan import read_tracker
from verl_lrstab.runs import read_metrics


def written_by(folder: Path) -> set:
    return {p.read_text() for p in (folder / "actor").glob("*_rank_*.pt")}


def resume(run: Run, timeout=120):
    return subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                          cwd=run.dir, env=run.env, capture_output=True, text=True, timeout=timeout)


def plain_run(run: Run, steps: int) -> None:
    """The stand-in verl without the guard (launch 1): checkpoints every save_freq steps up to ``steps``."""
    cmd = [c for c in run.command if not c.startswith("trainer.total_training_steps=")]
    res = subprocess.run([*cmd, f"trainer.total_training_steps={steps}"], cwd=run.dir,
                         env={**run.env, "VERL_FILE_LOGGER_PATH": str(run.dir / "plain.jsonl")},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# -- refused before any launch ----------------------------------------------------------------------
def test_a_tracker_naming_a_missing_checkpoint_is_refused_by_a_new_guard_and_by_resume(tmp_path):
    run = Run(tmp_path, {"hang_at": {"1": 9}}, steps=12)
    proc = start_guard(run)
    assert wait_for(lambda: 9 in read_metrics(run.run_dir / "segment-1.jsonl"))
    proc.kill()
    proc.wait(timeout=30)
    assert wait_for(lambda: not any(alive(int(p)) for p in (tmp_path / "pids.txt").read_text().split()))
    tracker = run.ckpt / "latest_checkpointed_iteration.txt"
    tracker.write_text("20")  # names a folder that is not there, beside global_step_4 and _8
    assert find_latest_ckpt_path(str(run.ckpt)) is None  # verl would train from scratch over 4 and 8
    state_before = (run.run_dir / "guard_state.json").read_bytes()
    launches = run.launches()
    other = Run(tmp_path, {}, steps=12, ckpt=run.ckpt, run_dir=tmp_path / "other")
    for res in (other.guard(), resume(run)):
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{tracker} names step 20, but {run.ckpt / 'global_step_20'} is missing" in res.stderr
        assert f"echo 8 > {tracker}" in res.stderr and "--from-scratch" in res.stderr  # what to do
    assert run.launches() == launches  # verl was not started
    assert (run.run_dir / "guard_state.json").read_bytes() == state_before
    assert written_by(run.ckpt / "global_step_8") == {"launch 1 step 8"}
    # incomplete: the tracker names 8, whose rank-1 optimizer shard is gone
    tracker.write_text("8")
    shard = run.ckpt / "global_step_8" / "actor" / "optim_world_size_2_rank_1.pt"
    shard.rename(tmp_path / "shard")
    res = resume(run)
    assert res.returncode == 2 and f"{run.ckpt / 'global_step_8'} is incomplete" in res.stderr, res.stderr
    (tmp_path / "shard").rename(shard)
    res = resume(run)  # fixed: the run continues
    assert res.returncode == 0, res.stderr
    assert sorted(run.final()) == list(range(1, 13))


def test_verl_never_starts_from_scratch_over_checkpoints_unless_from_scratch_moves_them_aside(tmp_path):
    run = Run(tmp_path, {}, steps=12)
    plain_run(run, 8)  # launch 1: global_step_4, _8
    (run.ckpt / "latest_checkpointed_iteration.txt").unlink()  # verl's auto resume would now train from scratch
    res = run.guard()
    assert res.returncode == 2 and f"{run.ckpt} holds checkpoints (steps [4, 8]) but no tracker" in res.stderr
    assert "--from-scratch" in res.stderr and run.launches() == 1
    for extra in (["trainer.resume_mode=disable"],):  # the user's own from-scratch launch: refused as well
        res = run.guard(command=[*run.command, *extra])
        assert res.returncode == 2 and "trainer.resume_mode=disable with checkpoints already in" in res.stderr
    res = run.guard("--from-scratch")
    assert res.returncode == 0, res.stderr
    assert sorted(run.final()) == list(range(1, 13)) and run.final()[1]["data/batch_index"] == 0  # from step 1
    moved = run.run_dir / "abandoned" / "before-start-1"
    for s in (4, 8):  # set aside, as launch 1 wrote them; the new ones are launch 2's
        assert written_by(moved / f"global_step_{s}") == {f"launch 1 step {s}"}
        assert written_by(run.ckpt / f"global_step_{s}") == {f"launch 2 step {s}"}


def test_folders_after_the_step_verl_resumes_from_are_moved_aside_before_it_saves_over_them(tmp_path):
    run = Run(tmp_path, {}, steps=16)
    plain_run(run, 12)  # launch 1: 4, 8, 12
    (run.ckpt / "latest_checkpointed_iteration.txt").write_text("4")  # verl resumes from 4, saves 8 and 12 again
    res = run.guard()
    assert res.returncode == 0, res.stderr
    moved = run.run_dir / "abandoned" / "before-start-1"
    assert {written_by(moved / f"global_step_{s}").pop() for s in (8, 12)} == {"launch 1 step 8", "launch 1 step 12"}
    assert written_by(run.ckpt / "global_step_12") == {"launch 2 step 12"}
    assert min(run.final()) == 5


def test_resume_with_the_checkpoint_folder_missing_is_refused_and_works_once_it_is_back(tmp_path):
    # rollback 1 to step 8 (NaN at 10-11); the guard is killed in the resumed segment; the folder "unmounted"
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "hang_at": {"2": 14}}, steps=20)
    proc = start_guard(run)
    assert wait_for(lambda: (tmp_path / "launches.txt").exists() and run.launches() == 2)
    assert wait_for(lambda: 14 in read_metrics(run.run_dir / "segment-2.jsonl"))  # the launch after the rollback
    proc.kill()
    proc.wait(timeout=30)
    assert wait_for(lambda: not any(alive(int(p)) for p in (tmp_path / "pids.txt").read_text().split()))
    (rb,) = run.events("rollback")
    run.ckpt.rename(tmp_path / "unmounted")
    state_before = (run.run_dir / "guard_state.json").read_bytes()
    for _ in range(2):  # refused each time, nothing changed
        res = resume(run)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"the checkpoint folder {run.ckpt} is missing" in res.stderr and "Nothing was changed" in res.stderr
    assert run.launches() == 2 and (run.run_dir / "guard_state.json").read_bytes() == state_before
    assert not (run.run_dir / "metrics.jsonl").exists() and not run.ckpt.exists()
    (tmp_path / "unmounted").rename(run.ckpt)
    res = resume(run)
    assert res.returncode == 0, res.stderr
    final = run.final()
    assert sorted(final) == list(range(1, 21))
    for u in range(rb["checkpoint_step"] + 1, 21):  # the rollback's LR rule, not a from-scratch run
        assert final[u]["actor/lr"] == pytest.approx(LR0 * expected_scale(u, rb["decay_from_step"], rb["decay_period"]))


# -- faults survived --------------------------------------------------------------------------------
def test_a_folder_named_like_a_checkpoint_is_not_one(tmp_path):
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}}, steps=16)
    backup = run.ckpt / "best_global_step_60"  # a user's copy: not verl's name
    (backup / "actor").mkdir(parents=True)
    (backup / "actor" / "note.txt").write_text("mine")
    (run.ckpt / "global_step_60.bak").mkdir()
    res = run.guard()
    assert res.returncode == 0, res.stderr
    (rb,) = run.events("rollback")
    assert rb["checkpoint_step"] == 8
    assert (backup / "actor" / "note.txt").read_text() == "mine" and (run.ckpt / "global_step_60.bak").is_dir()
    assert not list((run.run_dir / "abandoned").rglob("*global_step_60*"))


def test_an_unreadable_metrics_line_is_skipped_with_one_warning_and_supervision_goes_on(tmp_path):
    # four lines that are JSON but not verl's shape after step 3; NaN at 10-11 must still roll back
    run = Run(tmp_path, {"junk_at": {"1": 3}, "nan_at": {"1": [10, 11]}}, steps=16)
    res = run.guard()
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    warned = [ln for ln in res.stderr.splitlines() if "not a verl file-logger line" in ln]
    # one warning per line (steps 1-3 are lines 1-3, the junk lines 4-7), though the guard read the file many times
    seg = run.run_dir / "segment-1.jsonl"
    assert [re.search(rf"{re.escape(str(seg))}:(\d+): skipped", w).group(1) for w in warned] == ["4", "5", "6", "7"]
    assert len(run.events("rollback")) == 1 and sorted(run.final()) == list(range(1, 17))


def test_processes_of_a_launch_whose_watchdog_was_killed_are_stopped_before_the_relaunch(tmp_path):
    run = Run(tmp_path, {"hang_at": {"1": 5}, "daemon": True})
    proc = start_guard(run, "--max-restarts", "1")
    pids_file = tmp_path / "pids.txt"
    assert wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2)
    driver, daemon = (int(p) for p in pids_file.read_text().split())
    # launch 1 hangs after step 5, past its step-4 checkpoint: a restart needs a complete checkpoint
    assert wait_for(lambda: 5 in read_metrics(run.run_dir / "segment-1.jsonl"))
    watchdog = int(Path(f"/proc/{driver}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert "verl_lrstab.guard.watchdog" in Path(f"/proc/{watchdog}/cmdline").read_text()
    (tmp_path / "script.json").write_text(json.dumps({"daemon": True}))  # the relaunch finishes
    os.kill(watchdog, signal.SIGKILL)  # the daemon (its own session) outlives it
    assert proc.wait(timeout=120) == 0
    # the relaunch (launch 2) started with no process of launch 1 alive, and nothing is left now
    assert json.loads((tmp_path / "alive_at_launch_2.txt").read_text()) == []
    assert run.launches() == 2 and not alive(daemon) and not alive(driver)
    (restart,) = run.events("restart")
    assert restart["returncode"] == -signal.SIGKILL


def test_abandoned_checkpoints_stay_on_their_file_system_when_the_run_folder_is_on_another(tmp_path, small_fs):
    # the run folder on a 2 MB tmpfs, the checkpoints on the test's disk: a rename across them is EXDEV
    # (saved every 2 steps: global_step_10 is written before step 11's NaN is logged, so it is always there)
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "hang_at": {"1": 16}, "pad_checkpoints": 3 * 2**20},
              steps=20, save_freq=2, run_dir=small_fs("runfs") / "guard")
    res = run.guard()
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    (moved,) = run.events("set_aside")
    local = run.ckpt / "lrstab_abandoned" / "guard" / "attempt-1"
    # the first launch's folders after 8 went beside the checkpoints (a rename: nothing copied); the run folder links them
    assert "global_step_10" in moved["moved"]
    assert moved["moved"] == {name: str(local / name) for name in moved["moved"]}
    for name in moved["moved"]:
        assert written_by(local / name) == {f"launch 1 step {name.split('_')[-1]}"}
        assert (run.run_dir / "abandoned" / "attempt-1" / name).resolve() == local / name
    assert read_tracker(run.ckpt) == 20 and sorted(run.final()) == list(range(1, 21))


# -- a checkpoint that fails to load, as verl 0.9.1 reports it --------------------------------------
VERL_LOGS = Path(__file__).resolve().parent / "standin" / "verl_logs"


@pytest.mark.parametrize("trainer", ["v1", "v0"])
def test_verls_own_report_of_a_damaged_shard_is_a_failed_load_and_the_older_checkpoint_is_used(tmp_path, trainer):
    # the first launch (resume_mode=auto from the tracker, 8) prints what verl's real main_ppo printed
    # for a damaged model shard (recorded: tests/e2e/test_guard_e2e.py's slow test makes it)
    run = Run(tmp_path, {"fail_resume": [8], "fail_log": str(VERL_LOGS / f"{trainer}_damaged_model_shard.log")},
              steps=12)
    plain_run(run, 8)
    res = run.guard()
    assert res.returncode == 0, res.stderr
    (failed,) = run.events("resume_failed")
    assert (failed["checkpoint_step"], failed["next_checkpoint"]) == (8, 4)
    assert "UnpicklingError" in Path(failed["log"]).read_text()  # that launch's log is kept, not reused
    assert sorted(run.final()) == list(range(5, 13))
    (moved,) = run.events("set_aside")
    assert written_by(Path(moved["moved"]["global_step_8"])) == {"launch 1 step 8"}  # kept as it was
    assert written_by(run.ckpt / "global_step_8") == {"launch 3 step 8"}
