"""A rollback's moves cannot lose or overwrite a checkpoint: the guard is SIGKILLed, or a write fails
(ENOSPC), at each file operation of a rollback in turn; after each, verl's own
``find_latest_ckpt_path`` must name a complete checkpoint as the stand-in verl wrote it, every
checkpoint must still exist once, unrewritten, and finishing the journal (as ``--resume`` does)
must reach the decided end state.

The checkpoints are the stand-in verl's (tests/standin/main_ppo.py: verl 0.9.1's layout, each shard
naming the launch and step that wrote it). The guard's journal runs in a forked child (a real
SIGKILL: no cleanup code runs), with its file operations counted and the K-th one faulted.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from verl_lrstab.guard.plan import checkpoint_complete, read_tracker
from verl_lrstab.guard.run_state import load_state
from verl_lrstab.guard.supervisor import Guard

STANDIN = Path(__file__).resolve().parent / "standin"
STEPS, SAVE_FREQ, KEEP, SKIP = 14, 2, 8, 2  # checkpoints 2..14; the rollback keeps 8, moves 10, 12, 14 aside


def standin_env(tmp: Path) -> dict:
    return {**os.environ, "STANDIN_PYTHON": sys.executable, "STANDIN_COUNTER": str(tmp / "launches.txt")}


def command(ckpt: Path) -> list[str]:
    return [str(STANDIN / "python"), "-m", "verl.trainer.main_ppo", f"trainer.total_training_steps={STEPS}",
            f"trainer.save_freq={SAVE_FREQ}", f"trainer.default_local_dir={ckpt}", "trainer.logger=[console,file]"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The stand-in verl's checkpoints of one launch (steps 2..14, tracker 14) and its metrics."""
    root = tmp_path_factory.mktemp("pristine")
    env = {**standin_env(root), "VERL_FILE_LOGGER_PATH": str(root / "segment-1.jsonl")}
    res = subprocess.run(command(root / "ckpt"), cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return root


def written_by(folder: Path):
    """(launch, step) that wrote the checkpoint ``folder``, when every shard and data.pt agree; else None."""
    shards = {p.read_text() for p in (folder / "actor").glob("*_rank_*.pt")}
    data = torch.load(folder / "data.pt", weights_only=False)["written_by"]
    ok = len(shards) == 1 and shards == {f"launch {data[0]} step {data[1]}"}
    return tuple(data) if ok and checkpoint_complete(folder, check_tracker=False) else None


def copies(root: Path, step: int) -> list[Path]:
    """Every complete ``global_step_<step>`` under ``root`` (the checkpoint folder and the abandoned ones),
    links followed; partial copies (another name) are not checkpoints."""
    found = {p.resolve() for p in root.rglob(f"global_step_{step}") if p.is_dir()}
    return [p for p in found if written_by(p) is not None]


def make_case(pristine: Path, tmp: Path):
    """A fresh copy of the checkpoints and a guard whose state decides the rollback (kept: KEEP)."""
    shutil.copytree(pristine / "ckpt", tmp / "ckpt", symlinks=True)
    shutil.copy(pristine / "segment-1.jsonl", tmp / "segment-1.jsonl")
    guard = Guard(command(tmp / "ckpt"), run_dir=tmp / "guard", env=standin_env(tmp), cwd=tmp)
    guard.state = guard._new_state()
    dest = guard._fresh_dir("attempt", 1)
    guard.state.segments = [(str(dest / "metrics.jsonl"), 1)]  # as the supervisor decides a rollback
    guard.state.pending = guard._pending(KEEP, dest, segment=str(tmp / "segment-1.jsonl"), skip=SKIP)
    return guard


class Faults:
    """Counts the file operations that change something; at the ``at``-th one: SIGKILL or ENOSPC."""

    def __init__(self, at: int, mode: str, log: Path):
        self.at, self.mode, self.log, self.n = at, mode, log, 0

    def hit(self, what: str, path) -> None:
        self.n += 1
        with self.log.open("a") as f:  # (the log's own open is not counted: the patched names are called below)
            f.write(f"{self.n} {what} {path}\n")
        if self.n == self.at:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    def install(self) -> None:
        real = {name: getattr(os, name) for name in ("rename", "replace", "mkdir", "symlink", "unlink", "rmdir")}
        real_open = builtins.open
        log = str(self.log)

        def wrap(name):
            def op(src, *args, **kwargs):
                if not (name == "mkdir" and os.path.isdir(src)):  # a folder already there: nothing is written
                    self.hit(name, src)
                return real[name](src, *args, **kwargs)
            return op

        def opened(file, mode="r", *args, **kwargs):
            if str(file) != log and any(c in mode for c in "wax+"):
                self.hit("open", file)
            return real_open(file, mode, *args, **kwargs)

        for name in real:
            setattr(os, name, wrap(name))
        builtins.open = io.open = opened
        self.log.write_text("")


def run_journal(guard: Guard, at: int, mode: str, log: Path) -> int:
    """The guard's rollback (state saved with its decision, then the moves) in a forked child whose
    ``at``-th file operation fails (``mode`` "fail") or is SIGKILLed ("kill"; 0: no fault).
    Returns the child's status: 0 finished, 5 the guard's I/O error (message in ``log``.err), -9 killed."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            Faults(at, mode, log).install()
            guard._save()
            guard._finish_pending()
            code = 0
        except BaseException as err:  # noqa: BLE001
            from verl_lrstab.guard.files import GuardIOError

            if isinstance(err, GuardIOError):
                import contextlib

                with contextlib.redirect_stderr(open(str(log) + ".err", "w")):
                    code = guard._io_failed(err)
                    sys.stderr.flush()
            else:
                open(str(log) + ".err", "w").write(repr(err))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def assert_nothing_lost_or_rewritten(tmp: Path):
    ckpt = tmp / "ckpt"
    latest = find_latest_ckpt_path(str(ckpt))  # what verl's resume_mode=auto loads
    assert latest is not None and Path(latest).is_dir(), latest
    step = int(Path(latest).name.split("_")[-1])
    assert written_by(Path(latest)) == (1, step)  # complete, as launch 1 wrote it
    for s in range(SAVE_FREQ, STEPS + 1, SAVE_FREQ):  # each checkpoint exactly once, unrewritten
        found = copies(tmp, s)
        assert len(found) == 1 and written_by(found[0]) == (1, s), (s, found)


def assert_finished(tmp: Path, guard: Guard):
    ckpt = tmp / "ckpt"
    assert read_tracker(ckpt) == KEEP and find_latest_ckpt_path(str(ckpt)) == str(ckpt / f"global_step_{KEEP}")
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == [f"global_step_{s}" for s in range(2, KEEP + 1, 2)]
    dest = Path(json.loads((tmp / "guard" / "guard_state.json").read_text())["segments"][0][0]).parent
    for s in range(KEEP + SAVE_FREQ, STEPS + 1, SAVE_FREQ):
        assert written_by((dest / f"global_step_{s}").resolve()) == (1, s)
    data = torch.load(ckpt / f"global_step_{KEEP}" / "data.pt", weights_only=False)
    orig = torch.load(ckpt / f"global_step_{KEEP}" / "data.lrstab-orig.pt", weights_only=False)
    assert data["_num_yielded"] == orig["_num_yielded"] + SKIP == KEEP + SKIP  # moved on once, from the original
    assert (dest / "metrics.jsonl").is_file() and not (tmp / "segment-1.jsonl").exists()
    assert not [p for p in tmp.rglob("*") if "lrstab-tmp" in p.name or "lrstab-partial" in p.name]


def operations(pristine: Path, tmp: Path) -> list[str]:
    guard = make_case(pristine, tmp)
    try:
        assert run_journal(guard, 0, "count", tmp / "ops.txt") == 0
    finally:
        guard.release()
    assert_finished(tmp, guard)  # the fault-free journal reaches the decided state
    return (tmp / "ops.txt").read_text().splitlines()


@pytest.mark.parametrize("mode", ["kill", "fail"])
def test_a_fault_at_any_step_of_a_rollback_loses_and_rewrites_no_checkpoint(pristine, tmp_path, mode):
    ops = operations(pristine, tmp_path / "count")
    assert len(ops) >= 10, ops  # the state, the tracker, the segment, three folders, data.pt, the state again
    for at in range(1, len(ops) + 1):
        tmp = tmp_path / f"at-{at}"
        tmp.mkdir()
        guard = make_case(pristine, tmp)
        try:
            status = run_journal(guard, at, mode, tmp / "ops.txt")
            assert status == (-9 if mode == "kill" else 5), (at, ops[at - 1], status)
            assert_nothing_lost_or_rewritten(tmp)
            if mode == "fail":
                message = (tmp / "ops.txt.err").read_text()
                assert_message_is_truthful(message, tmp / "ckpt")
            # what --resume does: the state read back whole, the journal finished
            guard.state = load_state(tmp / "guard")
            if guard.state is None:  # killed before the decision was written whole: nothing was touched
                assert read_tracker(tmp / "ckpt") == STEPS and not (tmp / "guard" / "abandoned").exists()
                continue
            guard._finish_pending()
            assert guard.state.pending is None
            assert_nothing_lost_or_rewritten(tmp)
            assert_finished(tmp, guard)
        finally:
            guard.release()


def assert_message_is_truthful(message: str, ckpt: Path):
    assert "(ENOSPC)" in message and "as they were" not in message
    assert (f"names step {KEEP} (rewritten)" in message) == (read_tracker(ckpt) == KEEP), message
    for s in range(KEEP + SAVE_FREQ, STEPS + 1, SAVE_FREQ):
        name = f"global_step_{s}"
        if (ckpt / name).exists():  # still there: never said to be moved
            assert f"{name} ->" not in message, message
        else:  # moved: the message says where
            assert f"{name} ->" in message, message


def test_each_write_is_on_the_disk_before_the_next_step_relies_on_it(pristine, tmp_path, monkeypatch):
    """Power loss, which a SIGKILL above does not show: the page cache is lost too. The decision, then the
    tracker, then the moves, then the cleared decision: each reaches the disk (its data and its folder's
    entry, fsync) before the next is made."""
    guard = make_case(pristine, tmp_path)
    log: list = []
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace")}

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def renamer(name):
        def op(src, dst, *args, **kwargs):
            log.append((name, str(src), str(dst)))
            return real[name](src, dst, *args, **kwargs)
        return op

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renamer("rename"))
    monkeypatch.setattr(os, "replace", renamer("replace"))
    try:
        guard._save()
        guard._finish_pending()
    finally:
        guard.release()
    ckpt, run_dir, kept = str(tmp_path / "ckpt"), str(tmp_path / "guard"), tmp_path / "ckpt" / f"global_step_{KEEP}"

    def at(entry, after=-1):
        return next(i for i, e in enumerate(log) if i > after and e == entry)

    def first(pred, after=-1):
        return next(i for i, e in enumerate(log) if i > after and pred(e))

    state = str(tmp_path / "guard" / "guard_state.json")
    decided = first(lambda e: e[0] == "replace" and e[2] == state)
    tracker = first(lambda e: e[0] == "replace" and e[2] == f"{ckpt}/latest_checkpointed_iteration.txt")
    moves = [i for i, e in enumerate(log) if e[0] == "rename" and e[1].startswith(f"{ckpt}/global_step_")]
    cleared = first(lambda e: e[0] == "replace" and e[2] == state, after=tracker)
    assert len(moves) == (STEPS - KEEP) // SAVE_FREQ
    assert decided < at(("fsync", run_dir), decided) < tracker  # the decision durable before anything moves
    assert tracker < at(("fsync", ckpt), tracker) < moves[0]  # the tracker durable before a folder leaves
    assert moves[-1] < at(("fsync", ckpt), moves[-1]) < cleared  # the moves durable before verl is relaunched
    for name in ("data.lrstab-orig.pt", "data.pt"):  # --skip-batches: each file's data, then its name
        tmp = f"{kept}/.{name}.lrstab-tmp"
        swap = at(("replace", tmp, f"{kept}/{name}"))
        assert at(("fsync", tmp)) < swap < at(("fsync", str(kept)), swap) < cleared


def test_a_new_run_folder_is_refused_on_checkpoints_whose_set_aside_is_unfinished(pristine, tmp_path):
    from verl_lrstab.guard.plan import GuardError

    guard = make_case(pristine, tmp_path)  # a restart's set-aside: no LR rule, only the pending moves
    assert not guard.state.rules
    guard._save()
    guard.release()  # the guard died before the moves
    with pytest.raises(GuardError, match=r"the guarded run of .*guard \(running\) stopped midway through moving its "
                                         rf"checkpoints after step {KEEP} aside .*lrstab guard --resume .*guard"):
        Guard(command(tmp_path / "ckpt"), run_dir=tmp_path / "other", env=standin_env(tmp_path), cwd=tmp_path)
    assert read_tracker(tmp_path / "ckpt") == STEPS  # nothing touched
    again = Guard(command(tmp_path / "ckpt"), run_dir=tmp_path / "guard", env=standin_env(tmp_path), cwd=tmp_path)
    try:  # the run itself continues: its journal finishes
        again.state = load_state(tmp_path / "guard")
        again._finish_pending()
        assert_finished(tmp_path, again)
    finally:
        again.release()


def test_an_unfinished_from_scratch_set_aside_is_finished_by_resume_over_a_stale_tracker(pristine, tmp_path):
    from verl_lrstab.guard.plan import write_tracker

    shutil.copytree(pristine / "ckpt", tmp_path / "ckpt", symlinks=True)
    write_tracker(tmp_path / "ckpt", KEEP)  # stale: verl saved 10..14 and died before its tracker named them
    guard = Guard(command(tmp_path / "ckpt"), run_dir=tmp_path / "guard", env=standin_env(tmp_path), cwd=tmp_path)
    guard.state = guard._new_state()
    guard.state.pending = guard._pending(None, guard._fresh_dir("before-start"))  # --from-scratch
    moved = 0

    def killed_after_two_moves(src, dst):  # the guard dies after moving 2..KEEP aside (the tracker moves last)
        nonlocal moved
        if Path(src).name.startswith("global_step_") and moved == KEEP // SAVE_FREQ:
            raise KeyboardInterrupt
        moved += 1
        return real_rename(src, dst)

    real_rename = os.rename
    os.rename = killed_after_two_moves
    try:
        guard._save()
        with pytest.raises(KeyboardInterrupt):
            guard._finish_pending()
    finally:
        os.rename = real_rename
        guard.release()
    assert read_tracker(tmp_path / "ckpt") == KEEP and not (tmp_path / "ckpt" / f"global_step_{KEEP}").exists()
    again = Guard(command(tmp_path / "ckpt"), run_dir=tmp_path / "guard", env=standin_env(tmp_path), cwd=tmp_path)
    try:  # --resume finishes the decided set-aside: every folder aside, training from step 0
        again.state = load_state(tmp_path / "guard")
        assert again._continue({}) is None
        assert not list((tmp_path / "ckpt").glob("global_step_*")) and read_tracker(tmp_path / "ckpt") is None
        for s in range(SAVE_FREQ, STEPS + 1, SAVE_FREQ):  # each checkpoint exactly once, as launch 1 wrote it
            found = copies(tmp_path, s)
            assert len(found) == 1 and written_by(found[0]) == (1, s), (s, found)
    finally:
        again.release()
