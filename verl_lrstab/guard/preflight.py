"""What the guard checks in verl's checkpoint folder before it launches verl: that verl will resume
from a complete checkpoint, and never train from scratch, or from an older step, over checkpoints
it would then overwrite.

verl 0.9.1 saves into ``global_step_N`` folders in place: a run that starts from scratch (its
tracker missing, or naming a folder that is gone: ``find_latest_ckpt_path`` returns None) or from
an older checkpoint rewrites the later folders as it reaches their steps. So before a launch the
guard refuses a tracker that names a missing or incomplete checkpoint while other checkpoints are
there, refuses to start from scratch over checkpoints unless told to (``--from-scratch``, which
moves them aside first), and moves aside the folders after the step verl will resume from.

Pure: reads the folder, decides, writes nothing (:mod:`.moves` makes the moves).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from verl_lrstab.guard.overrides import user_value
from verl_lrstab.guard.plan import (TRACKER, GuardError, RunPlan, checkpoint_complete, read_tracker, step_folders,
                                    step_of)
from verl_lrstab.guard.run_state import GuardState


def _complete(plan: RunPlan, step: int) -> bool:
    return checkpoint_complete(plan.checkpoint_dir / f"global_step_{step}", plan.save_contents, check_tracker=False)


def _complete_steps(plan: RunPlan) -> list[int]:
    return [s for s in step_folders(plan.checkpoint_dir) if _complete(plan, s)]


def _what_to_do(plan: RunPlan) -> str:
    complete = _complete_steps(plan)
    fix = (f"write the step of the checkpoint to resume from into it (the newest complete one: echo {max(complete)} "
           f"> {plan.checkpoint_dir / TRACKER})" if complete else "")
    return ((fix + ", or " if fix else "") + "pass --from-scratch to move every global_step_N folder aside (into "
            "the run folder's abandoned/) and train from step 0")


def tracker_problem(plan: RunPlan) -> Optional[str]:
    """Why verl's tracker cannot be resumed from while other checkpoints are there (None when it can,
    or when there is no other checkpoint to lose): it names a step whose folder is missing (verl would
    train from scratch over the others) or incomplete (verl would fail to load it)."""
    ck = plan.checkpoint_dir
    step = read_tracker(ck)
    if step is None or _complete(plan, step):
        return None
    others = [s for s in step_folders(ck) if s != step]
    if not others:
        return None
    state = "is missing" if not (ck / f"global_step_{step}").exists() else "is incomplete (a shard or data.pt missing)"
    return (f"verl's tracker {ck / TRACKER} names step {step}, but {ck / f'global_step_{step}'} {state}, while "
            f"{ck} holds the checkpoints of steps {others}: verl would "
            + ("train from scratch over them" if "missing" in state else "fail to load it")
            + f". To resume, {_what_to_do(plan)}")


@dataclass(frozen=True)
class FirstLaunch:
    """What a new guard does to the checkpoint folder before its first launch.

    Args:
        keep: the step verl resumes from; the ``global_step_N`` after it are moved aside first
            (verl would save over them). None: nothing is kept.
        scratch: move every ``global_step_N`` aside (``--from-scratch``); verl starts from step 0.
    """

    keep: Optional[int] = None
    scratch: bool = False

    @property
    def moves(self) -> bool:
        return self.scratch or self.keep is not None


def first_launch(plan: RunPlan, overrides: list[str], from_scratch: bool, cwd: Path) -> FirstLaunch:
    """Check verl's checkpoint folder for a new guard's first launch under the user's ``resume_mode``;
    refuse (:class:`~.plan.GuardError`, naming the folder and what to do) a launch that would
    overwrite a checkpoint or resume from a missing or incomplete one."""
    ck, mode = plan.checkpoint_dir, plan.resume_mode
    folders = step_folders(ck)
    if not folders:
        return FirstLaunch()
    if from_scratch:
        return FirstLaunch(scratch=True)
    if mode == "disable":
        complete = _complete_steps(plan)
        return _refuse(f"trainer.resume_mode=disable with checkpoints already in {ck} (steps "
                       f"{complete or folders}): verl would train from scratch over them and a rollback could load "
                       "the old run's. Use an empty trainer.default_local_dir, resume_mode=auto to continue from "
                       "them, or --from-scratch to move them aside first")
    if mode == "resume_path":
        path = user_value(overrides, "trainer.resume_from_path") or ""
        step = step_of(Path(path).name) if path else None
        if path and step is None and re.fullmatch(r"global_step_\d+", Path(path).name):
            return _refuse(f"trainer.resume_from_path={path}: verl names the checkpoint of step "
                           f"{int(Path(path).name[12:])} global_step_{int(Path(path).name[12:])} (no leading zero), "
                           f"so it would save that step's next checkpoints beside this copy, and the guard rolls back "
                           f"only within verl's own folders. Rename it to global_step_{int(Path(path).name[12:])}, "
                           "or name that folder")
        if step is None or not _complete(plan, step) or (cwd / path).resolve().parent != ck.resolve():
            return _refuse(f"trainer.resume_from_path={path or '(unset)'}: not a complete global_step_N folder of "
                           f"{ck} (the guard resumes from and rolls back within that folder). Name one of "
                           f"{[f'global_step_{s}' for s in _complete_steps(plan)]}, or use resume_mode=auto")
        return FirstLaunch(keep=step if any(s > step for s in folders) else None)
    problem = tracker_problem(plan)
    if problem:
        return _refuse(problem)
    step = read_tracker(ck)
    if step is None:
        if (ck / TRACKER).exists():  # cut off mid-write by verl: verl itself would fail to read it
            return _refuse(f"verl's tracker {ck / TRACKER} is unreadable (not a step number) while {ck} holds "
                           f"checkpoints (steps {folders}). To resume, {_what_to_do(plan)}")
        return _refuse(f"{ck} holds checkpoints (steps {folders}) but no tracker ({TRACKER}): verl "
                       f"(resume_mode=auto) would train from scratch over them. To resume, {_what_to_do(plan)}")
    return FirstLaunch(keep=step if any(s > step for s in folders) else None)


def _refuse(message: str):
    raise GuardError(message)


def resume_problem(plan: RunPlan, state: GuardState, logged: int, complete: list[int], run_dir: Path) -> Optional[str]:
    """Why a guarded run cannot continue (``--resume``, or the same command again) from the checkpoint
    folder as it is, or None.

    Args:
        plan: the run's checkpoint plan.
        state: the guard's state (``after``: the step of the last rollback's checkpoint; ``rules``).
        logged: the last step of the run's trajectory.
        complete: the complete checkpoints the guard could resume from (the bad ones excluded).
        run_dir: the run folder (named in the message).
    """
    ck = plan.checkpoint_dir
    needs = state.after if state.after or state.rules else None
    saved = logged >= plan.save_freq  # verl had saved a checkpoint by then
    again = (f"Nothing was changed (the checkpoints, the run's state); once it is back: "
             f"lrstab guard --resume {run_dir}")
    if not ck.is_dir() and (needs is not None or saved):
        return (f"the checkpoint folder {ck} is missing (a file system not mounted yet?), but the run logged "
                f"{logged} steps (verl saves every {plan.save_freq})"
                + (f" and the last rollback resumed from step {needs}" if needs is not None else "") + f". {again}")
    if state.pending is not None and state.pending.scratch:
        return None  # an unfinished --from-scratch: its journal moves every folder aside, whatever they hold
    if needs is not None and not any(s >= needs for s in complete):
        return (f"the checkpoint the last rollback resumed from, {ck / f'global_step_{needs}'}, is missing or "
                f"incomplete, and no later complete one is in {ck}. {again}")
    if not complete and saved and not step_folders(ck):
        return (f"{ck} holds no checkpoint, but the run logged {logged} steps (verl saves every {plan.save_freq}): "
                f"is it the folder the run saved to, and mounted? {again}")
    if not complete and any(_complete(plan, s) for s in step_folders(ck)):
        return (f"every complete checkpoint in {ck} failed to load (see the resume_failed events); verl would train "
                "from scratch over them. Move them aside by hand to start over")
    return None
