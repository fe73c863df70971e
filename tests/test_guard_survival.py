"""The guard outlives what is not training's fault: its own output channel closing (``| head`` gone, a
closed terminal), a transient read error on verl's metrics, the metrics file renamed or replaced while
watched. Each around the stand-in verl, with a NaN to roll back from: the trouble is still caught."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from test_guard_supervisor import Run, alive, wait_for
from verl_lrstab.guard.metrics import MetricsFile
from verl_lrstab.guard.supervisor import Guard
from verl_lrstab.runs import read_metrics


def test_a_closed_output_channel_does_not_stop_the_guard_midway(tmp_path):
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}})
    read, write = os.pipe()
    os.close(read)  # `lrstab guard ... | head` whose head is gone: every line the guard prints meets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run.run_dir), "--",
                               *run.command], cwd=tmp_path, env=run.env, stdout=write, stderr=write, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0
    assert [e["event"] for e in run.events()] == ["start", "non_finite", "rollback", "set_aside", "done"]
    assert sorted(run.final()) == list(range(1, 21))


def _guard(run: Run) -> Guard:
    return Guard(run.command, run_dir=run.run_dir, env=run.env, cwd=run.dir, poll_s=0.2)


def _eio_from(call: int, calls: int, monkeypatch, started=lambda: True):
    """``MetricsFile.read`` fails with EIO from its ``call``-th call on, ``calls`` times (calls counted once
    ``started()``: a loaded machine may start verl's stand-in after the guard's first reads)."""
    real, n = MetricsFile.read, [0]

    def read(self):
        n[0] += started()
        if call <= n[0] < call + calls:
            raise OSError(errno.EIO, "Input/output error (injected)", str(self.path))
        return real(self)

    monkeypatch.setattr(MetricsFile, "read", read)


def test_a_transient_read_error_is_retried_and_told(tmp_path, monkeypatch):
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}}, step_s=0.05)
    _eio_from(3, 2, monkeypatch)
    assert _guard(run).run() == 0
    (retried,) = run.events("read_retried")
    assert retried["tries"] == 3 and "Input/output error" in retried["error"]
    assert run.events("rollback") and sorted(run.final()) == list(range(1, 21))


def test_a_read_error_that_lasts_stops_verl_and_ends_with_status_5(tmp_path, monkeypatch):
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}}, step_s=0.05)
    _eio_from(3, 100, monkeypatch, started=lambda: (tmp_path / "pids.txt").exists())
    assert _guard(run).run() == 5
    failed = run.events()[-1]
    assert failed["event"] == "failed" and failed["operation"] == "read verl's metrics" and "(EIO)" in failed["error"]
    pids = [int(p) for p in (tmp_path / "pids.txt").read_text().split()]
    assert not any(os.path.exists(f"/proc/{p}/environ") and alive(p) for p in pids)  # verl was stopped


@pytest.mark.parametrize("how", ["renamed", "replaced"])
def test_a_metrics_file_renamed_or_replaced_while_watched_is_followed(tmp_path, how):
    run = Run(tmp_path, {"nan_at": {"1": [10, 11]}}, step_s=0.3)
    proc = subprocess.Popen([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run.run_dir), "--",
                             *run.command], cwd=tmp_path, env=run.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seg = run.run_dir / "segment-1.jsonl"
    assert wait_for(lambda: seg.exists() and 3 in read_metrics(seg), timeout=90)
    os.rename(seg, tmp_path / "tidied.jsonl")  # a user tidying up: verl goes on writing the renamed file
    if how == "replaced":
        seg.write_text("")  # and a new, empty file under the name
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert run.events("metrics_moved") and "renamed or replaced" in err
    (rb,) = run.events("rollback")  # the NaN verl wrote into the renamed file was caught
    assert rb["checkpoint_step"] == 8
    assert sorted(run.final()) == list(range(1, 21))
    abandoned = read_metrics(run.run_dir / "abandoned" / "attempt-1" / "metrics.jsonl")
    assert set(range(1, 12)) <= set(abandoned)  # the launch's lines put back under the name, then set aside
