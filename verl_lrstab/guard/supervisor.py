"""``lrstab guard -- python -m verl.trainer.main_ppo ...``: run verl, roll back on trouble, continue.

The guard is a supervisor around verl's own entry point. It launches the user's command with
verl's file logger pointed at a segment file, reads the metrics as verl writes them, and on a
trouble (:func:`.plan.find_trouble`) stops the run, keeps the abandoned segment (its metrics and
the checkpoints after the rollback point, moved aside), and relaunches the same command with
verl's own resume (``trainer.resume_mode=resume_path``) from the newest checkpoint at or before
the trouble's onset, the LR decay started there (:func:`.plan.rollback_overrides`). After at most
``max_rollbacks`` rollbacks a further trouble stops it with status 3.

The run directory holds ``lrstab_events.jsonl`` (one JSON object per line, each with ``event``
and ``step``: ``start``, ``surge`` / ``reward_crash`` / ``non_finite``, ``rollback``,
``set_aside``, ``done``, ``gave_up``, ``failed``, ...), ``segment-K.jsonl`` (verl's metrics of
each launch), ``abandoned/`` and ``metrics.jsonl`` (the final trajectory: each segment up to
where the next one resumed). The checkpoints are set aside through a journal (:mod:`.moves`),
and the checkpoint folder is checked before every launch (:mod:`.preflight`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional, Sequence

from verl_lrstab.guard.files import GuardIOError, RunDirBusy, io_step, lock_run_dir, pid_alive, say, write_atomic
from verl_lrstab.guard.lock import LOCK_FILE, CheckpointLock, CheckpointsBusy
from verl_lrstab.guard.metrics import MetricsFile
from verl_lrstab.guard.moves import Progress, carry_out, local_dir, skipped_data_state
from verl_lrstab.guard.overrides import key_of, override, rejected_override, user_value
from verl_lrstab.guard.plan import (GuardError, GuardOptions, RunPlan, log_failed_to_load,
                                    checkpoint_steps, choose_checkpoint, compounded_rule, decay_period_for,
                                    find_trouble, halvings_in_force, no_checkpoint_reason, plan_run, read_tracker,
                                    resume_overrides, rollback_overrides, stale_tracker, step_folders, step_of, Trouble)
from verl_lrstab.guard.preflight import first_launch, resume_problem, tracker_problem
from verl_lrstab.guard.run_state import STATE, GuardState, Pending, Rule, load_state
from verl_lrstab.guard.watchdog import ENV_RUN, raise_on_signal, start_supervised, stop_group, stop_survivors
from verl_lrstab.runs import read_metrics
from verl_lrstab.decay import num_decays

logger = logging.getLogger("verl_lrstab")

EVENTS = "lrstab_events.jsonl"
ENTRY = "verl.trainer.main_ppo"
# 0: done; 2: a bad command, option or state file, or a run folder another guard holds; 128 + N: stopped by signal N
STATUS_GAVE_UP, STATUS_FAILED, STATUS_IO_ERROR = 3, 4, 5
READ_TRIES, READ_PAUSE_S = 5, 0.5  # a metrics read that fails (EIO) is tried again this often, this far apart
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # unwound (verl stopped, a `stopped` event); SIGINT: KeyboardInterrupt


def split_command(command: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher, overrides)`` of ``python -m verl.trainer.main_ppo [--config-path P --config-name N] k=v ...``."""
    command = list(command)
    if ENTRY not in command or "-m" not in command or command.index("-m") + 1 != command.index(ENTRY):
        raise GuardError(f"the command after `--` must run verl's entry point, `python -m {ENTRY} ...`; "
                         f"got {' '.join(command) or 'nothing'!r}")
    cut = command.index(ENTRY) + 1
    head, rest = command[:cut], command[cut:]
    launcher, overrides, i = list(head), [], 0
    while i < len(rest):
        arg = rest[i]
        if arg in ("--config-path", "--config-name", "-cp", "-cn") and i + 1 < len(rest):
            launcher += rest[i:i + 2]
            i += 2
            continue
        if arg.startswith(("--config-path=", "--config-name=")):
            launcher.append(arg)
        else:
            overrides.append(arg)
        i += 1
    return launcher, overrides


def verl_config_dir() -> Optional[Path]:
    """verl's ``verl/trainer/config`` folder, found without importing verl (its import, torch's included, takes
    ~5 s; composing from the folder gives the same tree as from the module), or None."""
    spec = importlib.util.find_spec("verl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "trainer" / "config" / "ppo_trainer.yaml").is_file():
            return Path(root) / "trainer" / "config"
    return None


def compose_config(launcher: list[str], overrides: list[str], cwd: Path):
    """verl's config tree as the command would build it (Hydra's compose; nothing resolved that is not read)."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    path, name = None, "ppo_trainer"
    for i, arg in enumerate(launcher):
        if arg in ("--config-path", "-cp"):
            path = launcher[i + 1]
        elif arg in ("--config-name", "-cn"):
            name = launcher[i + 1]
        elif arg.startswith("--config-path="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    plain = [o for o in overrides if not o.startswith("hydra.")]
    try:
        if path is None:
            directory = verl_config_dir()
            if directory is None:  # a verl without its config as files: Hydra's module path (imports verl, ~5 s)
                with initialize_config_module(config_module="verl.trainer.config", version_base=None):
                    return compose(config_name=name, overrides=plain)
        else:
            directory = Path(path) if Path(path).is_absolute() else cwd / path
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
            return compose(config_name=name, overrides=plain)
    except (HydraException, OmegaConfBaseException) as err:  # what verl's own Hydra main would refuse
        detail = " ".join(str(err).split())
        raise GuardError(f"the launch line's override {rejected_override(plain, err)!r} is refused by Hydra, as verl "
                         f"would refuse it: {detail}") from None


class EventLog:
    """``lrstab_events.jsonl``: one JSON object per line, flushed at once."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, step: Optional[int], id: Optional[str] = None, **fields) -> Optional[dict]:
        """Append the event; one with an ``id`` already in the file (a journal being redone) is not
        written again (returns None)."""
        if id is not None and self.has(id):
            return None
        record = {"event": event, "step": step, "time": round(time.time(), 3), **fields}
        if id is not None:
            record["id"] = id
        with io_step(f"append the {event!r} event to", self.path), open(self.path, "a+b") as f:
            cut = False
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            # a line cut off by a guard killed mid-append is ended first: it does not swallow this one
            f.write((b"\n" if cut else b"") + json.dumps(record).encode() + b"\n")
        return record

    def has(self, id: str) -> bool:
        """Whether an event with this ``id`` is in the file (a line cut off is not one)."""
        with io_step("read the events of", self.path):
            try:
                lines = self.path.read_text(errors="replace").splitlines()
            except FileNotFoundError:
                return False
        for line in lines:
            if id in line:
                try:
                    if json.loads(line).get("id") == id:
                        return True
                except (ValueError, AttributeError):
                    continue
        return False


def _next_index(folder: Path, pattern: str) -> int:
    """1 + the largest K of the existing ``pattern.format(K)`` names in ``folder`` (1 when none)."""
    prefix, suffix = pattern.split("{}")
    ks = [int(n[len(prefix):len(n) - len(suffix)]) for n in (p.name for p in folder.glob(pattern.replace("{}", "*")))
          if n[len(prefix):len(n) - len(suffix)].isdigit()] if folder.is_dir() else []
    return max(ks, default=0) + 1


def _is_guard(pid) -> bool:
    """Whether ``pid`` runs lrstab (a guard or its watchdog), from its command line in /proc."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return b"lrstab" in f.read()
    except (OSError, TypeError, ValueError):
        return False


def busy_message(run_dir: Path, pid) -> str:
    """The refusal of a second guard on ``run_dir``, naming the first one's pid when it is a guard."""
    if pid is not None and pid_alive(pid) and _is_guard(pid):
        return (f"--run-dir {run_dir}: another lrstab guard (pid {pid}) is running this guarded run; two would "
                f"train on one checkpoint folder. Wait for it, or stop it (kill -TERM {pid}) and continue with "
                f"lrstab guard --resume {run_dir}")
    return (f"--run-dir {run_dir}: its lock ({run_dir / 'guard.lock'}) is held: a guard that is gone left its verl "
            "being stopped (its watchdog holds the lock for up to ~15 s), or another process holds the file open "
            f"(fuser {run_dir / 'guard.lock'} names it); try again shortly")


def checkpoints_busy_message(checkpoint_dir: Path, holder: dict) -> str:
    """The refusal of a second guard on verl's checkpoint folder, naming the guard that holds it."""
    pid, other = holder.get("pid"), holder.get("run_dir")
    if pid is not None and pid_alive(pid) and _is_guard(pid):
        where = f", run folder {other}" if other else ""
        resume = f"lrstab guard --resume {other}" if other else "lrstab guard --resume <its run folder>"
        return (f"trainer.default_local_dir={checkpoint_dir}: another lrstab guard (pid {pid}{where}) is running on "
                "these checkpoints; two would train on one checkpoint folder and save over each other's checkpoints. "
                f"Wait for it, or stop it (kill -TERM {pid}) and continue its run with {resume}")
    return (f"trainer.default_local_dir={checkpoint_dir}: its lock ({checkpoint_dir / LOCK_FILE}) is held"
            + (f" (pid {pid})" if pid else "") + ": a guard that is gone left its verl being stopped (its watchdog "
            "holds the lock for up to ~15 s), or another process holds it; try again shortly")


class Guard:
    """One guarded run (see the module docstring).

    Args:
        command: the user's command (``python -m verl.trainer.main_ppo ...``); None with ``resume``.
        run_dir: where the events, segments, state and final metrics go (default: next to verl's
            checkpoints). A run folder with a ``guard_state.json`` of an unfinished run is continued.
        options: :class:`~.plan.GuardOptions`.
        env: the command's environment (default: this process's).
        cwd: where the command runs (default: the current directory).
        poll_s: how often the metrics are read.
        resume: continue the run of ``run_dir`` (its state names the command, the options and the LR rule).
    """

    def __init__(self, command: Optional[Sequence[str]], run_dir: Optional[Path] = None,
                 options: GuardOptions = GuardOptions(), env: Optional[dict] = None, cwd: Optional[Path] = None,
                 poll_s: float = 1.0, resume: bool = False):
        self.state: Optional[GuardState] = None
        if resume:
            if run_dir is None:
                raise GuardError("--resume needs the run folder: lrstab guard --resume RUN_DIR")
            self.state = load_state(Path(run_dir))
            if self.state is None:
                raise GuardError(f"--resume {run_dir}: no {STATE} there (not a folder of an lrstab guard run)")
            if command and list(command) != self.state.command:
                raise GuardError(f"--resume {run_dir}: the command differs from the run's "
                                 f"({' '.join(self.state.command)}); give no command with --resume")
            command = self.state.command
            options = self.state.options
            cwd = Path(self.state.cwd)
        self.launcher, self.overrides = split_command(command or [])
        self.options, self.poll_s = options, poll_s
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.env = dict(os.environ if env is None else env)
        cfg = compose_config(self.launcher, self.overrides, self.cwd)
        self.plan: RunPlan = plan_run(cfg, self.cwd)
        loggers = cfg.trainer.get("logger") or []
        loggers = [loggers] if isinstance(loggers, str) else [str(x) for x in loggers]  # verl's Tracking takes both
        # verl's file logger is what the guard reads: added when the run does not log to a file already
        self._logger_override = [] if "file" in loggers else [override("trainer.logger", [*loggers, "file"])]
        self.run_dir = Path(run_dir or self.plan.checkpoint_dir.parent / "lrstab_guard").resolve()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".lrstab_write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise GuardError(f"--run-dir {self.run_dir}: cannot write there ({err.strerror}); pass a writable "
                             "--run-dir") from None
        self._lock: Optional[int] = None
        self._metrics: Optional[MetricsFile] = None  # the running launch's
        self._moved_told = False
        self._progress: Optional[Progress] = None  # the set-aside being made (for a truthful error message)
        try:
            self._lock = lock_run_dir(self.run_dir)
        except RunDirBusy as busy:
            raise GuardError(busy_message(self.run_dir, busy.pid)) from None
        except GuardIOError as err:
            raise GuardError(f"--run-dir {self.run_dir}: {err}") from None
        self._checkpoints = CheckpointLock(self.plan.checkpoint_dir, self.run_dir)
        try:
            self.events = EventLog(self.run_dir / EVENTS)
            if self.state is None:
                self.state = load_state(self.run_dir)
                if self.state is not None and self.state.command != self.launcher + self.overrides:
                    raise GuardError(f"--run-dir {self.run_dir} holds another command's guarded run; pass another "
                                     f"--run-dir, or continue that one with lrstab guard --resume {self.run_dir}")
            if self.state is not None and self.state.status == "failed" and not resume:
                raise GuardError(f"--run-dir {self.run_dir}: its guarded run failed (verl failed and its restarts were "
                                 "used up); once the cause is fixed, continue it on its LR rule with lrstab guard "
                                 f"--resume {self.run_dir}, or pass another --run-dir for a new run")
            if self.state is not None and self.state.status not in ("running", "failed"):
                raise GuardError(f"--run-dir {self.run_dir}: its guarded run already ended ({self.state.status}); "
                                 "pass another --run-dir for a new run")
            # one guard per checkpoint folder, whatever its run folder; a continued run whose checkpoint
            # folder is missing (not mounted yet) takes it in run(), once it is known not to be refused
            if self.state is None or self.plan.checkpoint_dir.is_dir():
                self._lock_checkpoints()
            if self.state is None and not self.options.from_scratch:
                self._refuse_an_unfinished_run(self._checkpoints.previous)
            # a new run: refused here, before anything is written, when verl would resume from a missing
            # checkpoint or train over existing ones (preflight); a continued run is checked in run()
            self._first = first_launch(self.plan, self.overrides, self.options.from_scratch, self.cwd) \
                if self.state is None else None
        except BaseException:
            self.release()
            raise

    def _lock_checkpoints(self) -> None:
        """Take verl's checkpoint folder (:class:`.lock.CheckpointLock`); refuse when another guard holds it."""
        try:
            self._checkpoints.acquire()
        except CheckpointsBusy as busy:
            raise GuardError(checkpoints_busy_message(self.plan.checkpoint_dir, busy.holder)) from None
        except OSError as err:
            raise GuardError(f"trainer.default_local_dir={self.plan.checkpoint_dir}: cannot make or lock it "
                             f"({err.strerror or err}); pass a folder the guard can write") from None

    def _refuse_an_unfinished_run(self, previous: dict) -> None:
        """A new run folder on checkpoints that an unfinished guarded run rolled back (its state still
        ``running`` or ``failed``, with an LR rule) would relaunch verl without that rule; on checkpoints
        whose set-aside that run left unfinished (``pending``), its redo would later move aside what the
        new run saves. Both refused, naming the run to continue instead."""
        other = previous.get("run_dir")
        if not other or Path(other) == self.run_dir:
            return
        try:
            state = load_state(Path(other))
        except GuardError:
            return
        if not state or state.status not in ("running", "failed") or not (state.rules or state.pending):
            return
        self._checkpoints.restore_previous()
        if not state.rules:
            assert state.pending is not None
            what = ("every checkpoint" if state.pending.scratch else
                    f"its checkpoints after step {state.pending.checkpoint_step}")
            raise GuardError(f"trainer.default_local_dir={self.plan.checkpoint_dir}: the guarded run of {other} "
                             f"({state.status}) stopped midway through moving {what} aside (into "
                             f"{state.pending.dest}); a new run folder "
                             f"would train over that unfinished move. Continue that run: lrstab guard --resume {other} "
                             "(or pass --from-scratch to move its checkpoints aside and train from step 0)")
        rule = state.rules[-1]
        raise GuardError(f"trainer.default_local_dir={self.plan.checkpoint_dir}: its checkpoints belong to the guarded "
                         f"run of {other} ({state.status}), whose rollback to step {rule.checkpoint_step} set the "
                         f"LR rule decay_from_step={rule.decay_from_step}, decay_period={rule.decay_period}; a new "
                         f"run folder would relaunch verl without it. Continue that run: lrstab guard --resume {other} "
                         "(or pass --from-scratch to move its checkpoints aside and train from step 0)")

    def release(self) -> None:
        """Give up the run folder's and the checkpoint folder's locks (also dropped by the kernel when this
        process dies)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if getattr(self, "_checkpoints", None) is not None:
            self._checkpoints.release()

    # -- the persisted state -----------------------------------------------------------------------
    @property
    def _st(self) -> GuardState:
        """The run's state, once there is one: loaded in ``__init__``, else made by :meth:`run` before
        anything reads it."""
        if self.state is None:
            raise RuntimeError("the guard's state is read before run() made it")
        return self.state

    def _save(self) -> None:
        with io_step("write the guard's state", self.run_dir / STATE):
            write_atomic(self.run_dir / STATE, self._st.to_json())

    def _new_state(self) -> GuardState:
        return GuardState.start(self.launcher + self.overrides, str(self.cwd), self.options)

    def _complete(self, exclude=()) -> list[int]:
        return checkpoint_steps(self.plan.checkpoint_dir, self.plan.save_contents,
                                check_tracker=not self.plan.async_save, exclude=exclude)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end; returns the exit status (0 done, 3 gave up, 4 verl failed, 5 the guard's own
        file operation failed; 128 + N when stopped by signal N, re-raised as ``SystemExit`` /
        ``KeyboardInterrupt`` after a ``stopped`` event)."""
        previous = {sig: signal.signal(sig, raise_on_signal) for sig in STOP_SIGNALS}  # a stopped guard stops verl
        try:
            return self._run()
        except GuardIOError as err:
            return self._io_failed(err)
        except GuardError as err:  # a checkpoint folder that cannot be resumed from as it is: nothing launched
            say(f"lrstab guard: error: {err}")
            try:
                self.events.write("refused", None, error=str(err), status=2)
            except GuardIOError:
                pass
            return 2
        except (SystemExit, KeyboardInterrupt) as stop:
            code = stop.code if isinstance(stop, SystemExit) else 128 + signal.SIGINT
            if isinstance(code, int) and code > 128:
                try:
                    self.events.write("stopped", None, signal=signal.Signals(code - 128).name, status=code,
                                      attempt=self.state.attempt if self.state else 0)
                except (GuardIOError, ValueError):
                    pass
                say(f"lrstab guard: stopped by {signal.Signals(code - 128).name}; verl stopped; continue with "
                    f"lrstab guard --resume {self.run_dir}")
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.release()

    def _io_failed(self, err: GuardIOError) -> int:
        """End on one of the guard's own file operations failing: verl is already stopped; the state
        file is the last one written whole (it still says ``running``), so ``--resume`` continues."""
        try:
            self.events.write("failed", None, cause="guard_io", operation=err.operation, path=err.path,
                              error=str(err), status=STATUS_IO_ERROR)
        except GuardIOError:
            pass  # the run folder itself is full or read-only: the message below is all there is
        tracker = read_tracker(self.plan.checkpoint_dir)
        where = (self._progress.describe() if self._progress is not None else
                 f"no checkpoint was being moved (verl's tracker names step {tracker}; the checkpoints the guard "
                 f"set aside before are named by the set_aside events in {self.events.path})")
        say(f"lrstab guard: error: {err}. verl was stopped; {where}; {self.run_dir / STATE} is the last one written "
            f"whole{' (it holds the decided moves: --resume finishes them)' if self._progress else ''}. Free space "
            f"or make the folder writable, then: lrstab guard --resume {self.run_dir}")
        return STATUS_IO_ERROR

    def _end(self, status: str, code: int) -> int:
        self._st.status = status
        self._save()
        return code

    def _finish(self, records: dict[int, dict]) -> int:
        st = self._st
        final = self._write_final(records)
        self.events.write("done", max(records, default=0), metrics=str(final), rollbacks=st.attempt,
                          restarts=st.restarts)
        return self._end("done", 0)

    def _warn_stale_tracker(self) -> None:
        stale = stale_tracker(self.plan.checkpoint_dir, self.plan.save_contents) if not self.plan.async_save else None
        if stale is None:
            return
        message = (f"verl's tracker {self.plan.checkpoint_dir / 'latest_checkpointed_iteration.txt'} names step "
                   f"{stale[0]}, but the checkpoint at step {stale[1]} has all its shards and data.pt: the tracker is "
                   f"stale (verl writes it last). The guard counts checkpoints up to step {stale[0]} only; later "
                   "ones are moved aside (never deleted) before verl could save over them. Fix the tracker to resume "
                   "from the newer one")
        logger.warning("lrstab guard: %s", message)
        say(f"lrstab guard: warning: {message}")
        self.events.write("stale_tracker", stale[0], tracker_step=stale[0], newest_checkpoint=stale[1])

    def _run(self) -> int:
        for w in self.plan.warnings:
            logger.warning("lrstab guard: %s", w)
        if self.state is None:
            self._start()
            target = None  # the user's own resume_mode on the first launch
        else:
            records = self._trajectory()
            if (not self._st.pending and self.plan.total_steps is not None
                    and max(records, default=0) >= self.plan.total_steps):
                return self._finish(records)  # verl had finished; the guard died writing the result
            target = self._continue(records)
        return self._supervise(target)

    def _start(self) -> None:
        """A new run: its state made, the folders verl would save over moved aside (``__init__`` checked
        the first launch: :func:`.preflight.first_launch`)."""
        self.state = self._new_state()
        self.events.write("start", 0, command=self.launcher + self.overrides, run_dir=str(self.run_dir),
                          checkpoints=str(self.plan.checkpoint_dir), save_freq=self.plan.save_freq,
                          max_rollbacks=self.options.max_rollbacks, warnings=self.plan.warnings)
        self._warn_stale_tracker()
        checked = self._first
        assert checked is not None  # __init__ checks the first launch of every new run
        if checked.scratch:
            self._set_aside(None, "before-start")
        elif checked.keep is not None:  # verl would save over the folders after its resume step
            self._set_aside(checked.keep, "before-start")

    def _continue(self, records: dict[int, dict]) -> Optional[int]:
        """A run continued (``--resume``, or the same command again): the checkpoint folder checked, a
        set-aside the dead guard had decided finished; returns the step to resume from (None: from scratch)."""
        st = self._st
        problem = resume_problem(self.plan, st, max(records, default=0),
                                 self._complete(exclude=st.bad_checkpoints), self.run_dir)
        if problem:  # checked before anything moves: the run stays resumable as it is
            raise GuardError(problem)
        if not self._checkpoints.held:
            self._lock_checkpoints()
        self._finish_pending()  # a set-aside the dead guard had decided but not finished
        problem = tracker_problem(self.plan)
        if problem:
            raise GuardError(problem)
        self._warn_stale_tracker()
        target = self._newest(st)
        after_failure = st.status == "failed"
        if after_failure:  # the cause fixed: a fresh --max-restarts, the same LR rule (saved before the launch)
            st.status, st.restarts = "running", 0
        self.events.write("resumed", target or 0, checkpoint_step=target, attempt=st.attempt,
                          rule=asdict(st.rules[-1]) if st.rules else None, after_failure=after_failure)
        say(f"lrstab guard: continuing the guarded run of {self.run_dir} from the checkpoint at step "
            f"{target} (rollbacks so far: {st.attempt})")
        return target

    def _supervise(self, target: Optional[int]) -> int:
        """Launch verl from ``target`` and answer the end of each launch (a trouble: a rollback; a failed
        load: an older checkpoint; a crash: a restart) until the run is done, given up or failed; returns
        the exit status."""
        st = self._st
        resume_tries, limit = 0, None  # tries of the current decision; the newest step it may use
        while True:
            seg = self._new_segment(target)
            trouble, rc = self._launch(seg, self._extra(target), after=st.after)
            records = self._trajectory()
            if trouble is None and rc == 0:
                return self._finish(records)
            if trouble is None:
                older = self._resume_older(seg, rc, target, limit, resume_tries, records)
                if older is not None:
                    target, resume_tries = older, resume_tries + 1
                    continue
                if st.restarts < self.options.max_restarts and self._complete(exclude=st.bad_checkpoints):
                    target, resume_tries, limit = self._restart(seg, rc, records), 0, None
                    continue
                return self._fail(seg, rc, records)
            self.events.write(trouble.reason, trouble.step, onset_step=trouble.onset, surge_step=trouble.surge_step)
            if st.attempt >= self.options.max_rollbacks:
                return self._give_up(trouble, records)
            limit = trouble.onset - self.options.margin
            ckpt = choose_checkpoint(self._complete(exclude=st.bad_checkpoints), trouble.onset, self.options.margin)
            if ckpt is None:
                why = no_checkpoint_reason(self._complete(), st.bad_checkpoints, trouble.onset, self.options.margin)
                return self._give_up(trouble, records, why)
            target, resume_tries = self._roll_back(trouble, ckpt, seg, records), 0

    def _new_segment(self, target: Optional[int]) -> Path:
        """The next launch's metrics file, recorded in the state (saved) with its first step."""
        st = self._st
        # a new number for each launch (a launch that logged nothing still left its .log)
        k = max(_next_index(self.run_dir, "segment-{}.jsonl"), _next_index(self.run_dir, "segment-{}.log"))
        seg = self.run_dir / f"segment-{k}.jsonl"
        first = (target if target is not None else 0 if self._first and self._first.scratch
                 else self._user_start()) + 1
        st.segments.append((str(seg), first))
        st.resumed_at = target
        self._save()
        return seg

    def _resume_older(self, seg: Path, rc: int, target: Optional[int], limit: Optional[int], tries: int,
                      records: dict[int, dict]) -> Optional[int]:
        """After a launch that ended with no trouble and a non-zero ``rc``: when its checkpoint failed to
        load (verl says so, or died while loading), that checkpoint is marked bad (``resume_failed``) and
        the next older one is made the one to resume from (at or before ``limit`` for a rollback's; a
        rollback's LR rule moves with it) and returned. None: the load did not fail, or no older
        checkpoint is left to try (``--max-resume-tries``)."""
        st = self._st
        log = seg.with_suffix(".log")
        loaded = target if target is not None else (self._user_start() or None)  # the first launch's own
        if loaded is None or read_metrics(seg) or not log_failed_to_load(log):
            return None
        st.bad_checkpoints.append(loaded)
        older = [s for s in self._complete(exclude=st.bad_checkpoints) if s < loaded
                 and (limit is None or s <= limit)]
        if tries + 1 >= self.options.max_resume_tries:
            older = []
        self.events.write("resume_failed", loaded, checkpoint_step=loaded, returncode=rc, log=str(log),
                          next_checkpoint=max(older, default=None))
        if not older:
            return None
        if st.rules and st.rules[-1].checkpoint_step == loaded:  # a rollback's resume
            failed = st.rules.pop()
            self._push_rule(max(older), failed.base_period, records)
            st.after = max(older)
            return self._retarget(max(older), self.options.skip_batches)
        return self._retarget(max(older))

    def _restart(self, seg: Path, rc: int, records: dict[int, dict]) -> int:
        """A verl crash outside a rollback: restart from the newest complete checkpoint (returned), the
        unfinished saves after it moved aside."""
        st = self._st
        log = seg.with_suffix(".log")
        st.restarts += 1
        target = max(self._complete(exclude=st.bad_checkpoints))
        self._set_aside(target, "restart")
        self.events.write("restart", max(records, default=0), returncode=rc, checkpoint_step=target,
                          restarts=st.restarts, log=str(log))
        say(f"lrstab guard: verl exited with status {rc} (log: {log}); restart {st.restarts} "
            f"(--max-restarts {self.options.max_restarts}) from the checkpoint at step {target}")
        return target

    def _fail(self, seg: Path, rc: int, records: dict[int, dict]) -> int:
        """verl failed, its restarts used up: status 4."""
        log = seg.with_suffix(".log")
        self._write_final(records)
        self.events.write("failed", max(records, default=0), returncode=rc, log=str(log))
        say(f"lrstab guard: verl exited with status {rc} (log: {log})")
        return self._end("failed", STATUS_FAILED)

    def _give_up(self, trouble: Trouble, records: dict[int, dict], why: Optional[str] = None) -> int:
        """A trouble the guard does not answer: the rollbacks used up, or (``why``) no checkpoint answers
        it. Status 3."""
        st = self._st
        self._write_final(records)
        if why is None:
            self.events.write("gave_up", trouble.step, reason=trouble.reason, rollbacks=st.attempt)
            say(f"lrstab guard: {trouble.reason} at step {trouble.step} after {st.attempt} rollback(s) "
                f"(--max-rollbacks {self.options.max_rollbacks}): stopping; the run and its checkpoints are in "
                f"{self.plan.checkpoint_dir}")
        else:
            self.events.write("gave_up", trouble.step, reason=trouble.reason, rollbacks=st.attempt, why=why)
            say(f"lrstab guard: {trouble.reason} at step {trouble.step} (onset {trouble.onset}), but {why} in "
                f"{self.plan.checkpoint_dir}: stopping")
        return self._end("gave_up", STATUS_GAVE_UP)

    def _roll_back(self, trouble: Trouble, ckpt: int, seg: Path, records: dict[int, dict]) -> int:
        """Decide the rollback to ``ckpt`` (the LR rule, where the abandoned segment goes), write the
        decision, then carry it out (:meth:`_finish_pending`); returns ``ckpt``, the step to resume from."""
        st = self._st
        if self.options.skip_batches:  # checked before anything moves (raises naming data.pt and the key)
            skipped_data_state(self.plan.checkpoint_dir / f"global_step_{ckpt}", self.options.skip_batches,
                               self.plan.batch_size)
        st.attempt += 1
        period = decay_period_for(trouble, self.plan.length_surge)
        rule = self._push_rule(ckpt, period, records)
        dest = self._fresh_dir("attempt", st.attempt)
        # the decision first (the state names the rollback and what to move), then the moves: a guard
        # that dies or fails in between finishes them on --resume (_finish_pending)
        st.segments[-1] = (str(dest / "metrics.jsonl"), st.segments[-1][1])
        st.after = ckpt
        # the rollback event is part of the decision: written when the journal is carried out (once)
        rollback = {"event": "rollback", "step": trouble.step, "id": f"rollback-{dest}", "checkpoint_step": ckpt,
                    "onset_step": trouble.onset, "attempt": st.attempt, "reason": trouble.reason,
                    "decay_period": rule.decay_period, "decay_from_step": rule.decay_from_step,
                    "halvings_at_checkpoint": rule.halvings, "skip_batches": rule.skip_batches,
                    "abandoned_metrics": str(dest / "metrics.jsonl")}
        st.pending = self._pending(ckpt, dest, segment=str(seg), skip=self.options.skip_batches, events=[rollback])
        self._save()
        say(f"lrstab guard: {trouble.reason} at step {trouble.step} (onset {trouble.onset}): rollback "
            f"{st.attempt} to the checkpoint at step {ckpt}, LR x{self.plan.length_surge.gamma:g} of the LR "
            f"in force there ({rule.halvings} decay(s)), then every {rule.decay_period} steps", file=sys.stdout)
        self._finish_pending()
        return ckpt

    # -- what each launch resumes from -------------------------------------------------------------
    def _user_start(self) -> int:
        """The step the first launch resumes at under the user's own ``resume_mode`` (0: from scratch)."""
        if self.plan.resume_mode == "auto":
            return read_tracker(self.plan.checkpoint_dir) or 0
        if self.plan.resume_mode == "resume_path":
            return step_of(Path(user_value(self.overrides, "trainer.resume_from_path") or "").name) or 0
        return 0

    def _newest(self, st: GuardState) -> Optional[int]:
        """After the guard's own death: the newest complete checkpoint of this run (None: from scratch,
        the unfinished saves moved aside; :func:`.preflight.resume_problem` refused the rest)."""
        steps = self._complete(exclude=st.bad_checkpoints)
        if steps:
            return self._retarget(max(steps))
        if step_folders(self.plan.checkpoint_dir):
            self._set_aside(None, "incomplete")
        return None

    def _retarget(self, step: int, skip: int = 0) -> int:
        self._set_aside(step, "incomplete", skip)
        return step

    def _pending(self, step: Optional[int], dest: Path, segment: Optional[str] = None, skip: int = 0,
                 events: Sequence[dict] = ()) -> Pending:
        """The journal entry of a set-aside (:mod:`.moves`): keep ``step`` (None: nothing, from scratch);
        ``events``: written (each once) before the moves are made."""
        return Pending(checkpoint_step=step or 0, scratch=step is None, dest=str(dest),
                       local=str(local_dir(self.plan.checkpoint_dir, self.run_dir, dest)), segment=segment,
                       skip_batches=skip, events=list(events))

    def _set_aside(self, step: Optional[int], kind: str, skip: int = 0) -> None:
        """Move the ``global_step_N`` folders after ``step`` (all of them when None) aside to a fresh
        ``abandoned/<kind>-K``; the tracker names ``step`` (and with ``skip``, move ``step``'s
        dataloader position on). Journaled: see :meth:`_finish_pending`."""
        k = self._st.restarts if kind == "restart" else None
        self._st.pending = self._pending(step, self._fresh_dir(kind, k), skip=skip)
        self._save()
        self._finish_pending()

    def _finish_pending(self) -> None:
        """Carry out the set-aside the state names (``pending``; :func:`.moves.carry_out`), then clear
        it. Every part can be redone, so a guard that died or failed midway finishes it on ``--resume``."""
        pending = self._st.pending
        if pending is None:
            return
        for event in pending.events:  # the decision's own events (a rollback's), each once
            self.events.write(event["event"], event.get("step"),
                              **{k: v for k, v in event.items() if k not in ("event", "step")})
        self._progress = Progress(self.plan.checkpoint_dir, pending.checkpoint_step, scratch=pending.scratch)
        carry_out(self.plan.checkpoint_dir, pending, self._progress, self.plan.save_contents,
                  batch_size=self.plan.batch_size)
        # what this set-aside moved, those a guard that died midway moved included: its destination holds them
        dest = Path(pending.dest)
        moved = {p.name: str(p.resolve()) for p in sorted(dest.iterdir()) if step_of(p.name) is not None} \
            if dest.is_dir() else {}
        if moved:
            self.events.write("set_aside", None if pending.scratch else pending.checkpoint_step,
                              id=f"set_aside-{dest}", dest=pending.dest, moved=moved)
        self._st.pending = None
        self._save()
        self._progress = None

    def _fresh_dir(self, kind: str, k: Optional[int] = None) -> Path:
        """``abandoned/<kind>-K`` (K: ``k``, or the next free one), never a folder already holding something."""
        root = self.run_dir / "abandoned"
        dest = root / f"{kind}-{k if k is not None else _next_index(root, kind + '-{}')}"
        while dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            dest = root / f"{kind}-{_next_index(root, kind + '-{}')}"
        return dest

    def _push_rule(self, ckpt: int, period: int, records: dict) -> Rule:
        """The LR rule from ``ckpt`` on: one more decay than the one in force there (compounding)."""
        st = self._st
        alive = [r for r in st.rules if r.checkpoint_step < ckpt]  # the rules of the kept trajectory
        in_force = (alive[-1].decay_from_step, alive[-1].decay_period) if alive else None
        n = halvings_in_force(ckpt, records, in_force, self.plan.length_surge.gamma)
        if st.rules:  # and below the rule of the segment that failed, at the same update (a replay compounds)
            last = st.rules[-1]
            n = max(n, num_decays(ckpt + 1, last.decay_period, "surge", last.decay_from_step))
        start, p = compounded_rule(ckpt, period, n)
        rule = Rule(checkpoint_step=ckpt, decay_from_step=start, decay_period=p, halvings=n, base_period=period,
                    attempt=st.attempt, skip_batches=self.options.skip_batches)
        st.rules = alive + [rule]
        return rule

    def _extra(self, target: Optional[int]) -> list[str]:
        """The overrides of a launch: none on the first (the user's resume_mode), else verl's resume
        from ``target`` (from scratch when None) and the LR rule in force."""
        st = self._st
        if target is None and not st.segments[:-1]:  # the first launch
            scratch = self._first is not None and self._first.scratch and self.plan.resume_mode != "disable"
            return [override("trainer.resume_mode", "disable")] if scratch else []
        if target is None:
            return [override("trainer.resume_mode", "disable")]
        rules = [r for r in st.rules if r.checkpoint_step <= target]
        if not rules:
            return resume_overrides(self.plan.checkpoint_dir, target)
        r = rules[-1]
        return rollback_overrides(self.plan.checkpoint_dir, target, r.decay_period, r.attempt, self.options,
                                  self.plan, decay_from_step=r.decay_from_step)

    def _launch(self, seg: Path, extra: list[str], after: int):
        """Run verl once; stop it at the first trouble after ``after``. Returns ``(trouble, returncode)``."""
        left = stop_survivors(str(self.run_dir))  # a previous launch's processes (a watchdog killed, a guard killed)
        if left:
            raise GuardError(f"processes of the previous launch of this run survive SIGKILL (pids {left}; "
                             "uninterruptible, in the kernel's D state?): a second verl would train beside them on "
                             f"the same checkpoints. Stop them, then: lrstab guard --resume {self.run_dir}")
        # every process of the launch carries ENV_RUN (inherited): what survives it is found and stopped above
        env = {**self.env, "VERL_FILE_LOGGER_PATH": str(seg), ENV_RUN: str(self.run_dir)}
        overrides = self.overrides
        if extra:
            overrides = [o for o in overrides if key_of(o) not in ("trainer.resume_mode", "trainer.resume_from_path")]
        cmd = self.launcher + overrides + self._logger_override + extra
        log = seg.with_suffix(".log")
        with io_step("write verl's log", log):
            out = open(log, "w")
            try:
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
            except BaseException:
                out.close()
                raise
        with out:
            with io_step("make verl's metrics file", seg):
                self._metrics, self._moved_told = MetricsFile(seg), False
            # the watchdog holds the run folder's and the checkpoint folder's locks too: they stay locked
            # until verl is stopped
            keep = ((self._lock,) if self._lock is not None else ()) + self._checkpoints.fds()
            try:
                proc, lifeline = start_supervised(cmd, cwd=self.cwd, env=env, stdout=out, keep_fds=keep)
            except BaseException:
                self._metrics.close()
                self._metrics = None
                raise
            try:
                seen = None
                while True:
                    try:
                        proc.wait(timeout=self.poll_s)
                        finished = True
                    except subprocess.TimeoutExpired:
                        finished = False
                    self._hold_locks()
                    records = self._trajectory()
                    trouble = None
                    if (len(records), max(records, default=0)) != seen:  # judge each new step once
                        seen = (len(records), max(records, default=0))
                        trouble = find_trouble(records, self._options_now(), self.plan.length_surge, after)
                    if trouble is not None:
                        stop_group(proc)
                        return trouble, proc.returncode
                    if finished:
                        return None, proc.returncode
            except BaseException:
                stop_group(proc)  # killing the guard stops verl too; its checkpoints stay where they are
                raise
            finally:
                os.close(lifeline)
                metrics, self._metrics = self._metrics, None
                try:
                    with io_step("put verl's metrics back in", seg):
                        metrics.put_back()
                finally:
                    metrics.close()

    def _hold_locks(self) -> None:
        """The run folder's and the checkpoint folder's lock files are still the ones held (a deleted one is
        taken anew)."""
        try:
            self._lock = lock_run_dir(self.run_dir, held=self._lock)
        except RunDirBusy as busy:
            raise GuardError(busy_message(self.run_dir, busy.pid) + "; this guard stopped its verl") from None
        try:
            self._checkpoints.check()
        except CheckpointsBusy as busy:
            raise GuardError(checkpoints_busy_message(self.plan.checkpoint_dir, busy.holder)
                             + "; this guard stopped its verl") from None
        except OSError as err:
            raise GuardIOError("take the checkpoint folder's lock file anew", self._checkpoints.path, err) from None

    def _options_now(self) -> GuardOptions:
        """A surge is answered once: the rollback starts the decay (the remedy for a surge); after it,
        only a reward crash or a non-finite loss rolls back again."""
        if self._st.attempt > 0 and self.options.on_surge:
            return replace(self.options, on_surge=False)
        return self.options

    def _trajectory(self) -> dict[int, dict]:
        """The run so far: each segment's steps, later segments replacing from where they resumed."""
        merged: dict[int, dict] = {}
        for path, first in self._st.segments:
            merged = {s: d for s, d in merged.items() if s < first}
            merged.update({s: d for s, d in self._read_segment(Path(path)).items() if s >= first})
        return merged

    def _read_segment(self, path: Path) -> dict[int, dict]:
        """A segment's metrics; the running launch's through :class:`.metrics.MetricsFile` (followed when
        renamed or replaced: a ``metrics_moved`` event). A read error (a transient EIO) is retried
        :data:`READ_TRIES` times, then a ``read_retried`` event; one that lasts ends the guard (status 5)."""
        running = self._metrics if self._metrics is not None and path == self._metrics.path else None
        error: Optional[OSError] = None
        for tries in range(1, READ_TRIES + 1):
            try:
                records = running.read() if running is not None else read_metrics(path)
            except OSError as err:
                error = err
                time.sleep(READ_PAUSE_S)
                continue
            if error is not None:
                self.events.write("read_retried", None, path=str(path), error=str(error), tries=tries)
            if running is not None and running.moved and not self._moved_told:
                self._moved_told = True
                self.events.write("metrics_moved", max(records, default=None), path=str(path), followed=True)
                say(f"lrstab guard: warning: verl's metrics file {path} was renamed or replaced while verl writes it; "
                    "the guard follows the file verl writes, and puts its lines back under that name after the launch")
            return records
        assert error is not None  # the loop returns unless every try failed
        raise GuardIOError("read verl's metrics", path, error)

    def _write_final(self, records: dict[int, dict]) -> Path:
        path = self.run_dir / "metrics.jsonl"
        text = "".join(json.dumps({"step": step, "data": records[step]}, allow_nan=True) + "\n"
                       for step in sorted(records))
        with io_step("write the final metrics", path):
            write_atomic(path, text)
        return path
