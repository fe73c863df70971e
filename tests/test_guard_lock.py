"""One guard per checkpoint folder, whatever its run folder: ``lrstab guard`` around the stand-in verl
with its lock files deleted, and with a second guard given another ``--run-dir`` on the same
``trainer.default_local_dir``. The checkpoints are checked by content (each shard names the launch
that wrote it): a second trainer would rewrite them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_guard_faults import resume, written_by
from test_guard_supervisor import Run, alive, start_guard, wait_for
from verl_lrstab.guard.files import LOCK, RunDirBusy, lock_run_dir
from verl_lrstab.guard.lock import LOCK_FILE
from verl_lrstab.runs import read_metrics


def _stopped(run: Run, proc) -> None:
    proc.kill()
    proc.wait(timeout=30)
    assert wait_for(lambda: not any(alive(int(p)) for p in (run.dir / "pids.txt").read_text().split()), timeout=30)


def _hanging_at_step_9(tmp_path):
    run = Run(tmp_path, {"hang_at": {"1": 9}})
    proc = start_guard(run)
    assert wait_for(lambda: (run.run_dir / "segment-1.jsonl").exists()
                    and 9 in read_metrics(run.run_dir / "segment-1.jsonl"))
    return run, proc


def _checkpoints_of_launch_1(run: Run) -> None:
    assert run.launches() == 1  # no second trainer started
    for step in (4, 8):
        assert written_by(run.ckpt / f"global_step_{step}") == {f"launch 1 step {step}"}


def test_deleting_the_lock_files_does_not_let_a_second_guard_in(tmp_path):
    run, proc = _hanging_at_step_9(tmp_path)
    try:
        (run.run_dir / LOCK).unlink()  # a cleanup script, or a user who thinks them stale
        (run.ckpt / LOCK_FILE).unlink()
        for second in (run.guard(), resume(run)):  # the same command again, and --resume
            assert second.returncode == 2, second.stderr
            assert f"another lrstab guard (pid {proc.pid}" in second.stderr, second.stderr
        # the running guard took its deleted lock files anew: they name it again
        assert wait_for(lambda: json.loads((run.ckpt / LOCK_FILE).read_text() or "{}").get("pid") == proc.pid)
        assert wait_for(lambda: (run.run_dir / LOCK).exists() and (run.run_dir / LOCK).read_text().strip()
                        == str(proc.pid))
        _checkpoints_of_launch_1(run)
    finally:
        _stopped(run, proc)
    (tmp_path / "script.json").write_text("{}")
    again = resume(run)  # the killed guard's locks went with it
    assert again.returncode == 0, again.stderr
    assert sorted(run.final()) == list(range(1, 21))


def test_a_second_guard_with_another_run_folder_on_the_same_checkpoints_is_refused(tmp_path):
    run, proc = _hanging_at_step_9(tmp_path)
    try:
        other = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir",
                                str(tmp_path / "requeued"), "--", *run.command], cwd=tmp_path, env=run.env,
                               capture_output=True, text=True, timeout=120)
        assert other.returncode == 2, other.stderr
        assert (f"another lrstab guard (pid {proc.pid}, run folder {run.run_dir}) is running on these checkpoints"
                in other.stderr)
        assert f"trainer.default_local_dir={run.ckpt}" in other.stderr
        assert f"lrstab guard --resume {run.run_dir}" in other.stderr
        _checkpoints_of_launch_1(run)
    finally:
        _stopped(run, proc)


def test_the_checkpoint_folders_lock_is_the_folder_itself(tmp_path):
    # where the file system locks folders, the lock holds with no lock file at all
    from verl_lrstab.guard.lock import CheckpointLock, CheckpointsBusy

    first = CheckpointLock(tmp_path / "ck", tmp_path / "a").acquire()
    try:
        (tmp_path / "ck" / LOCK_FILE).unlink()
        second = CheckpointLock(tmp_path / "ck", tmp_path / "b")
        try:
            second.acquire()
        except CheckpointsBusy as busy:
            assert busy.holder.get("pid") == os.getpid()  # the kernel names the holder when the file is gone
        else:
            second.release()
            raise AssertionError("a second lock on the checkpoint folder was granted")
    finally:
        first.release()
    CheckpointLock(tmp_path / "ck", tmp_path / "b").acquire().release()  # free once released


def test_a_deleted_run_folder_lock_is_taken_anew_and_keeps_a_second_guard_out(tmp_path):
    held = lock_run_dir(tmp_path)
    assert lock_run_dir(tmp_path, held=held) == held  # still the file at the path: kept as it is
    (tmp_path / LOCK).unlink()  # a cleanup script; the guard's next poll:
    anew = lock_run_dir(tmp_path, held=held)
    try:
        assert anew != held and (tmp_path / LOCK).read_text().strip() == str(os.getpid())
        with pytest.raises(OSError):
            os.fstat(held)  # the stale descriptor is closed
        with pytest.raises(RunDirBusy) as busy:
            lock_run_dir(tmp_path)  # a second guard now
        assert busy.value.pid == os.getpid()
    finally:
        os.close(anew)


def test_a_run_folder_lock_taken_by_another_meanwhile_is_refused(tmp_path):
    held = lock_run_dir(tmp_path)
    (tmp_path / LOCK).unlink()
    other = lock_run_dir(tmp_path)  # another guard got in before the poll
    try:
        with pytest.raises(RunDirBusy):
            lock_run_dir(tmp_path, held=held)
        os.fstat(held)  # still open: the guard closes it when it ends
    finally:
        os.close(other)
        os.close(held)
