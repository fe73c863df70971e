"""Setting checkpoints aside (a rollback's, a restart's, the unfinished saves'), in an order no fault
can turn into a lost or overwritten checkpoint.

The guard first writes its decision to its state file (``pending``: the checkpoint step S it
keeps, where the rest goes), then :func:`carry_out` makes the moves in this order:

1. check that ``global_step_S`` is a complete checkpoint (nothing is touched otherwise);
2. rewrite verl's tracker to name S (write + rename: a reader sees the old step T or S, never a
   half-written file; T >= S and both folders are complete and in place at that instant);
3. move the abandoned segment's metrics and log into the destination (the run folder);
4. move each ``global_step_N`` after S out of the checkpoint folder (:func:`move_aside`); the
   tracker names S already, so no instant of this step leaves it naming a folder that is gone;
5. with ``--skip-batches``, replace S's ``data.pt`` (write + rename; the original kept once as
   ``data.lrstab-orig.pt``, itself written under a temporary name and renamed).

Each step can be redone: the tracker is rewritten, a folder already moved is no longer in the
checkpoint folder, a copy is completed from its original, ``data.pt`` is computed from the kept
original. So a guard killed or failing at any point finishes the journal on ``--resume`` (or the
same command again), and verl's ``find_latest_ckpt_path`` names a complete ``global_step_S`` or
``global_step_T`` at every instant in between.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from verl_lrstab.guard.files import GuardIOError, io_step, sync_file, sync_folder
from verl_lrstab.guard.plan import (TRACKER, GuardError, checkpoint_complete, read_tracker, step_folders,
                                    write_tracker)
from verl_lrstab.guard.run_state import Pending

LOCAL = "lrstab_abandoned"  # beside the checkpoints, on their file system: where a rename across file systems goes
PARTIAL = ".lrstab-partial"  # a copy being written (never a ``global_step_N`` name: verl and the guard ignore it)


@dataclass
class Progress:
    """What :func:`carry_out` has done so far (for a truthful message when it stops midway)."""

    checkpoint_dir: Path
    checkpoint_step: int
    scratch: bool = False
    tracker_before: Optional[int] = None
    tracker_written: bool = False
    moved: list = field(default_factory=list)  # (folder name, where it went)
    left: list = field(default_factory=list)  # folder names after S still in the checkpoint folder
    data_moved: bool = False

    def describe(self) -> str:
        """The checkpoints' state in words: the tracker, what was moved and what was not."""
        ck, s = self.checkpoint_dir, self.checkpoint_step
        moved = "; ".join(f"{name} -> {where}" for name, where in self.moved) or "none"
        left = ", ".join(self.left) or "none"
        if self.scratch:
            tracker = ("verl's tracker was moved aside too" if self.tracker_written else
                       f"verl's tracker {ck / TRACKER} is still there (moved last)")
            return f"checkpoints moved aside: {moved}; not moved yet (still in {ck}): {left}; {tracker}"
        tracker = (f"verl's tracker {ck / TRACKER} names step {s} (rewritten)" if self.tracker_written else
                   f"verl's tracker was not rewritten (it still names step {self.tracker_before})")
        return (f"{tracker}; checkpoints moved aside: {moved}; not moved yet (still in {ck}): {left}; "
                f"the checkpoint kept, global_step_{s}, is complete and in place")


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy the folder ``src`` to ``dst`` (symlinks as links); stop at the first error (an ``OSError``
    naming its errno, not shutil's list of every file's error)."""
    os.mkdir(dst)
    for entry in os.scandir(src):
        target = dst / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            _copy_tree(Path(entry.path), target)
        else:
            shutil.copy2(entry.path, target)
            sync_file(target)
    shutil.copystat(src, dst)
    sync_folder(dst)


def _is_original_of(src: Path, copy: Path) -> bool:
    """Whether every file left under ``src`` is in ``copy`` with its size and modification time (which
    ``shutil.copy2`` keeps; 1 s of slack for a file system with coarser times), each link with its
    target: ``src`` is the original of the copy (partly removed, perhaps), not a folder saved there
    after the earlier one was moved aside, whose files are newer."""
    for root, dirs, files in os.walk(src):
        here = copy / Path(root).relative_to(src)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            a, b = Path(root, name), here / name
            if a.is_symlink() or b.is_symlink():
                if not (a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)):
                    return False
                continue
            try:
                sa, sb = a.stat(), b.stat()
            except FileNotFoundError:
                return False
            if sa.st_size != sb.st_size or abs(sa.st_mtime - sb.st_mtime) > 1.0:
                return False
    return True


def move_aside(src: Path, dest: Path, local: Path) -> Path:
    """Move the checkpoint folder ``src`` to ``dest`` (returns where it went).

    A rename when ``dest`` is on the same file system. Across file systems (``EXDEV``) the folder
    is renamed to ``local`` instead (beside the checkpoints, on their own file system: nothing is
    copied and nothing can fill a disk). Only where that fails too (``src`` itself a mount), it is
    copied under a temporary name, renamed to ``dest`` when complete, and the original removed
    after; a copy that fails (``ENOSPC``) is removed again. Redone after a kill, it completes:
    ``dest`` exists only once a copy is complete, so an original still beside it is removed, once its
    files are found in the copy unchanged; a folder saved at ``src`` after the move is refused, never
    removed."""
    for target in (dest, local):
        if target.exists() and not src.exists():
            return target  # moved before the guard died
    if dest.exists() and src.exists():  # a complete copy, its original being removed when the guard died
        with io_step("compare the folder with its copy", src):
            copied = _is_original_of(src, dest)
        if not copied:
            raise GuardError(f"{src} and {dest} both exist and hold different files: {src.name} was saved again after "
                             f"the guard moved the earlier one aside (verl run by hand, or another guard); nothing was "
                             f"removed. Keep the one to resume from in {src.parent}, move the other out of both "
                             "places, then continue with --resume")
        with io_step("remove the copied original", src):
            shutil.rmtree(src)
        return dest
    with io_step("make the folder", dest.parent):
        dest.parent.mkdir(parents=True, exist_ok=True)
    if _renamed(src, dest):
        return dest
    while local.exists():  # another run's folder of that name: never merged into
        local = local.with_name(local.name + "+")
    with io_step("make the folder", local.parent):
        local.parent.mkdir(parents=True, exist_ok=True)
    if _renamed(src, local):
        try:  # the run folder points to it (a convenience: the event names it too)
            os.symlink(local, dest)
        except OSError:
            pass
        return local
    partial = dest.with_name(dest.name + PARTIAL)
    with io_step(f"copy the checkpoint {src} to", partial):
        if partial.exists():
            shutil.rmtree(partial)
        try:
            _copy_tree(src, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    with io_step("rename the finished copy to", dest):
        os.rename(partial, dest)
        sync_folder(dest.parent)  # the copy is on the disk under its name before its original goes
    with io_step("remove the copied original", src):
        shutil.rmtree(src)
    return dest


def _move_file(src: Path, dest: Path) -> None:
    """Rename the file ``src`` to ``dest``; across file systems, write a copy under a temporary name,
    rename it, then remove ``src`` (so ``dest`` is whole whenever it exists)."""
    try:
        os.rename(src, dest)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        tmp = dest.with_name(dest.name + PARTIAL)
        shutil.copy2(src, tmp)
        sync_file(tmp)
        os.rename(tmp, dest)
        sync_folder(dest.parent)
        os.unlink(src)


def _link_or_copy(src: Path, dest: Path) -> None:
    """``dest`` as a second name of the file ``src`` (a hard link: no space, nothing read); where the file
    system refuses links, a copy written in blocks under a temporary name and renamed."""
    try:
        os.link(src, dest)
    except OSError:
        tmp = dest.with_name(dest.name + PARTIAL)
        shutil.copyfile(src, tmp)
        sync_file(tmp)
        os.rename(tmp, dest)


def _renamed(src: Path, dest: Path) -> bool:
    """Rename ``src`` to ``dest``: True when done, False across file systems (``EXDEV``)."""
    try:
        os.rename(src, dest)
        return True
    except OSError as err:
        if err.errno == errno.EXDEV:
            return False
        raise GuardIOError(f"move the checkpoint {src} aside to", dest, err) from err


def local_dir(checkpoint_dir: Path, run_dir: Path, dest: Path) -> Path:
    """Where :func:`move_aside` renames a folder whose ``dest`` is on another file system."""
    return checkpoint_dir / LOCAL / run_dir.name / dest.name


# -- the dataloader position (--skip-batches) -------------------------------------------------------
def skipped_data_state(folder: Path, n: int, batch_size: Optional[int] = None) -> dict:
    """verl's dataloader state of the checkpoint ``folder`` (``data.pt``, a torchdata
    ``StatefulDataLoader`` state; its kept original ``data.lrstab-orig.pt`` when there is one)
    moved ``n`` batches on. Raises :class:`GuardError` naming the file and the key when it cannot
    be (read before anything moves). A batch is sized by the state's own counts, else by
    ``batch_size`` (verl's ``data.gen_batch_size`` or ``data.train_batch_size``)."""
    import torch

    orig = folder / "data.lrstab-orig.pt"
    source = orig if orig.exists() else folder / "data.pt"
    try:
        state = torch.load(source, weights_only=False)
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise GuardError(f"--skip-batches: cannot read {source} ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise GuardError(f"--skip-batches: {source} is not a dataloader state (a mapping expected, got "
                         f"{type(state).__name__})")
    yielded = state.get("_sampler_iter_yielded") or state.get("_num_yielded") or 0
    inner = state.get("_sampler_iter_state")
    if isinstance(inner, dict) and "samples_yielded" in inner:
        per_batch = inner["samples_yielded"] // yielded if isinstance(yielded, int) and yielded > 0 else batch_size
        if not isinstance(per_batch, int) or per_batch <= 0:
            raise GuardError(f"--skip-batches: {source} has no batch yielded (key _num_yielded = {yielded!r}) to size "
                             "a batch by, and the run's data.train_batch_size is unknown; run with --skip-batches 0")
        inner["samples_yielded"] += n * per_batch
    for key in ("_num_yielded", "_sampler_iter_yielded"):
        if state.get(key) is not None:
            if not isinstance(state[key], int):
                raise GuardError(f"--skip-batches: {source}: the key {key} is {state[key]!r}, expected an integer")
            state[key] += n
    return state


def skip_batches(folder: Path, n: int, batch_size: Optional[int] = None) -> None:
    """Move the checkpoint ``folder``'s dataloader ``n`` batches on (:func:`skipped_data_state`),
    keeping the original as ``data.lrstab-orig.pt``; each call starts from that original."""
    import torch

    data, orig = folder / "data.pt", folder / "data.lrstab-orig.pt"
    state = skipped_data_state(folder, n, batch_size)
    if not orig.exists():
        tmp = folder / ".data.lrstab-orig.pt.lrstab-tmp"
        shutil.copy2(data, tmp)
        sync_file(tmp)
        os.replace(tmp, orig)
        sync_folder(folder)  # the original kept on the disk before data.pt is replaced
    tmp = folder / ".data.pt.lrstab-tmp"
    torch.save(state, tmp)
    sync_file(tmp)
    os.replace(tmp, data)
    sync_folder(folder)


def _sync_moves(checkpoint_dir: Path, dest: Path, local: Path) -> None:
    """The set-aside's renames written to the disk (both ends) before the journal is cleared and verl
    relaunched: a power loss after that cannot bring back a folder verl then saves over."""
    for folder in (checkpoint_dir, dest, local):
        if folder.is_dir():
            with io_step("write to the disk the moves in", folder):
                sync_folder(folder)


# -- the journal --------------------------------------------------------------------------------------
def _move_all(checkpoint_dir: Path, dest: Path, local: Path, progress: Progress, after: int = -1) -> None:
    """:func:`move_aside` each ``global_step_N`` with N > ``after``, oldest first."""
    for s in [s for s in step_folders(checkpoint_dir) if s > after]:
        name = f"global_step_{s}"
        with io_step("make the folder", dest):
            dest.mkdir(parents=True, exist_ok=True)
        where = move_aside(checkpoint_dir / name, dest / name, local / name)
        progress.moved.append((name, str(where)))
        if name in progress.left:
            progress.left.remove(name)


def carry_out(checkpoint_dir: Path, pending: Pending, progress: Progress, contents=("model", "optimizer", "extra"),
              batch_size: Optional[int] = None) -> None:
    """Make the moves of ``pending`` in the order of the module docstring, recording them in ``progress``.

    Args:
        checkpoint_dir: verl's ``trainer.default_local_dir``.
        pending: the journal entry: ``checkpoint_step`` (S), ``dest`` (the folder the abandoned
            checkpoints go to), ``local`` (where a folder goes when ``dest`` is on another file system;
            None: ``<checkpoint_dir>/lrstab_abandoned/<dest's name>``), ``segment`` (the abandoned
            metrics file, or None), ``skip_batches``.
        progress: filled in as the moves are made.
        contents: the saved contents that make S complete (:func:`~.plan.checkpoint_complete`).
        batch_size: sizes a batch for ``--skip-batches`` when ``data.pt`` cannot.
    """
    scratch = pending.scratch
    step, dest = (-1 if scratch else pending.checkpoint_step), Path(pending.dest)
    local = Path(pending.local) if pending.local else checkpoint_dir / LOCAL / dest.name
    kept = checkpoint_dir / f"global_step_{step}"
    progress.tracker_before = read_tracker(checkpoint_dir)
    progress.left = [f"global_step_{s}" for s in step_folders(checkpoint_dir) if s > step]
    mounts = [name for name in progress.left if os.path.ismount(checkpoint_dir / name)]
    if mounts:  # a rename of a mount point is EBUSY, each time: refused before anything moves
        raise GuardError(f"{checkpoint_dir / mounts[0]} is a mount point: the guard cannot move it aside (the rename "
                         "is refused with EBUSY), and verl would save over it; nothing was moved. Unmount it (or "
                         "copy its contents out and remove the folder), then continue with --resume")
    if scratch:  # --from-scratch, or nothing complete to keep: every folder aside, then the tracker
        _move_all(checkpoint_dir, dest, local, progress)
        tracker = checkpoint_dir / TRACKER
        if tracker.exists():
            with io_step("move verl's tracker aside to", dest / TRACKER):
                dest.mkdir(parents=True, exist_ok=True)
                _move_file(tracker, dest / TRACKER)
        _sync_moves(checkpoint_dir, dest, local)
        progress.tracker_written = True
        return
    # complete as a folder (the tracker may name it already: a journal being redone)
    if not checkpoint_complete(kept, contents, check_tracker=False):
        raise GuardError(f"the checkpoint to resume from, {kept}, is {'incomplete' if kept.exists() else 'missing'} "
                         f"(is {checkpoint_dir} the folder the run saved to, and all of it mounted?); nothing was "
                         "moved. Bring it back, then continue with --resume")
    with io_step("rewrite verl's tracker", checkpoint_dir / TRACKER):
        write_tracker(checkpoint_dir, step)
    progress.tracker_written = True
    with io_step("make the folder", dest):
        dest.mkdir(parents=True, exist_ok=True)
    if pending.segment:  # a rollback: the abandoned segment's metrics and log go with its checkpoints
        seg, moved = Path(pending.segment), dest / "metrics.jsonl"
        with io_step("move the abandoned segment's metrics to", moved):
            if seg.exists():
                _move_file(seg, moved)
            elif not moved.exists():
                moved.write_text("")
        log = seg.with_suffix(".log")
        if log.exists() and not (dest / "verl.log").exists():
            with io_step("link verl's log to", dest / "verl.log"):
                _link_or_copy(log, dest / "verl.log")
    _move_all(checkpoint_dir, dest, local, progress, after=step)
    _sync_moves(checkpoint_dir, dest, local)
    if pending.skip_batches:
        with io_step("move the dataloader position in", kept / "data.pt"):
            skip_batches(kept, pending.skip_batches, batch_size)
        progress.data_moved = True
