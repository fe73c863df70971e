"""Edges of the guard's checkpoint handling around the stand-in verl: folders verl does not name
(``global_step_08``, ``global_step_011``), a ``global_step_N`` that is a mount point, the rollback
and set-aside events across a kill or a full disk, the status-5 message after a finished set-aside,
verl's output never read whole, a tracker that is a symlink."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc

import pytest

from test_guard_faults import plain_run, resume, written_by
from test_guard_supervisor import Run
from verl_lrstab.guard.files import GuardIOError
from verl_lrstab.guard.plan import (checkpoint_failed_to_load, log_failed_to_load, read_tracker, step_of,
                                    write_tracker)
from verl_lrstab.guard.supervisor import EventLog, Guard


def test_a_zero_padded_step_folder_is_a_users_copy_not_a_checkpoint(tmp_path):
    run = Run(tmp_path, {}, steps=12)
    plain_run(run, 8)
    shutil.copytree(run.ckpt / "global_step_8", run.ckpt / "global_step_08")
    shutil.copytree(run.ckpt / "global_step_8", run.ckpt / "global_step_011")
    assert step_of("global_step_08") is None and step_of("global_step_011") is None and step_of("global_step_0") == 0
    # resuming from the copy: refused naming verl's own name for that step, nothing moved or blamed
    res = run.guard(command=[*run.command, "trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={run.ckpt / 'global_step_08'}"])
    assert res.returncode == 2 and "global_step_8 (no leading zero)" in res.stderr, res.stderr
    assert not (run.run_dir / "abandoned").exists() and (run.ckpt / "global_step_08").is_dir()
    # from verl's tracker (step 8): global_step_011 is not step 11, so it is neither resumed from nor moved aside
    res = run.guard()
    assert res.returncode == 0, res.stderr
    assert sorted(run.final()) == list(range(9, 13)) and not run.events("resume_failed")  # from 8, as verl resumes
    assert written_by(run.ckpt / "global_step_011") == {"launch 1 step 8"}  # left alone, unrewritten


def test_a_step_folder_that_is_a_mount_point_is_refused_before_anything_moves(tmp_path, small_fs):
    run = Run(tmp_path, {}, steps=16)
    plain_run(run, 12)
    (run.ckpt / "latest_checkpointed_iteration.txt").write_text("8")  # verl resumes from 8: 12 must go aside
    saved = tmp_path / "saved12"
    shutil.copytree(run.ckpt / "global_step_12", saved)
    shutil.rmtree(run.ckpt / "global_step_12")
    mount = small_fs(os.path.relpath(run.ckpt / "global_step_12", tmp_path))  # the same checkpoint, on its own mount
    shutil.copytree(saved, mount, dirs_exist_ok=True)
    res = run.guard()
    assert res.returncode == 2, res.stderr
    assert f"{run.ckpt / 'global_step_12'} is a mount point" in res.stderr and "nothing was moved" in res.stderr
    assert read_tracker(run.ckpt) == 8 and written_by(mount) == {"launch 1 step 12"}
    assert run.launches() == 1  # verl was not started over it


def _fork_guard(run: Run, event: str, mode: str) -> int:
    """The guard in a forked child whose write of the first ``event`` event is SIGKILLed or fails (ENOSPC)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            real = EventLog.write

            def write(self, name, step, **fields):
                if name == event:
                    if mode == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise GuardIOError(f"append the {name!r} event to", self.path,
                                       OSError(errno.ENOSPC, "No space left on device (injected)"))
                return real(self, name, step, **fields)

            EventLog.write = write
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = Guard(run.command, run_dir=run.run_dir, env=run.env, cwd=run.dir, poll_s=0.2).run()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("mode", ["kill", "enospc"])
@pytest.mark.parametrize("event", ["rollback", "set_aside"])
def test_a_kill_or_full_disk_at_the_rollback_or_set_aside_event_loses_no_event(tmp_path, event, mode):
    # NaN at steps 13, 14 (verl stops there): rollback to step 8, global_step_12 set aside
    run = Run(tmp_path, {"nan_at": {"1": [13, 14]}, "hang_at": {"1": 14}})
    assert _fork_guard(run, event, mode) == (-signal.SIGKILL if mode == "kill" else 5)
    (tmp_path / "script.json").write_text("{}")
    res = resume(run)
    assert res.returncode == 0, res.stderr
    names = [e["event"] for e in run.events()]
    assert names.count("rollback") == 1 and names.count("set_aside") == 1, names
    (rb,) = run.events("rollback")
    (aside,) = run.events("set_aside")
    assert rb["checkpoint_step"] == 8 and sorted(aside["moved"]) == ["global_step_12"]
    assert sorted(run.final()) == list(range(1, 21))


def test_a_full_run_folder_after_a_rollback_does_not_say_no_checkpoint_was_moved(tmp_path, small_fs):
    disk = small_fs("rundisk")
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}, "fill_run_dir_at": {"2": 20}}, run_dir=disk / "guard")
    res = run.guard()
    assert res.returncode == 5, res.stderr
    assert run.events("rollback") and "moved no checkpoint" not in res.stderr
    assert "no checkpoint was being moved (verl's tracker names step 20" in res.stderr
    assert "set_aside events" in res.stderr


def test_verls_output_is_scanned_in_blocks_and_linked_not_copied(tmp_path):
    log = tmp_path / "segment-1.log"
    with open(log, "w") as f:
        f.write("Load from checkpoint folder: /c/global_step_8\n")
        for _ in range(300_000):  # 30 MB of verl's output
            f.write("x" * 99 + "\n")
        f.write("Traceback (most recent call last):\n  File \"ray_trainer.py\", line 1, in _load_checkpoint\n")
    tracemalloc.start()
    blamed = log_failed_to_load(log, block=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert blamed and peak < 8 * 2**20  # a few blocks, never the whole 30 MB
    assert checkpoint_failed_to_load(log.read_text())
    cut = log.read_text().index("in _load_checkpoint") + 8
    assert log_failed_to_load(log, block=cut)  # the traceback's line cut between two blocks is still read
    # the abandoned segment's log is the same file under a second name, not a copy
    (tmp_path / "r").mkdir()
    run = Run(tmp_path / "r", {"nan_at": {"1": [10, 11]}})
    assert run.guard().returncode == 0
    kept = run.run_dir / "abandoned" / "attempt-1" / "verl.log"
    assert os.stat(kept).st_ino == os.stat(run.run_dir / "segment-1.log").st_ino


def test_a_tracker_that_is_a_symlink_stays_one(tmp_path):
    shared = tmp_path / "shared" / "tracker.txt"
    shared.parent.mkdir()
    shared.write_text("12")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").symlink_to(shared)
    write_tracker(ck, 8)
    assert (ck / "latest_checkpointed_iteration.txt").is_symlink() and shared.read_text() == "8"
    assert read_tracker(ck) == 8
    assert not [p for p in shared.parent.iterdir() if p != shared]  # no temporary file left
