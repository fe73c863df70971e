"""The guard's checks and file operations one at a time: the state file's keys, ``--skip-batches``
against ``data.pt``, a copy across file systems that fills its disk, the tracker's mode and group,
the events file's cut line, the busy message, and the smaller readers' edge cases."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from verl_lrstab.guard import moves
from verl_lrstab.guard.files import GuardIOError
from verl_lrstab.guard.plan import GuardError, GuardOptions, step_folders, step_of, write_tracker
from verl_lrstab.guard.run_state import STATE, GuardState, Rule, load_state

STANDIN = Path(__file__).resolve().parent / "standin"
GOOD = json.loads(GuardState.start(["python", "-m", "verl.trainer.main_ppo"], "/", GuardOptions()).to_json())
PENDING = {"checkpoint_step": 8, "scratch": False, "dest": "/x", "local": None, "segment": None, "skip_batches": 0,
           "events": []}
RULE = {"checkpoint_step": 8, "decay_from_step": 8, "decay_period": 18, "halvings": 0, "base_period": 18, "attempt": 1,
        "skip_batches": 0}


def state_error(tmp_path: Path, text: str) -> str:
    (tmp_path / STATE).write_text(text)
    with pytest.raises(GuardError) as err:
        load_state(tmp_path)
    return str(err.value)


def without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


@pytest.mark.parametrize("state,key", [
    ({**GOOD, "pending": "yes"}, "pending"),
    ({**GOOD, "pending": {"checkpoint_step": 8}}, "pending.scratch"),  # the first key missing, in the file's order
    ({**GOOD, "pending": {**PENDING, "dest": "relative/dir"}}, "pending.dest"),
    ({**GOOD, "pending": {**PENDING, "checkpoint_step": -1}}, "pending.checkpoint_step"),
    ({**GOOD, "pending": {**PENDING, "events": ["rollback"]}}, "pending.events[0]"),
    ({**GOOD, "pending": {**PENDING, "events": [{"step": 3}]}}, "pending.events[0].event"),
    ({**GOOD, "pending": {**PENDING, "local": "relative"}}, "pending.local"),
    ({**GOOD, "cwd": "/nonexistent/folder"}, "cwd"),
    ({**GOOD, "cwd": 3}, "cwd"),
    ({**GOOD, "segments": [["/", 1]]}, "segments[0]"),  # a folder where a metrics file goes
    ({**GOOD, "segments": [["rel.jsonl", 1]]}, "segments[0]"),
    ({**GOOD, "segments": [["/a.jsonl"]]}, "segments[0]"),
    ({**GOOD, "segments": [["/a.jsonl", "1"]]}, "segments[0][1]"),
    ({**GOOD, "options": ["max_rollbacks", 2]}, "options"),
    ({**GOOD, "options": {**GOOD["options"], "max_rollbackz": 2}}, "options.max_rollbackz"),
    ({**GOOD, "options": {"max_rollbacks": 2}}, "options.margin"),
    ({**GOOD, "options": {**GOOD["options"], "crash_fraction": "high"}}, "options.crash_fraction"),
    ({**GOOD, "options": {**GOOD["options"], "crash_fraction": 1.5}}, "options"),  # GuardOptions' own bound
    ({**GOOD, "options": {**GOOD["options"], "on_surge": "no"}}, "options.on_surge"),
    ({**GOOD, "after": True}, "after"),
    ({**GOOD, "attempt": -1}, "attempt"),
    ({**GOOD, "status": "paused"}, "status"),
    ({**GOOD, "resumed_at": "8"}, "resumed_at"),
    ({**GOOD, "bad_checkpoints": [8.0]}, "bad_checkpoints[0]"),
    ({**GOOD, "rules": [{"checkpoint_step": 8}]}, "rules[0].decay_from_step"),
    ({**GOOD, "rules": [{**RULE, "decay_period": 0}]}, "rules[0].decay_period"),
    ({**GOOD, "rules": [{**RULE, "halvings": 0.5}]}, "rules[0].halvings"),
    ({**GOOD, "surge": 3}, "surge"),  # a key the state does not have
    (without("pending"), "pending"),
    (without("resumed_at"), "resumed_at"),
    (without("version"), "version"),
    ({**GOOD, "version": 3}, "version"),  # another format: refused by its version, before its other keys
])
def test_every_state_key_is_checked_naming_the_file_and_the_key(tmp_path, state, key):
    message = state_error(tmp_path, json.dumps(state))
    assert message.startswith(f"{tmp_path / STATE}: the key {key!r}"), message


def test_a_state_nested_too_deeply_or_not_json_is_one_error(tmp_path):
    assert "nested too deeply" in state_error(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert str(tmp_path / STATE) in state_error(tmp_path, '{"status": ')
    assert "not a guard state" in state_error(tmp_path, "[1, 2]")
    assert "another format of lrstab's guard" in state_error(tmp_path, json.dumps({**GOOD, "version": 3, "new": 1}))
    (tmp_path / STATE).write_text(json.dumps(GOOD))
    assert load_state(tmp_path) == GuardState.start(GOOD["command"], "/", GuardOptions())  # the good one loads


def test_a_state_file_written_before_the_state_was_a_dataclass_is_read_and_written_back_the_same(tmp_path):
    # standin/guard_state.json: written by the guard whose state was a plain mapping (a rollback from step 11's NaN
    # to step 8, the guard killed in its second launch; then a rollback to step 12 journaled through that guard's own
    # _pending and _save), its folder replaced by @ROOT@. The format is the same: read, and written back byte for byte
    text = (STANDIN / "guard_state.json").read_text().replace("@ROOT@", str(tmp_path))
    (tmp_path / "guard").mkdir()
    (tmp_path / "guard" / STATE).write_text(text)
    state = load_state(tmp_path / "guard")
    assert state is not None and (state.status, state.attempt, state.after, state.resumed_at) == ("running", 1, 8, 8)
    assert state.options == GuardOptions()
    assert state.rules == [Rule(checkpoint_step=8, decay_from_step=8, decay_period=18, halvings=0, base_period=18,
                                attempt=1, skip_batches=0)]
    assert state.segments == [(str(tmp_path / "guard" / "abandoned" / "attempt-1" / "metrics.jsonl"), 1),
                              (str(tmp_path / "guard" / "segment-2.jsonl"), 9)]
    assert state.pending is not None and (state.pending.checkpoint_step, state.pending.scratch) == (12, False)
    assert state.pending.dest == str(tmp_path / "guard" / "abandoned" / "attempt-2")
    assert [e["event"] for e in state.pending.events] == ["rollback"]
    assert state.to_json() == text


def test_only_folders_named_exactly_as_verl_names_them_are_checkpoints(tmp_path):
    for name in ("global_step_4", "global_step_12", "best_global_step_60", "global_step_60.bak", "global_step_",
                 "global_step_x"):
        (tmp_path / name).mkdir()
    assert step_folders(tmp_path) == [4, 12]
    assert step_of("global_step_60") == 60 and step_of("best_global_step_60") is None


def save_data(folder: Path, yielded: int, samples: int):
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"_num_yielded": yielded, "_sampler_iter_yielded": yielded,
                "_sampler_iter_state": {"samples_yielded": samples}}, folder / "data.pt")


def test_skip_batches_moves_the_dataloader_from_the_kept_original_and_checks_data_pt_first(tmp_path):
    folder = tmp_path / "global_step_8"
    save_data(folder, 8, 32)  # 4 samples a batch
    moves.skip_batches(folder, 3)
    moves.skip_batches(folder, 3)  # a redone journal: from the original again, not 6 on
    state = torch.load(folder / "data.pt", weights_only=False)
    assert (state["_num_yielded"], state["_sampler_iter_state"]["samples_yielded"]) == (11, 44)
    # no batch yielded yet (an epoch's start): a batch is the run's data.train_batch_size
    save_data(tmp_path / "global_step_0", 0, 0)
    state = moves.skipped_data_state(tmp_path / "global_step_0", 2, batch_size=16)
    assert state["_sampler_iter_state"]["samples_yielded"] == 32 and state["_num_yielded"] == 2
    with pytest.raises(GuardError, match=r"global_step_0/data.pt has no batch yielded \(key _num_yielded"):
        moves.skipped_data_state(tmp_path / "global_step_0", 2, batch_size=None)
    (tmp_path / "global_step_2").mkdir()
    (tmp_path / "global_step_2" / "data.pt").write_bytes(b"damaged")
    with pytest.raises(GuardError, match=r"cannot read .*global_step_2/data.pt"):
        moves.skipped_data_state(tmp_path / "global_step_2", 2, batch_size=16)


@pytest.fixture
def tmpfs(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"needs a tmpfs (mount -t tmpfs, as root): {res.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_copy_across_file_systems_is_written_under_a_temporary_name_and_a_full_disk_says_enospc(tmp_path, tmpfs,
                                                                                                 monkeypatch):
    src = tmp_path / "ckpt" / "global_step_12"
    (src / "actor").mkdir(parents=True)
    (src / "actor" / "model.pt").write_bytes(os.urandom(3 * 2**20))  # 3 MB: more than the 1 MB disk
    (src / "actor" / "link").symlink_to("model.pt")
    real_rename = os.rename

    def rename(a, b):  # both renames cross a file system (a checkpoint folder that is itself a mount)
        if Path(a) == src:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(a, b)

    monkeypatch.setattr(moves.os, "rename", rename)
    dest, local = tmpfs / "attempt-1" / "global_step_12", tmp_path / "ckpt" / "lrstab_abandoned" / "global_step_12"
    with pytest.raises(GuardIOError) as err:
        moves.move_aside(src, dest, local)
    message = str(err.value)
    assert message == (f"cannot copy the checkpoint {src} to {dest}.lrstab-partial: No space left on device (ENOSPC)")
    assert not list(tmpfs.rglob("*.pt")) and not dest.exists()  # the partial copy removed: the disk is free again
    assert (src / "actor" / "model.pt").stat().st_size == 3 * 2**20  # the original untouched
    (src / "actor" / "model.pt").write_bytes(os.urandom(2**19))  # "space freed": now it fits
    assert moves.move_aside(src, dest, local) == dest
    assert not src.exists() and (dest / "actor" / "link").is_symlink() and (dest / "actor" / "model.pt").is_file()


def _checkpoint(folder: Path, text: str, age_s: float = 0.0) -> None:
    """A checkpoint folder of two shards and a link, its files ``age_s`` seconds old."""
    (folder / "actor").mkdir(parents=True)
    for rank in (0, 1):
        (folder / "actor" / f"model_world_size_2_rank_{rank}.pt").write_text(text)
    (folder / "actor" / "link").symlink_to("model_world_size_2_rank_0.pt")
    then = time.time() - age_s
    for f in (folder / "actor").glob("*.pt"):
        os.utime(f, (then, then))


def test_a_redone_move_removes_the_original_of_a_finished_copy_even_partly_removed(tmp_path):
    src, dest = tmp_path / "ck" / "global_step_12", tmp_path / "run" / "attempt-1" / "global_step_12"
    _checkpoint(src, "launch 1 step 12", age_s=3600)
    shutil.copytree(src, dest, symlinks=True)  # the copy renamed into place (copy2 keeps the times) ...
    (src / "actor" / "model_world_size_2_rank_1.pt").unlink()  # ... and the guard killed removing the original
    assert moves.move_aside(src, dest, tmp_path / "ck" / "lrstab_abandoned" / "global_step_12") == dest
    assert not src.exists() and sorted(p.name for p in (dest / "actor").iterdir()) == [
        "link", "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]


@pytest.mark.parametrize("text", ["launch 2 step 12", "launch 1 step 12"])  # the same sizes, even the same bytes
def test_a_folder_saved_again_where_one_was_moved_aside_is_refused_never_removed(tmp_path, text):
    src, dest = tmp_path / "ck" / "global_step_12", tmp_path / "run" / "attempt-1" / "global_step_12"
    _checkpoint(dest, "launch 1 step 12", age_s=3600)  # moved aside by a guard that was killed after
    _checkpoint(src, text)  # verl, resumed by hand, saved step 12 again
    with pytest.raises(GuardError, match=f"{src} and {dest} both exist and hold different files: global_step_12 "
                                         "was saved again after the guard moved the earlier one aside"):
        moves.move_aside(src, dest, tmp_path / "ck" / "lrstab_abandoned" / "global_step_12")
    assert (src / "actor" / "model_world_size_2_rank_1.pt").read_text() == text  # both kept whole
    assert (dest / "actor" / "model_world_size_2_rank_1.pt").read_text() == "launch 1 step 12"


def test_a_copy_is_on_the_disk_under_its_name_before_its_original_is_removed(tmp_path, monkeypatch):
    src, dest = tmp_path / "ck" / "global_step_12", tmp_path / "run" / "attempt-1" / "global_step_12"
    _checkpoint(src, "launch 1 step 12")
    log, real_rename, real_fsync, real_rmtree = [], os.rename, os.fsync, shutil.rmtree

    def rename(a, b):
        if Path(a) in (src, src.parent / "lrstab_abandoned" / src.name):  # the folder is a mount: no rename
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        log.append(("rename", Path(a).name, Path(b).name))
        return real_rename(a, b)

    monkeypatch.setattr(moves.os, "rename", rename)
    monkeypatch.setattr(moves.os, "fsync", lambda fd: log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))
                                                                   .name)) or real_fsync(fd))
    monkeypatch.setattr(moves.shutil, "rmtree", lambda p, *a, **k: log.append(("rmtree", Path(p).name))
                        or real_rmtree(p, *a, **k))
    assert moves.move_aside(src, dest, src.parent / "lrstab_abandoned" / src.name) == dest
    swap = log.index(("rename", "global_step_12.lrstab-partial", "global_step_12"))
    shards = [log.index(("fsync", f"model_world_size_2_rank_{r}.pt")) for r in (0, 1)]
    assert max(shards) < log.index(("fsync", "global_step_12.lrstab-partial")) < swap  # the copy's data and entries
    assert swap < log.index(("fsync", "attempt-1")) < log.index(("rmtree", "global_step_12"))  # then its name


def test_the_tracker_rewrite_keeps_its_mode_and_group(tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("12")
    group = next((g for g in (1, 2, 100) if g != os.getgid()), 1)
    os.chown(tracker, -1, group)
    os.chmod(tracker, 0o664)
    write_tracker(tmp_path, 8)
    st = os.stat(tracker)
    assert tracker.read_text() == "8" and (st.st_mode & 0o7777, st.st_gid) == (0o664, group)


def test_an_event_after_a_cut_line_starts_on_its_own_line_and_compare_skips_the_cut_one(tmp_path, caplog):
    from verl_lrstab.guard.supervisor import EventLog
    from verl_lrstab.runs import read_events

    path = tmp_path / "lrstab_events.jsonl"
    log = EventLog(path)
    log.write("start", 0)
    with open(path, "a") as f:
        f.write('{"event": "rollback", "step": 1')  # a guard killed mid-append
    log.write("resumed", 8)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        events = read_events(path)
    assert [e["event"] for e in events] == ["start", "resumed"]
    assert f"{path}:2: skipped" in caplog.text


def test_a_lock_held_by_a_process_that_is_not_a_guard_is_not_called_a_guard(tmp_path):
    from verl_lrstab.guard.files import LOCK

    run_dir = tmp_path / "guard"
    run_dir.mkdir()
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"1\n")  # pid 1: alive, not an lrstab guard
    try:
        res = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run_dir), "--",
                              "python", "-m", "verl.trainer.main_ppo", "trainer.save_freq=2",
                              "trainer.total_training_steps=8", f"trainer.default_local_dir={tmp_path / 'ck'}"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(fd)
    assert res.returncode == 2 and "another lrstab guard" not in res.stderr and "kill -TERM 1" not in res.stderr
    assert f"its lock ({run_dir / LOCK}) is held" in res.stderr


def test_a_scheduler_state_for_another_number_of_param_groups_or_with_options_not_a_mapping_is_refused():
    from verl_lrstab.config import LengthSurgeConfig
    from verl_lrstab.scheduler import LengthSurgeLR
    from verl_lrstab.scheduler_state_checks import SchedulerStateError

    def scheduler(groups):
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
        opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=1e-3)
        return LengthSurgeLR(opt, LengthSurgeConfig())

    state = scheduler(2).state_dict()
    with pytest.raises(SchedulerStateError, match=r"base_lrs=.*expected 1 learning rate\(s\), one per param group"):
        scheduler(1).load_state_dict(state)
    with pytest.raises(SchedulerStateError, match=r"options=\['gamma', 0.5\], expected a mapping"):
        scheduler(2).load_state_dict({**state, "options": ["gamma", 0.5]})
    scheduler(2).load_state_dict(state)  # the matching optimizer loads it

    # the guard reads the refusal, as Ray reports a worker's exception, as a checkpoint that failed to load
    from verl_lrstab.guard.plan import checkpoint_failed_to_load
    with pytest.raises(SchedulerStateError) as refused:
        scheduler(1).load_state_dict(state)
    line = f"ray.exceptions.RayTaskError({refused.type.__name__}): ray::WorkerDict.actor_rollout_load_checkpoint()"
    log = "\n".join(("Load from checkpoint folder: ckpt/global_step_4", "Traceback (most recent call last):", line,
                     str(refused.value)))
    assert checkpoint_failed_to_load(log)
    assert not checkpoint_failed_to_load(log.replace("SchedulerStateError", "ValueError"))  # the name is the sign


def test_a_constant_score_at_the_float_limit_is_no_reward_crash_and_a_fall_still_is():
    from verl_lrstab.reward_crash import reward_crash

    steps = range(1, 13)
    assert reward_crash(pd.Series([1e308] * 12, index=steps)) is None
    assert reward_crash(pd.Series([1.7e308] * 5 + [1e307] * 7, index=steps)) == (8, 1)
    assert reward_crash(pd.Series([1.0] * 5 + [0.1] * 7, index=steps)) == (8, 1)


@pytest.mark.parametrize("values", [[1.7e308, 1.0], [-1.7e308, 1.7e308]])
def test_compare_draws_lengths_at_the_float_limit(tmp_path, values):
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps({"step": s, "data": {"response_length/mean": values[s % 2],
                                                           "critic/score/mean": values[s % 2]}}) + "\n"
                           for s in range(1, 31)))
    res = subprocess.run([sys.executable, "-m", "verl_lrstab.cli", "compare", str(run), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (tmp_path / "out" / "length.png").stat().st_size > 5000


def test_guard_options_of_the_wrong_kind_name_the_option():
    for kwargs, name in (({"reseed": "yes"}, "reseed"), ({"crash_fraction": "0.5"}, "--crash-fraction"),
                         ({"max_rollbacks": True}, "--max-rollbacks"), ({"from_scratch": 1}, "from_scratch")):
        with pytest.raises(GuardError, match=name):
            GuardOptions(**kwargs)


def test_resume_is_refused_when_the_rollbacks_own_checkpoint_is_gone_and_no_later_one_is_complete(tmp_path):
    # the last rollback resumed verl from step 8; that folder is gone (a cleanup, a disk swap) and only step 4 is
    # left: continuing would resume from before the rollback, off its LR rule, so the guard refuses and moves nothing
    from verl_lrstab.config import LengthSurgeConfig
    from verl_lrstab.guard.plan import RunPlan
    from verl_lrstab.guard.preflight import resume_problem

    ck = tmp_path / "ckpts"
    (ck / "global_step_4").mkdir(parents=True)
    plan = RunPlan(checkpoint_dir=ck, save_freq=4, total_steps=40, keep=None, length_surge=LengthSurgeConfig(),
                   scheduler="length_surge", rollout_seed=None)
    state = GuardState.start(["python", "-m", "verl.trainer.main_ppo"], str(tmp_path), GuardOptions())
    state.after, state.rules = 8, [Rule(**RULE)]  # rolled back to step 8
    problem = resume_problem(plan, state, logged=10, complete=[4], run_dir=tmp_path / "run")
    assert problem is not None and str(ck / "global_step_8") in problem and "no later complete one" in problem
    assert "Nothing was changed" in problem and f"lrstab guard --resume {tmp_path / 'run'}" in problem
    assert sorted(p.name for p in ck.iterdir()) == ["global_step_4"]
    # a later complete checkpoint (verl saved past the rollback's step) is one to continue from
    assert resume_problem(plan, state, logged=14, complete=[4, 12], run_dir=tmp_path / "run") is None
    # before any rollback, a run that lost nothing it needs resumes as verl would
    fresh = GuardState.start(["python", "-m", "verl.trainer.main_ppo"], str(tmp_path), GuardOptions())
    assert resume_problem(plan, fresh, logged=6, complete=[4], run_dir=tmp_path / "run") is None
