"""``guard_state.json``: the guarded run's persisted state (:class:`GuardState`), read and checked whole before
anything moves.

The state is a dataclass written as JSON (:meth:`GuardState.to_json`; the supervisor writes it with
:func:`~.files.write_atomic`, write + rename) and read back through
:func:`~verl_lrstab.dataclass_reader.from_state`, as the detector's and the schedule's states are: every key
present and known, each of its type, the bounds of :class:`GuardState`, :class:`Rule`, :class:`Pending` and
:class:`~.plan.GuardOptions` met; then what its paths name is checked (``cwd`` a folder, a segment not one). A
damaged file is refused with one :class:`~.plan.GuardError` naming the file and the key, never a traceback,
before the guard launches verl or finishes a journal (``pending``: the moves of a decided set-aside, see
:mod:`.moves`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Tuple

from verl_lrstab.dataclass_reader import MISSING, StateFieldError, from_state, require, shown
from verl_lrstab.guard.plan import GuardError, GuardOptions

STATE = "guard_state.json"
#: The file's format. A file of another format is refused naming it (no other format is read).
VERSION = 2
STATUSES = ("running", "done", "gave_up", "failed")

#: A launch's metrics file (an absolute path) and the first step it counts for (the step after its resume).
Segment = Tuple[str, int]


def _absolute(value: Any) -> bool:
    return isinstance(value, str) and value != "" and "\0" not in value and Path(value).is_absolute()


@dataclass
class Rule:
    """The LR rule a rollback set: the overrides of every launch from its checkpoint on.

    Args:
        checkpoint_step (int): the checkpoint the rollback resumed verl from (>= 0).
        decay_from_step (int): the schedule's ``decay_from_step`` (>= 0).
        decay_period (int): the schedule's ``decay_period`` (>= 1), shortened when the decays in force
            there reach back before step 0 (:func:`~.plan.compounded_rule`).
        halvings (int): the decays in force at the checkpoint before this rollback's own (>= 0).
        base_period (int): the trouble's calibrated period before any shortening (>= 1); a resume
            that fails sets the rule anew from it at an older checkpoint.
        attempt (int): the rollback's number (>= 1).
        skip_batches (int): ``--skip-batches`` when the rollback was decided (>= 0).
    """

    checkpoint_step: int
    decay_from_step: int
    decay_period: int
    halvings: int
    base_period: int
    attempt: int
    skip_batches: int

    def __post_init__(self):
        for name, low in (("checkpoint_step", 0), ("decay_from_step", 0), ("decay_period", 1), ("halvings", 0),
                          ("base_period", 1), ("attempt", 1), ("skip_batches", 0)):
            value = getattr(self, name)
            require(value >= low, name, value, f"an integer >= {low}")


@dataclass
class Pending:
    """A decided set-aside not finished yet (the journal of :mod:`.moves`): written before anything moves.

    Args:
        checkpoint_step (int): the checkpoint S kept (>= 0; 0 with ``scratch``).
        scratch (bool): keep nothing (every ``global_step_N`` and the tracker moved aside).
        dest (str): the folder in the run folder the rest goes to (an absolute path).
        local (Optional[str]): where a folder goes when ``dest`` is on another file system than the
            checkpoints (an absolute path; None: ``<checkpoints>/lrstab_abandoned/<dest's name>``).
        segment (Optional[str]): a rollback's abandoned metrics file (an absolute path), or None.
        skip_batches (int): move S's dataloader this many batches on (>= 0).
        events (list): the decision's own events (each a mapping with its ``event`` name), written
            once before the moves.
    """

    checkpoint_step: int
    scratch: bool
    dest: str
    local: Optional[str]
    segment: Optional[str]
    skip_batches: int
    events: list[dict[str, Any]]

    def __post_init__(self):
        require(self.checkpoint_step >= 0, "checkpoint_step", self.checkpoint_step, "an integer >= 0")
        require(_absolute(self.dest), "dest", self.dest, "an absolute folder path")
        for name in ("local", "segment"):
            value = getattr(self, name)
            require(value is None or _absolute(value), name, value, "null or an absolute path")
        require(self.skip_batches >= 0, "skip_batches", self.skip_batches, "an integer >= 0")
        for i, event in enumerate(self.events):
            require(isinstance(event.get("event"), str), f"events[{i}].event", event.get("event", MISSING),
                    "the event's name (text)")


@dataclass
class GuardState:
    """The guarded run's state, saved in its run folder before every launch and every move.

    Args:
        version (int): the file's format, :data:`VERSION`.
        status (str): ``running`` (also after the guard's own death or I/O failure: ``--resume``
            continues), ``done``, ``gave_up`` or ``failed`` (verl failed, its restarts used up).
        command (list[str]): the user's command, as ``--resume`` relaunches it.
        cwd (str): the folder the command runs in (an absolute path).
        options (GuardOptions): the guard's options.
        attempt (int): the rollbacks so far (>= 0).
        restarts (int): the restarts after a verl crash since the last ``--resume`` of a failed run (>= 0).
        resumed_at (Optional[int]): the checkpoint step the running launch resumed from (None: the
            user's own ``resume_mode``, or from scratch).
        after (int): the step of the last rollback's checkpoint (>= 0): troubles before it are not judged.
        rules (list[Rule]): the LR rules of the kept trajectory, oldest first.
        segments (list[Segment]): every launch's metrics file and its first step, oldest first.
        bad_checkpoints (list[int]): the checkpoint steps that failed to load.
        pending (Optional[Pending]): the set-aside decided and not finished yet.
    """

    version: int
    status: str
    command: list[str]
    cwd: str
    options: GuardOptions
    attempt: int
    restarts: int
    resumed_at: Optional[int]
    after: int
    rules: list[Rule]
    segments: list[Segment]
    bad_checkpoints: list[int]
    pending: Optional[Pending]

    def __post_init__(self):
        require(self.version == VERSION, "version", self.version, f"{VERSION} (the format this guard reads)")
        require(self.status in STATUSES, "status", self.status, f"one of {', '.join(STATUSES)}")
        require(_absolute(self.cwd), "cwd", self.cwd, "an absolute folder path")
        for name in ("attempt", "restarts", "after"):
            value = getattr(self, name)
            require(value >= 0, name, value, "an integer >= 0")
        require(self.resumed_at is None or self.resumed_at >= 0, "resumed_at", self.resumed_at,
                "null or an integer step >= 0")
        for i, (path, first) in enumerate(self.segments):
            require(_absolute(path) and first >= 1, f"segments[{i}]", [path, first],
                    "[an absolute metrics file path, its first step >= 1]")
        for i, step in enumerate(self.bad_checkpoints):
            require(step >= 0, f"bad_checkpoints[{i}]", step, "an integer step >= 0")

    @classmethod
    def start(cls, command: list[str], cwd: str, options: GuardOptions) -> "GuardState":
        """The state of a new run: nothing launched, rolled back or decided yet."""
        return cls(version=VERSION, status="running", command=list(command), cwd=cwd, options=options, attempt=0,
                   restarts=0, resumed_at=None, after=0, rules=[], segments=[], bad_checkpoints=[], pending=None)

    def to_json(self) -> str:
        """The file's text (read back by :func:`load_state`)."""
        return json.dumps(asdict(self), indent=1)


def _damaged(path: Path, key: str, detail: str) -> GuardError:
    return GuardError(f"{path}: the key {key!r} {detail}; the file is damaged: restore it, or move it aside to start "
                      "a new run there")


def check_state(data: Any, path: Path) -> GuardState:
    """The :class:`GuardState` of the parsed file ``data``; a damaged one is refused with one error naming
    the file and the key."""
    if not isinstance(data, dict):
        raise GuardError(f"{path}: not a guard state (a JSON object expected, got {type(data).__name__}); move it "
                         "aside to start a new run there")
    if "version" in data and data["version"] != VERSION:  # before its keys: another format has others
        raise GuardError(f"{path}: the key 'version' is {shown(data['version'])}, expected {VERSION}: the state of "
                         "another format of lrstab's guard (this one reads only its own); continue the run with the "
                         "lrstab that wrote it, or move the file aside to start a new run there")
    try:
        state = from_state(GuardState, data)
    except StateFieldError as err:
        detail = "is missing" if err.value is MISSING else f"is {shown(err.value)}, expected {err.expected}"
        raise _damaged(path, err.field, detail) from None
    except GuardError as err:  # an option out of its bounds (GuardOptions' own check, naming the option)
        raise _damaged(path, "options", f"holds a bad value: {err}") from None
    cwd = Path(state.cwd)
    if not cwd.is_dir():
        raise _damaged(path, "cwd", f"names {cwd}, which is not a folder (the command runs there)")
    for i, (segment, _) in enumerate(state.segments):
        if Path(segment).is_dir():
            raise _damaged(path, f"segments[{i}]", f"names {segment}, a folder (a metrics file expected)")
    if state.pending and Path(state.pending.dest).exists() and not Path(state.pending.dest).is_dir():
        raise _damaged(path, "pending.dest", f"names {state.pending.dest}, which is not a folder")
    return state


def load_state(run_dir: Path) -> Optional[GuardState]:
    """The checked state of ``run_dir`` (None when there is none)."""
    path = run_dir / STATE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: a deeply nested file
        detail = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise GuardError(f"{path}: unreadable ({detail}); restore it, or move it aside to start a new run there") \
            from None
    return check_state(data, path)
