"""One guard per checkpoint folder, whatever its run folder: ``lrstab guard`` around the stand-in verl
with its lock files deleted, and with a second guard given another ``--run-dir`` on the same
``trainer.default_local_dir``. The checkpoints are checked by content (each shard names the launch
that wrote it): a second trainer would rewrite them."""

from __future__ import annotations

import json
import subprocess
import sys

from test_guard_faults import resume, written_by
from test_guard_supervisor import Run, alive, start_guard, wait_for
from verl_lrstab.guard.files import LOCK
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
        # the running guard took its deleted lock file anew: it names it again
        assert wait_for(lambda: json.loads((run.ckpt / LOCK_FILE).read_text() or "{}").get("pid") == proc.pid)
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
            import os

            assert busy.holder.get("pid") == os.getpid()  # the kernel names the holder when the file is gone
        else:
            second.release()
            raise AssertionError("a second lock on the checkpoint folder was granted")
    finally:
        first.release()
    CheckpointLock(tmp_path / "ck", tmp_path / "b").acquire().release()  # free once released
