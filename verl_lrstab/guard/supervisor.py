"""``lrstab guard -- python -m verl.trainer.main_ppo ...``: run verl, roll back on trouble, continue.

The guard is a supervisor around verl's own entry point. It launches the user's command with
verl's file logger pointed at a segment file, reads the metrics as verl writes them, and on a
trouble (:func:`.plan.find_trouble`) stops the run, keeps the abandoned segment (its metrics and
the checkpoints after the rollback point, moved aside), and relaunches the same command with
verl's own resume (``trainer.resume_mode=resume_path``) from the newest checkpoint at or before
the trouble's onset, the LR decay started there (:func:`.plan.rollback_overrides`). After at most
``max_rollbacks`` rollbacks a further trouble stops it with status 3.

The run directory holds ``lrstab_events.jsonl`` (one JSON object per line, each with ``event``
and ``step``: ``start``, ``surge`` / ``reward_crash`` / ``non_finite``, ``rollback``, ``done``,
``gave_up``, ``failed``), ``segment-K.jsonl`` (verl's metrics of each launch), ``abandoned/``
and ``metrics.jsonl`` (the final trajectory: each segment up to where the next one resumed).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from verl_lrstab.runs import read_metrics
from verl_lrstab.guard.plan import (GuardError, GuardOptions, RunPlan, checkpoint_steps, choose_checkpoint,
                                    decay_period_for, find_trouble, plan_run, rollback_overrides)

logger = logging.getLogger("verl_lrstab")

EVENTS = "lrstab_events.jsonl"
ENTRY = "verl.trainer.main_ppo"
STATUS_GAVE_UP, STATUS_FAILED = 3, 4


def split_command(command: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher, overrides)`` of ``python -m verl.trainer.main_ppo [--config-path P --config-name N] k=v ...``."""
    command = list(command)
    if ENTRY not in command or "-m" not in command or command.index("-m") + 1 != command.index(ENTRY):
        raise GuardError(f"the guarded command must run verl's entry point, `python -m {ENTRY} ...` (after `--`); "
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
    plain = [o for o in overrides if not o.startswith("hydra.")]
    if path is None:
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return compose(config_name=name, overrides=plain)
    directory = Path(path) if Path(path).is_absolute() else cwd / path
    with initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
        return compose(config_name=name, overrides=plain)


class EventLog:
    """``lrstab_events.jsonl``: one JSON object per line, flushed at once."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, step: Optional[int], **fields) -> dict:
        record = {"event": event, "step": step, "time": round(time.time(), 3), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


class Guard:
    """One guarded run (see the module docstring).

    Args:
        command: the user's command (``python -m verl.trainer.main_ppo ...``).
        run_dir: where the events, segments and final metrics go (default: next to verl's checkpoints).
        options: :class:`~.plan.GuardOptions`.
        env: the command's environment (default: this process's).
        cwd: where the command runs (default: the current directory).
        poll_s: how often the metrics are read.
    """

    def __init__(self, command: Sequence[str], run_dir: Optional[Path] = None, options: GuardOptions = GuardOptions(),
                 env: Optional[dict] = None, cwd: Optional[Path] = None, poll_s: float = 1.0):
        self.launcher, self.overrides = split_command(command)
        self.options, self.poll_s = options, poll_s
        self.cwd = Path(cwd or os.getcwd()).resolve()
        self.env = dict(os.environ if env is None else env)
        cfg = compose_config(self.launcher, self.overrides, self.cwd)
        self.plan: RunPlan = plan_run(cfg, self.cwd)
        loggers = list(cfg.trainer.get("logger", []) or [])
        # verl's file logger is what the guard reads: added when the run does not log to a file already
        self._logger_override = [] if "file" in loggers else [f"trainer.logger=[{','.join([*loggers, 'file'])}]"]
        self.run_dir = Path(run_dir or self.plan.checkpoint_dir.parent / "lrstab_guard").resolve()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".lrstab_write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise GuardError(f"--run-dir {self.run_dir}: cannot write there ({err.strerror}); pass a writable "
                             "--run-dir") from None
        self.events = EventLog(self.run_dir / EVENTS)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end; returns the exit status (0 done, 3 gave up, 4 verl failed)."""
        previous = signal.signal(signal.SIGTERM, raise_on_signal)  # a killed guard stops verl (see _launch)
        try:
            return self._run()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self) -> int:
        for w in self.plan.warnings:
            logger.warning("lrstab guard: %s", w)
        self.events.write("start", 0, command=self.launcher + self.overrides, run_dir=str(self.run_dir),
                          checkpoints=str(self.plan.checkpoint_dir), save_freq=self.plan.save_freq,
                          max_rollbacks=self.options.max_rollbacks, warnings=self.plan.warnings)
        segments: list[tuple[Path, int]] = []  # (metrics, first step of the segment)
        extra: list[str] = []
        attempt, after, resumed_at = 0, 0, 0
        while True:
            seg = self.run_dir / f"segment-{len(segments) + 1}.jsonl"
            seg.unlink(missing_ok=True)
            segments.append((seg, resumed_at + 1))
            trouble, rc = self._launch(seg, extra, segments, after)
            records = self._trajectory(segments)
            if trouble is None:
                if rc != 0:
                    self.events.write("failed", max(records, default=0), returncode=rc, log=str(seg.with_suffix(".log")))
                    print(f"lrstab guard: verl exited with status {rc} (log: {seg.with_suffix('.log')})", file=sys.stderr)
                    return STATUS_FAILED
                final = self._write_final(records)
                self.events.write("done", max(records, default=0), metrics=str(final), rollbacks=attempt)
                return 0
            self.events.write(trouble.reason, trouble.step, onset_step=trouble.onset, surge_step=trouble.surge_step)
            if attempt >= self.options.max_rollbacks:
                self._write_final(records)
                self.events.write("gave_up", trouble.step, reason=trouble.reason, rollbacks=attempt)
                print(f"lrstab guard: {trouble.reason} at step {trouble.step} after {attempt} rollback(s) "
                      f"(--max-rollbacks {self.options.max_rollbacks}): stopping; the run and its checkpoints are in "
                      f"{self.plan.checkpoint_dir}", file=sys.stderr)
                return STATUS_GAVE_UP
            ckpt = choose_checkpoint(checkpoint_steps(self.plan.checkpoint_dir), trouble.onset, self.options.margin)
            if ckpt is None:
                self._write_final(records)
                self.events.write("gave_up", trouble.step, reason=trouble.reason, rollbacks=attempt,
                                  why=f"no checkpoint at or before step {trouble.onset - self.options.margin}")
                print(f"lrstab guard: {trouble.reason} at step {trouble.step} (onset {trouble.onset}) but no checkpoint "
                      f"at or before step {trouble.onset - self.options.margin} in {self.plan.checkpoint_dir}: "
                      "stopping (a smaller trainer.save_freq would have one)", file=sys.stderr)
                return STATUS_GAVE_UP
            attempt += 1
            period = decay_period_for(trouble, self.plan.length_surge)
            abandoned = self._keep_abandoned(attempt, ckpt, seg)
            self.events.write("rollback", trouble.step, checkpoint_step=ckpt, onset_step=trouble.onset, attempt=attempt,
                              reason=trouble.reason, decay_period=period, abandoned_metrics=str(abandoned))
            print(f"lrstab guard: {trouble.reason} at step {trouble.step} (onset {trouble.onset}): rollback {attempt} to "
                  f"the checkpoint at step {ckpt}, LR halved from there, then every {period} steps", flush=True)
            extra = rollback_overrides(self.plan.checkpoint_dir, ckpt, period, attempt, self.options, self.plan)
            segments[-1] = (abandoned, segments[-1][1])
            after, resumed_at = ckpt, ckpt

    def _launch(self, seg: Path, extra: list[str], segments, after: int):
        """Run verl once; stop it at the first trouble after ``after``. Returns ``(trouble, returncode)``."""
        env = {**self.env, "VERL_FILE_LOGGER_PATH": str(seg)}
        overrides = [o for o in self.overrides if not o.startswith(("trainer.resume_mode=", "trainer.resume_from_path="))]
        cmd = self.launcher + overrides + self._logger_override + extra
        log = seg.with_suffix(".log")
        with open(log, "w") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                seen = None
                while True:
                    try:
                        proc.wait(timeout=self.poll_s)
                        finished = True
                    except subprocess.TimeoutExpired:
                        finished = False
                    records = self._trajectory(segments)
                    trouble = None
                    if (len(records), max(records, default=0)) != seen:  # judge each new step once
                        seen = (len(records), max(records, default=0))
                        trouble = find_trouble(records, self._options_now(segments), self.plan.length_surge, after)
                    if trouble is not None:
                        stop_group(proc)
                        return trouble, proc.returncode
                    if finished:
                        return None, proc.returncode
            except BaseException:
                stop_group(proc)  # killing the guard stops verl too; its checkpoints stay where they are
                raise

    def _options_now(self, segments) -> GuardOptions:
        """A surge is answered once: the rollback starts the decay (the remedy for a surge); after it,
        only a reward crash or a non-finite loss rolls back again."""
        if len(segments) > 1 and self.options.on_surge:
            from dataclasses import replace

            return replace(self.options, on_surge=False)
        return self.options

    def _trajectory(self, segments) -> dict[int, dict]:
        """The run so far: each segment's steps, later segments replacing from where they resumed."""
        merged: dict[int, dict] = {}
        for path, first in segments:
            merged = {s: d for s, d in merged.items() if s < first}
            merged.update({s: d for s, d in read_metrics(path).items() if s >= first})
        return merged

    def _keep_abandoned(self, attempt: int, ckpt: int, seg: Path) -> Path:
        """Move the abandoned segment's checkpoints after ``ckpt`` and its metrics aside (nothing is deleted)."""
        dest = self.run_dir / "abandoned" / f"attempt-{attempt}"
        dest.mkdir(parents=True, exist_ok=True)
        for step in checkpoint_steps(self.plan.checkpoint_dir):
            if step > ckpt:
                shutil.move(str(self.plan.checkpoint_dir / f"global_step_{step}"), str(dest / f"global_step_{step}"))
        moved = dest / "metrics.jsonl"
        shutil.move(str(seg), str(moved))
        if seg.with_suffix(".log").exists():
            shutil.copy(seg.with_suffix(".log"), dest / "verl.log")
        (self.plan.checkpoint_dir / "latest_checkpointed_iteration.txt").write_text(str(ckpt))
        return moved

    def _write_final(self, records: dict[int, dict]) -> Path:
        path = self.run_dir / "metrics.jsonl"
        with open(path, "w") as f:
            for step in sorted(records):
                f.write(json.dumps({"step": step, "data": records[step]}, allow_nan=True) + "\n")
        return path


def raise_on_signal(signum, frame):
    """A SIGTERM handler: unwind (``finally`` blocks stop the child) with status 128 + signum."""
    raise SystemExit(128 + signum)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop verl and every process of its group (Ray's daemons included)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

