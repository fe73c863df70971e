"""``lrstab guard`` driven through its real CLI around a stand-in verl child: the guard's own death, its
own I/O faults, the run folder's lock, checkpoints that fail to load, verl's crashes, repeated trouble.

The child (tests/standin/main_ppo.py) writes verl's file-logger lines and checkpoint layout and
follows verl 0.9.1's resume; what goes wrong in it is scripted per test. Each test takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_lrstab.guard.plan import checkpoint_complete, checkpoint_steps, read_tracker
from verl_lrstab.runs import read_metrics

STANDIN = Path(__file__).resolve().parent / "standin" / "python"
LR0 = 1e-3


def expected_scale(update: int, start: int, period: int) -> float:
    """The documented rule: the first update after ``start`` at 0.5, one more halving every ``period``; floor 0.1."""
    n = 0 if update <= start else 1 + (update - start - 1) // period
    return 1.0 if n == 0 else max(0.1, 0.5 ** n)


class Run:
    def __init__(self, tmp_path: Path, script: dict, steps=20, save_freq=4, extra=(), ckpt=None, run_dir=None,
                 step_s=None):
        self.dir = tmp_path
        self.ckpt = Path(ckpt or tmp_path / "ckpt")
        self.run_dir = Path(run_dir or tmp_path / "guard")
        (tmp_path / "script.json").write_text(json.dumps(script))
        self.env = {**os.environ, "STANDIN_PYTHON": sys.executable, "STANDIN_SCRIPT": str(tmp_path / "script.json"),
                    "STANDIN_COUNTER": str(tmp_path / "launches.txt"), "STANDIN_PIDS": str(tmp_path / "pids.txt")}
        if step_s is not None:
            self.env["STANDIN_STEP_S"] = str(step_s)
        self.command = [str(STANDIN), "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                        f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq}",
                        f"trainer.default_local_dir={self.ckpt}", f"actor_rollout_ref.actor.optim.lr={LR0}",
                        "trainer.logger=[console,file]", *extra]

    def guard(self, *options, command=None, timeout=120):
        cmd = [sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(self.run_dir), *options]
        if command is not False:
            cmd += ["--", *(command or self.command)]
        return subprocess.run(cmd, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=timeout)

    def events(self, kind=None):
        es = [json.loads(line) for line in (self.run_dir / "lrstab_events.jsonl").read_text().splitlines()]
        return [e for e in es if kind is None or e["event"] == kind]

    def final(self):
        return read_metrics(self.run_dir / "metrics.jsonl")

    def launches(self):
        return int((self.dir / "launches.txt").read_text())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- (1) the guard's own death ----------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_killing_the_guard_stops_verl_and_its_daemons_within_seconds(tmp_path, sig):
    run = Run(tmp_path, {"hang_at": {"1": 1}, "daemon": True})
    proc = subprocess.Popen([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run.run_dir), "--",
                             *run.command], cwd=tmp_path, env=run.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids_file = tmp_path / "pids.txt"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(pids_file.read_text().split() if pids_file.exists() else []) < 2:
        time.sleep(0.2)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)  # verl's driver and a daemon in its own session
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]
    if sig != signal.SIGKILL:  # a signal the guard can see: it says so, with 128 + N
        assert proc.returncode == 128 + sig
        (stopped,) = run.events("stopped")
        assert stopped["signal"] == sig.name and stopped["status"] == 128 + sig


def start_guard(run: Run, *options, stderr=subprocess.DEVNULL):
    return subprocess.Popen([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run.run_dir), *options,
                             "--", *run.command], cwd=run.dir, env=run.env, stdout=subprocess.DEVNULL,
                            stderr=stderr, text=True)


def wait_for(predicate, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_killed_guard_resumes_on_the_same_lr_rule_without_reusing_folders(tmp_path):
    # NaN at steps 10, 11 -> rollback 1 to step 8; the resumed segment (launch 2) stops at step 17, the guard is SIGKILLed
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "hang_at": {"2": 17}}, steps=24)
    proc = start_guard(run)
    assert wait_for(lambda: run.launches() == 2 if (tmp_path / "launches.txt").exists() else False)
    seg = lambda: run.run_dir / f"segment-{len(list(run.run_dir.glob('segment-*.log')))}.jsonl"  # noqa: E731
    assert wait_for(lambda: 17 in read_metrics(seg()))
    proc.kill()
    proc.wait(timeout=30)
    (rb,) = run.events("rollback")
    state = json.loads((run.run_dir / "guard_state.json").read_text())
    assert state["status"] == "running" and state["attempt"] == 1
    assert state["rules"][0]["decay_from_step"] == rb["decay_from_step"]
    segments_before = {p.name for p in run.run_dir.glob("segment-*")}
    attempts_before = {p.name for p in (run.run_dir / "abandoned").iterdir()}
    again = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                           cwd=tmp_path, env=run.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    (resumed,) = run.events("resumed")
    assert resumed["checkpoint_step"] == 16 and resumed["attempt"] == 1
    assert segments_before < {p.name for p in run.run_dir.glob("segment-*")}  # old segments kept, a new one added
    assert attempts_before <= {p.name for p in (run.run_dir / "abandoned").iterdir()}
    assert not run.events("rollback")[1:]  # no new rollback, no new attempt folder
    final = run.final()
    assert sorted(final) == list(range(1, 25))
    for u in range(rb["checkpoint_step"] + 1, 25):  # the same LR rule across the guard's death
        assert final[u]["actor/lr"] == pytest.approx(LR0 * expected_scale(u, rb["decay_from_step"], rb["decay_period"]))
    assert final[rb["checkpoint_step"] + 1]["actor/lr"] == pytest.approx(LR0 * 0.5)


def test_rerunning_with_the_same_run_dir_continues_a_running_run_and_refuses_a_finished_one(tmp_path):
    run = Run(tmp_path, {})
    assert run.guard().returncode == 0
    again = run.guard()
    assert again.returncode == 2 and "already ended (done)" in again.stderr


def test_the_same_command_again_continues_a_killed_guards_run_another_command_is_refused(tmp_path):
    # the first launch stops at step 9 (checkpoints at 4 and 8); the guard is SIGKILLed there
    run = Run(tmp_path, {"hang_at": {"1": 9}}, steps=12)
    proc = start_guard(run)
    assert wait_for(lambda: (run.run_dir / "segment-1.jsonl").exists() and 9 in read_metrics(run.run_dir / "segment-1.jsonl"))
    proc.kill()
    proc.wait(timeout=30)
    other = run.guard(command=[*run.command, "trainer.total_training_steps=13"])
    assert other.returncode == 2 and "holds another command's guarded run" in other.stderr
    again = run.guard()  # the same command line, no --resume: continues from the newest complete checkpoint
    assert again.returncode == 0, again.stderr
    (resumed,) = run.events("resumed")
    assert resumed["checkpoint_step"] == 8
    assert sorted(run.final()) == list(range(1, 13))
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "done"


def test_the_tracker_is_rewritten_atomically(tmp_path, monkeypatch):
    from verl_lrstab.guard import files, plan

    plan.write_tracker(tmp_path, 8)
    assert read_tracker(tmp_path) == 8

    def killed_before_the_rename(src, dst):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(files.os, "replace", killed_before_the_rename)  # the rename write_atomic ends with
    with pytest.raises(KeyboardInterrupt):
        plan.write_tracker(tmp_path, 4)
    # what verl's `auto` resume reads is the old step, never an empty or half-written file
    assert read_tracker(tmp_path) == 8
    monkeypatch.undo()
    plan.write_tracker(tmp_path, 4)
    assert read_tracker(tmp_path) == 4
    assert [p.name for p in tmp_path.iterdir()] == [plan.TRACKER]  # no temporary file left beside it


def test_resume_mode_disable_is_respected_and_refused_over_old_checkpoints(tmp_path):
    run = Run(tmp_path, {}, extra=["trainer.resume_mode=disable"])
    first = run.guard()
    assert first.returncode == 0, first.stderr
    log = (run.run_dir / "segment-1.log").read_text().splitlines()[0]
    assert "trainer.resume_mode=disable" in log  # the user's setting reaches verl on the first launch
    run.run_dir = tmp_path / "guard2"
    second = run.guard()
    assert second.returncode == 2 and "trainer.resume_mode=disable with checkpoints already in" in second.stderr


# -- (2) checkpoints verl finished, failed resumes, verl's crashes -----------------------------------
def test_a_checkpoint_counts_only_once_verl_finished_writing_it(tmp_path):
    ck = tmp_path
    for step in (4, 8):
        actor = ck / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True)
        for r in range(2):
            for p in ("model", "optim", "extra_state"):
                (actor / f"{p}_world_size_2_rank_{r}.pt").write_bytes(b"x")
        (actor / "fsdp_config.json").write_text('{"world_size": 2}')
        (ck / f"global_step_{step}" / "data.pt").write_bytes(b"x")
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    assert checkpoint_steps(ck) == [4]  # step 8's tracker was not written yet
    (ck / "latest_checkpointed_iteration.txt").write_text("8")
    assert checkpoint_steps(ck) == [4, 8]
    (ck / "global_step_8" / "actor" / "optim_world_size_2_rank_1.pt").unlink()  # rank 1 did not finish
    assert checkpoint_steps(ck) == [4]
    (ck / "global_step_4" / "data.pt").unlink()
    assert not checkpoint_complete(ck / "global_step_4", tracker=8)
    (ck / "global_step_12" / "actor").mkdir(parents=True)  # verl's first mkdir, before any shard
    assert checkpoint_steps(ck) == []
    # a node-local folder: rank 1's shards here, rank 0 (and its fsdp_config.json) on another node
    actor = ck / "global_step_12" / "actor"
    for p in ("model", "optim", "extra_state"):
        (actor / f"{p}_world_size_2_rank_1.pt").write_bytes(b"x")
    (ck / "global_step_12" / "data.pt").write_bytes(b"x")
    (ck / "latest_checkpointed_iteration.txt").write_text("12")
    assert checkpoint_steps(ck) == []


def test_a_crash_midway_through_a_save_restarts_from_the_last_complete_checkpoint(tmp_path):
    run = Run(tmp_path, {"partial_save_at": {"1": 12}})
    res = run.guard()
    assert res.returncode == 0, res.stderr
    (restart,) = run.events("restart")
    assert restart["checkpoint_step"] == 8 and restart["restarts"] == 1  # not the half-written step 12
    assert (run.run_dir / "abandoned" / "restart-1" / "global_step_12").is_dir()  # set aside, not deleted
    assert sorted(run.final()) == list(range(1, 21)) and read_tracker(run.ckpt) == 20


def test_a_verl_crash_is_restarted_up_to_max_restarts_then_fails(tmp_path):
    run = Run(tmp_path, {"crash_at": {"1": 11, "2": 14}})
    res = run.guard("--max-restarts", "1")
    assert res.returncode == 4 and "verl exited with status 1" in res.stderr
    assert [e["checkpoint_step"] for e in run.events("restart")] == [8] and run.events("failed")
    (tmp_path / "b").mkdir()
    run2 = Run(tmp_path / "b", {"crash_at": {"1": 11, "2": 14}})
    res = run2.guard("--max-restarts", "2")
    assert res.returncode == 0, res.stderr
    assert [e["checkpoint_step"] for e in run2.events("restart")] == [8, 12] and sorted(run2.final()) == list(range(1, 21))


def test_a_checkpoint_that_fails_to_load_is_replaced_by_the_next_older_one(tmp_path):
    run = Run(tmp_path, {"nan_at": {"1": [11, 12]}, "fail_resume": [8]}, steps=24)
    res = run.guard()
    assert res.returncode == 0, res.stderr
    rb = run.events("rollback")[0]
    assert rb["checkpoint_step"] == 8
    (failed,) = run.events("resume_failed")
    assert failed["checkpoint_step"] == 8 and failed["next_checkpoint"] == 4
    final = run.final()
    assert sorted(final) == list(range(1, 25))
    assert final[5]["actor/lr"] == pytest.approx(LR0 * 0.5)  # the decay starts at the older checkpoint
    assert all(final[u]["actor/lr"] == pytest.approx(LR0) for u in range(1, 5))


def test_failed_resumes_are_bounded(tmp_path):
    run = Run(tmp_path, {"nan_at": {"1": [15, 16]}, "fail_resume": [4, 8, 12]}, steps=24)
    res = run.guard("--max-resume-tries", "2", "--max-restarts", "0")
    assert res.returncode == 4
    assert [e["checkpoint_step"] for e in run.events("resume_failed")] == [12, 8]


# -- (3) repeated trouble ----------------------------------------------------------------------------
def test_a_second_rollback_compounds_and_skip_batches_moves_past_the_bad_batches(tmp_path):
    # batches 9 and 10 give NaN (steps 10-11 of the first launch): verl's dataloader replays them from
    # the checkpoint at step 8, so without --skip-batches the NaN recurs and the guard rolls back again
    run = Run(tmp_path, {"nan_batches": [9, 10]}, steps=24)
    res = run.guard("--max-rollbacks", "2")
    assert res.returncode == 3, res.stderr  # replayed twice, then gave up
    first, second = run.events("rollback")
    assert first["checkpoint_step"] == second["checkpoint_step"] == 8
    # the segments abandoned at rollback 1 (the first launch) and 2 (the launch after rollback 1), then the final one
    launch1, launch2 = (read_metrics(Path(rb["abandoned_metrics"])) for rb in (first, second))
    launch3 = run.final()
    assert launch1[8]["actor/lr"] == pytest.approx(LR0)  # the LR in force at the checkpoint
    assert launch2[9]["actor/lr"] == pytest.approx(0.5 * LR0)  # rollback 1: x gamma
    assert launch3[9]["actor/lr"] == pytest.approx(0.25 * LR0)  # rollback 2 to the same point: below rollback 1's

    run2_dir = tmp_path / "skip"
    run2_dir.mkdir()
    run2 = Run(run2_dir, {"nan_batches": [9, 10]}, steps=24)
    res = run2.guard("--skip-batches", "4")
    assert res.returncode == 0, res.stderr
    (rb,) = run2.events("rollback")
    final = run2.final()
    assert final[9]["data/batch_index"] == 8 + 4  # the resumed run starts 4 batches past the checkpoint's position
    assert all(final[s]["actor/grad_norm"] == 1.0 for s in range(9, 25))


def test_a_second_rollback_after_a_later_checkpoint_is_below_the_lr_in_force_there(tmp_path):
    # rollback 1 at step 8 (NaN at 10-11); the rule halves from 9, then every 18; rollback 2 (NaN at 22-23 of
    # launch 2) to the checkpoint at 20, where the LR in force is 0.5 x: the next update runs at <= 0.25 x
    run = Run(tmp_path, {"nan_at": {"1": [10, 11], "2": [22, 23]}}, steps=30)
    res = run.guard()
    assert res.returncode == 0, res.stderr
    first, second = run.events("rollback")
    assert (first["checkpoint_step"], second["checkpoint_step"]) == (8, 20)
    final = run.final()
    in_force = final[20]["actor/lr"]
    assert in_force == pytest.approx(LR0 * expected_scale(20, first["decay_from_step"], first["decay_period"]))
    assert final[21]["actor/lr"] <= 0.5 * in_force * (1 + 1e-9)
    assert final[21]["actor/lr"] < in_force


def test_one_non_finite_step_is_verls_skipped_update_two_roll_back(tmp_path):
    run = Run(tmp_path, {"nan_at": {"1": [10]}})
    assert run.guard().returncode == 0 and not run.events("rollback")
    run2_dir = tmp_path / "two"
    run2_dir.mkdir()
    run2 = Run(run2_dir, {"nan_at": {"1": [10]}})
    assert run2.guard("--non-finite-steps", "1").returncode == 0
    (rb,) = run2.events("rollback")
    assert rb["reason"] == "non_finite" and rb["onset_step"] == 10 and rb["checkpoint_step"] == 8


def test_a_plus_minus_one_reward_whose_accuracy_falls_is_a_crash(tmp_path):
    # accuracy 0.44 -> 0.05 from step 10: the score -0.12 -> -0.9, never positive
    run = Run(tmp_path, {"score": "pm1"}, steps=24)
    res = run.guard("--max-rollbacks", "0")
    assert res.returncode == 3
    (crash,) = run.events("reward_crash")
    assert 10 <= crash["step"] <= 14 and crash["onset_step"] < 10


def test_remote_checkpoints_are_refused_with_a_message(tmp_path):
    run = Run(tmp_path, {}, extra=["trainer.default_hdfs_dir=hdfs://x/ckpt"])
    res = run.guard()
    assert res.returncode == 2 and "trainer.default_hdfs_dir=hdfs://x/ckpt" in res.stderr
    assert not (tmp_path / "launches.txt").exists()  # refused before verl starts


# -- (4) the guard's own faults: a full or read-only disk, a second guard, a damaged state ----------
def free(folder: Path):
    for f in folder.glob("filler-*.bin"):
        f.unlink()


def no_temporary_files(*folders):
    return [p for folder in folders for p in folder.rglob("*") if "lrstab-tmp" in p.name or p.name.endswith(".tmp")]


def assert_resumes_with_the_rollback(run, launches_before=None):
    again = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                           cwd=run.dir, env=run.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    (rb,) = run.events("rollback")
    final = run.final()
    assert sorted(final) == list(range(1, 21))
    assert final[rb["checkpoint_step"] + 1]["actor/lr"] == pytest.approx(LR0 * 0.5)
    assert all(final[u]["actor/lr"] == pytest.approx(LR0) for u in range(1, rb["checkpoint_step"] + 1))
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "done"


def test_a_full_checkpoint_disk_ends_the_guard_with_status_5_and_resume_continues(tmp_path, small_fs):
    disk = small_fs("ckdisk")
    # NaN at steps 10-11 -> rollback to 8; after step 10 the checkpoint disk is full: the tracker rewrite fails
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "hang_at": {"1": 11}, "fill_at": {"1": [10, str(disk)]}},
              ckpt=disk / "ckpt")
    res = run.guard()
    assert res.returncode == 5, res.stderr
    tracker = run.ckpt / "latest_checkpointed_iteration.txt"
    assert f"cannot rewrite verl's tracker {tracker}: No space left on device (ENOSPC)" in res.stderr
    assert res.stderr.count("error:") == 1 and "Traceback" not in res.stderr
    failed = run.events()[-1]
    assert failed["event"] == "failed" and failed["cause"] == "guard_io" and failed["path"] == str(tracker)
    state = json.loads((run.run_dir / "guard_state.json").read_text())
    assert state["status"] == "running" and state["pending"]["checkpoint_step"] == 8  # the decision, kept
    assert read_tracker(run.ckpt) == 8  # verl's own, untouched (the rewrite failed before its rename)
    assert not no_temporary_files(run.ckpt, run.run_dir)
    free(disk)
    assert_resumes_with_the_rollback(run)


def test_a_read_only_checkpoint_disk_ends_the_guard_with_status_5_and_resume_continues(tmp_path, small_fs):
    disk = small_fs("ckdisk")
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "hang_at": {"1": 11}}, ckpt=disk / "ckpt", step_s=0.3)
    proc = start_guard(run, stderr=subprocess.PIPE)
    seg = run.run_dir / "segment-1.jsonl"
    assert wait_for(lambda: 9 in read_metrics(seg), timeout=90)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, err
    assert "Read-only file system (EROFS)" in err and str(run.ckpt) in err and err.count("error:") == 1
    assert run.events()[-1]["event"] == "failed"
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "running"
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    assert not no_temporary_files(run.ckpt, run.run_dir)
    assert_resumes_with_the_rollback(run)


def test_a_full_run_folder_after_training_ends_with_status_5_and_resume_writes_the_result(tmp_path, small_fs):
    disk = small_fs("rundisk")
    run = Run(tmp_path, {"fill_run_dir_at": {"1": 20}}, run_dir=disk / "guard")
    res = run.guard()
    assert res.returncode == 5, res.stderr
    assert f"cannot write the final metrics {run.run_dir / 'metrics.jsonl'}: No space left on device" in res.stderr
    assert json.loads((run.run_dir / "guard_state.json").read_text())["status"] == "running"
    assert not no_temporary_files(run.run_dir) and not (run.run_dir / "metrics.jsonl").exists()
    for f in run.run_dir.glob("filler-*.bin"):
        f.unlink()
    again = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                           cwd=run.dir, env=run.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert run.launches() == 1  # verl had finished: the result is written, nothing is trained again
    assert sorted(run.final()) == list(range(1, 21)) and run.events()[-1]["event"] == "done"


def test_a_second_guard_on_the_same_run_folder_is_refused_naming_the_first(tmp_path):
    run = Run(tmp_path, {"hang_at": {"1": 5}})
    proc = start_guard(run)
    try:
        assert wait_for(lambda: (run.run_dir / "segment-1.jsonl").exists()
                        and 5 in read_metrics(run.run_dir / "segment-1.jsonl"))
        for command in (None, [*run.command, "trainer.total_training_steps=13"]):  # the same command or not
            second = run.guard(command=command)
            assert second.returncode == 2 and f"another lrstab guard (pid {proc.pid}) is running" in second.stderr
        resume = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                                cwd=tmp_path, env=run.env, capture_output=True, text=True, timeout=120)
        assert resume.returncode == 2 and f"pid {proc.pid}" in resume.stderr
        assert run.launches() == 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # the killed guard's lock does not block --resume (the kernel dropped it once its verl was stopped)
    assert wait_for(lambda: not any(alive(int(p)) for p in (tmp_path / "pids.txt").read_text().split()), timeout=30)
    (tmp_path / "script.json").write_text("{}")
    again = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                           cwd=tmp_path, env=run.env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert sorted(run.final()) == list(range(1, 21))


@pytest.mark.parametrize("damage,message", [
    (lambda st: st.pop("rules"), "the key 'rules' is missing"),
    (lambda st: st.update(attempt=-1), "the key 'attempt' is -1, expected an integer >= 0"),
    (lambda st: st.update(segments=[["a"]]), "the key 'segments[0]' is ['a'], expected a list [text, an integer]"),
    (lambda st: st["rules"].append({"checkpoint_step": 8}), "the key 'rules[0].decay_from_step' is missing"),
])
def test_a_damaged_guard_state_is_refused_naming_the_file_and_key(tmp_path, damage, message):
    run = Run(tmp_path, {"hang_at": {"1": 5}})
    proc = start_guard(run)
    assert wait_for(lambda: (run.run_dir / "segment-1.jsonl").exists()
                    and 5 in read_metrics(run.run_dir / "segment-1.jsonl"))
    proc.kill()
    proc.wait(timeout=30)
    path = run.run_dir / "guard_state.json"
    state = json.loads(path.read_text())
    damage(state)
    path.write_text(json.dumps(state))
    res = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--resume", str(run.run_dir)],
                         cwd=tmp_path, env=run.env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"{path}: {message}" in res.stderr and "Traceback" not in res.stderr


# -- (5) blame what failed ---------------------------------------------------------------------------
def test_a_crash_at_the_first_step_after_a_resume_does_not_blame_the_checkpoint(tmp_path):
    # verl dies at step 7 on every launch (checkpoints every 2 steps): after the restart from 6 it dies
    # before logging, but after the load finished: 6 is not marked bad, nothing walks back to 4
    run = Run(tmp_path, {"crash_at": {"1": 7, "2": 7}}, save_freq=2)
    res = run.guard("--max-restarts", "1")
    assert res.returncode == 4, res.stderr
    assert not run.events("resume_failed")
    assert [e["checkpoint_step"] for e in run.events("restart")] == [6]
    state = json.loads((run.run_dir / "guard_state.json").read_text())
    assert state["bad_checkpoints"] == [] and checkpoint_steps(run.ckpt) == [2, 4, 6]
    assert not (run.run_dir / "abandoned" / "incomplete").exists()


def test_a_load_killed_midway_blames_the_checkpoint(tmp_path):
    run = Run(tmp_path, {"crash_at": {"1": 11}, "die_loading": [8]})
    res = run.guard("--max-restarts", "1")
    assert res.returncode == 0, res.stderr
    (failed,) = run.events("resume_failed")
    assert failed["checkpoint_step"] == 8 and failed["next_checkpoint"] == 4
    assert sorted(run.final()) == list(range(1, 21))


def test_a_stale_tracker_gets_a_warning_naming_both_steps(tmp_path):
    run = Run(tmp_path, {}, steps=12)
    seg = tmp_path / "plain.jsonl"
    plain = subprocess.run(run.command, cwd=tmp_path, env={**run.env, "VERL_FILE_LOGGER_PATH": str(seg)},
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert checkpoint_steps(run.ckpt) == [4, 8, 12]
    (run.ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    run.command = [*run.command[:-1], "trainer.total_training_steps=16", run.command[-1]]
    res = run.guard()
    assert res.returncode == 0, res.stderr
    assert "names step 4, but the checkpoint at step 12 has all its shards and data.pt" in res.stderr
    (stale,) = run.events("stale_tracker")
    assert (stale["tracker_step"], stale["newest_checkpoint"]) == (4, 12)


def test_giving_up_for_want_of_a_checkpoint_says_why(tmp_path):
    # the +-1 reward's score is flat until step 10: its peak (the crash's onset) is step 1, before any checkpoint
    run = Run(tmp_path, {"score": "pm1"}, steps=24)
    res = run.guard()
    assert res.returncode == 3
    assert re.search(r"no checkpoint at or before step -1 \(onset 1 - --margin 2\): the oldest is at step 4, the "
                     r"newest at step \d+", res.stderr), res.stderr
    assert "save_freq" not in res.stderr
