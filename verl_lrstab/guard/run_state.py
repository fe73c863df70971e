"""``guard_state.json``: the guarded run's persisted state, read and checked whole before anything moves.

Every key is checked (its kind and, for paths, what is there): a damaged file is refused with one
:class:`~.plan.GuardError` naming the file and the key, never a traceback, and before the guard
launches verl or finishes a journal (``pending``: the moves of a decided set-aside, see
:mod:`.moves`).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Optional

from verl_lrstab.guard.plan import GuardError, GuardOptions
from verl_lrstab.dataclass_reader import is_integer

STATE = "guard_state.json"
_RULE_KEYS = ("checkpoint_step", "decay_from_step", "decay_period", "base_period", "attempt")


def _int(v, low: Optional[int] = None) -> bool:
    return is_integer(v) and (low is None or v >= low)


def _path(v) -> bool:
    return isinstance(v, str) and v != "" and "\0" not in v and Path(v).is_absolute()


def _pending_ok(v) -> bool:
    return v is None or (isinstance(v, dict) and _int(v.get("checkpoint_step"), 0) and _path(v.get("dest"))
                         and (v.get("segment") is None or _path(v["segment"]))
                         and _int(v.get("skip_batches", 0), 0) and isinstance(v.get("scratch", False), bool)
                         and (v.get("local") is None or _path(v["local"]))
                         and (v.get("events") is None or isinstance(v["events"], list)
                              and all(isinstance(e, dict) and isinstance(e.get("event"), str) for e in v["events"])))


# key -> (what it must be, the check)
KEYS = {
    "status": ("one of running, done, gave_up, failed", lambda v: v in ("running", "done", "gave_up", "failed")),
    "command": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v)),
    "cwd": ("an absolute folder path (string)", _path),
    "options": ("a mapping of the guard's options", lambda v: isinstance(v, dict)),
    "attempt": ("an integer >= 0", lambda v: _int(v, 0)),
    "restarts": ("an integer >= 0", lambda v: _int(v, 0)),
    "after": ("an integer step >= 0", lambda v: _int(v, 0)),
    "rules": (f"a list of rules (mappings with the integers {', '.join(_RULE_KEYS)})",
              lambda v: isinstance(v, list) and all(isinstance(r, dict) and all(_int(r.get(k)) for k in _RULE_KEYS)
                                                    for r in v)),
    "segments": ("a list of [absolute metrics path, first step] pairs",
                 lambda v: isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 and _path(x[0])
                                                       and _int(x[1]) for x in v)),
    "bad_checkpoints": ("a list of integer steps", lambda v: isinstance(v, list) and all(_int(x) for x in v)),
}
OPTIONAL = {
    "pending": ("null or the decided moves (a mapping: checkpoint_step an integer >= 0, dest an absolute path, "
                "segment null or an absolute path, skip_batches an integer >= 0, events a list of event "
                "mappings)", _pending_ok),
    "resumed_at": ("null or an integer step", lambda v: v is None or _int(v)),
}


def _damaged(path: Path, key: str, detail: str) -> GuardError:
    return GuardError(f"{path}: the key {key!r} {detail}; the file is damaged: restore it, or move it aside to start "
                      "a new run there")


def check_state(data, path: Path) -> dict:
    """Refuse a damaged ``guard_state.json`` (the parsed ``data``) with one error naming the file and
    the key; return it with the optional keys filled in."""
    if not isinstance(data, dict):
        raise GuardError(f"{path}: not a guard state (a JSON object expected, got {type(data).__name__}); move it "
                         "aside to start a new run there")
    for key, (what, ok) in {**KEYS, **OPTIONAL}.items():
        if key not in data:
            if key in OPTIONAL:
                continue
            raise _damaged(path, key, f"is missing ({what} expected)")
        if not ok(data[key]):
            shown = repr(data[key]) if len(repr(data[key])) < 60 else repr(data[key])[:57] + "..."
            raise _damaged(path, key, f"is {shown}, expected {what}")
    cwd = Path(data["cwd"])
    if not cwd.is_dir():
        raise _damaged(path, "cwd", f"names {cwd}, which is not a folder (the command runs there)")
    for i, (segment, _) in enumerate(data["segments"]):
        if Path(segment).is_dir():
            raise _damaged(path, f"segments[{i}]", f"names {segment}, a folder (a metrics file expected)")
    pending = data.get("pending")
    if pending and Path(pending["dest"]).exists() and not Path(pending["dest"]).is_dir():
        raise _damaged(path, "pending.dest", f"names {pending['dest']}, which is not a folder")
    known = {f.name for f in fields(GuardOptions)}
    unknown = sorted(set(data["options"]) - known)
    if unknown:
        raise _damaged(path, "options", f"holds unknown options {unknown} (known: {', '.join(sorted(known))})")
    try:
        GuardOptions(**data["options"])
    except GuardError as err:
        raise _damaged(path, "options", f"holds a bad value: {err}") from None
    data.setdefault("pending", None)
    data.setdefault("resumed_at", None)
    return data


def load_state(run_dir: Path) -> Optional[dict]:
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
