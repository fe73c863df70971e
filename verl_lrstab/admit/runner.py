"""``lrstab admit``: run each candidate rollout configuration in verl's real ``main_ppo`` at LR 0.

For each candidate (a name and verl overrides on top of the user's command) the runner checks
the configuration (:mod:`verl_lrstab.mismatch_checks`), runs a few steps with no parameter update
(``optim.lr=0``; the ``length_surge`` scheduler in ``monitor_only`` mode only so that the
package's ``actor/mismatch/*`` figures are logged every step), and judges the logged figures
against the budget (:mod:`verl_lrstab.admit.verdict`). One failing candidate is reported and the others
still run. Each candidate is its own ``main_ppo`` launch; with ``ray_address`` every launch joins
that one Ray cluster (verl's ``ray_kwargs.ray_init.address``), else each starts its own. The wall
time per candidate is in the report.

A candidate's ``env:NAME=VALUE`` tokens set an environment variable for that candidate only: in
the launch's environment and in verl's Ray ``runtime_env`` (so it reaches every worker, also on a
shared cluster), e.g. ``env:VLLM_ATTENTION_BACKEND=FLASHINFER``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from verl_lrstab.admit.verdict import (DEFAULT_BUDGET_K3, Budget, CandidateReport, calibrated_budget, judge,
                                       plot_tails, report_json, report_table)
from verl_lrstab._numbers import finite_float
from verl_lrstab.config import OPTIM_KEY
from verl_lrstab.mismatch_checks import check_rollout_config
from verl_lrstab.guard.supervisor import (compose_config, raise_on_signal, split_command, start_supervised,
                                          stop_group)
from verl_lrstab.runs import read_metrics

OPTIM = OPTIM_KEY
NO_UPDATE = [
    f"{OPTIM}.lr=0.0",  # AdamW's step and its decoupled weight decay both scale with the LR: no parameter moves
    f"{OPTIM}.lr_warmup_steps=0",
    f"{OPTIM}.lr_scheduler_type=length_surge",
    f"++{OPTIM}.length_surge.monitor_only=true",  # logs actor/mismatch/* every step
]
# Defaults a candidate may override (e.g. a checkpoint to check that no weight moved).
QUIET = ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false"]
ENV_PREFIX = "env:"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Candidate:
    name: str
    overrides: list
    env: dict = field(default_factory=dict)

    def launch_overrides(self) -> list:
        """The verl overrides, plus the environment as Ray ``runtime_env`` entries (quoted: strings)."""
        return self.overrides + [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in self.env.items()]


def parse_candidate(text: str) -> Candidate:
    """``NAME=override override ... env:VAR=VALUE ...`` (space-separated; nothing for the base command)."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9._-]+", name.strip()):
        raise ValueError(f"--candidate {text!r}: expected NAME=\"override override ...\" with a NAME of letters, "
                         "digits, '-', '_' or '.'")
    overrides, env = [], {}
    for token in rest.split():
        if not token.startswith(ENV_PREFIX):
            overrides.append(token)
            continue
        var, eq, value = token[len(ENV_PREFIX):].partition("=")
        if not eq or not _ENV_NAME.match(var) or "'" in value:
            raise ValueError(f"--candidate {name.strip()}: {token!r} is not env:NAME=VALUE (a variable name, a value "
                             "without quotes)")
        env[var] = value
    return Candidate(name.strip(), overrides, env)


def run_candidates(command: Sequence[str], candidates: Sequence[Candidate], steps: int, out_dir: Path,
                   budget: Optional[Budget] = None, reference: Optional[str] = None, factor: float = 4.0,
                   env: Optional[dict] = None, cwd: Optional[Path] = None, timeout_s: float = 1800,
                   ray_address: Optional[str] = None, progress=None) -> dict:
    """Run and judge every candidate; write ``admit.json`` and ``admit.md`` under ``out_dir``.

    Args:
        command: ``python -m verl.trainer.main_ppo <the user's overrides>``.
        candidates: names and overrides, run in order.
        steps: no-update steps per candidate (>= 2; 4+ for the drift test).
        out_dir: the report's folder (each candidate's verl metrics and log go there too).
        budget: a fixed budget; None: ``reference`` x ``factor`` if given, else the default.
        env, cwd: the command's environment and folder (default: this process's).
        timeout_s: hard limit per candidate (``--timeout``): past it the candidate is stopped and ``failed``.
        ray_address: a running Ray cluster every candidate joins (None: each starts its own).
        progress: called with a line as each candidate starts and ends (None: silent).

    Returns:
        The JSON report (see :func:`verl_lrstab.admit.verdict.report_json`), with ``wall_s`` per candidate,
        ``warnings``, ``complete`` and ``not_run``. The report is rewritten after every candidate
        and on Ctrl-C (KeyboardInterrupt, re-raised after the write).
    """
    if steps < 2:
        raise ValueError(f"--steps must be >= 2, got {steps}")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"--candidate names must be given and distinct, got {names}")
    if reference is not None and reference not in names:
        raise ValueError(f"--reference {reference!r} is not a candidate: allowed values are {names}")
    # checked before the first candidate runs: a bad number found after them would cost every run
    if reference is not None and (finite_float(factor) is None or factor <= 0):
        raise ValueError(f"--budget-factor={factor!r} is invalid: allowed values are a number > 0")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"--timeout={timeout_s!r} is invalid: allowed values are a number of seconds > 0 (inf: none)")
    launcher, base = split_command(command)
    cwd = Path(cwd or os.getcwd()).resolve()
    env = dict(os.environ if env is None else env)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, raise_on_signal)  # a killed admit stops its candidate
    try:
        return _run_all(launcher, base, candidates, steps, out_dir, budget, reference, factor, env, cwd,
                        timeout_s, ray_address, progress)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_all(launcher, base, candidates, steps, out_dir, budget, reference, factor, env, cwd, timeout_s,
             ray_address, progress) -> dict:
    results = []  # (candidate, per-step rows, findings, error, wall)
    joins = [f"++ray_kwargs.ray_init.address={ray_address}"] if ray_address else []
    say = progress or (lambda line: None)
    data: dict = {}  # candidates are never empty (run_candidates checks): the last report
    try:
        for i, cand in enumerate(candidates, 1):
            results.append(_run_one(launcher, base + QUIET + joins, cand, steps, out_dir, env, cwd, timeout_s,
                                    f"[{i}/{len(candidates)}]", say))
            # the report so far, after every candidate (a later failure or Ctrl-C keeps it)
            data = write_report(results, candidates, out_dir, budget, reference, factor, say, final=i == len(candidates))
    except KeyboardInterrupt:
        data = write_report(results, candidates, out_dir, budget, reference, factor, say, final=True, interrupted=True)
        say(f"interrupted: the report of the {len(results)} finished candidate(s) is in {out_dir / 'admit.json'}")
        raise
    return data


def _run_one(launcher, base, cand, steps, out_dir, env, cwd, timeout_s, tag, say):
    """One candidate's launch: ``(candidate, per-step rows, findings, error, wall seconds)``."""
    overrides = base + cand.launch_overrides() + NO_UPDATE + [f"trainer.total_training_steps={steps}"]
    say(f"{tag} {cand.name}: {steps} steps at LR 0 ...")
    try:
        findings = check_rollout_config(compose_config(launcher, overrides, cwd))
    except Exception as exc:  # noqa: BLE001 - a bad override: this candidate fails, the others run
        error = f"its overrides do not compose ({' '.join(cand.overrides)}): {exc}"
        say(f"{tag} {cand.name}: {error}")
        return cand, [], [], error, 0.0
    metrics, log = out_dir / f"{cand.name}.jsonl", out_dir / f"{cand.name}.log"
    metrics.unlink(missing_ok=True)
    start = time.monotonic()
    error = None
    with open(log, "w") as out:
        # under the guard's watchdog, in its own session: Ctrl-C / SIGTERM / SIGKILL of admit stop the
        # candidate with its Ray daemons, rather than failing this candidate and starting the next one
        proc, lifeline = start_supervised(launcher + overrides + ["trainer.logger=[console,file]"], cwd=cwd,
                                          env={**env, **cand.env, "VERL_FILE_LOGGER_PATH": str(metrics)}, stdout=out)
        try:
            proc.wait(timeout=timeout_s)
            if proc.returncode != 0:
                error = f"verl exited with status {proc.returncode} ({_last_error(log)}; log: {log})"
        except subprocess.TimeoutExpired:
            error = f"no result within --timeout {timeout_s:.0f} s (log: {log})"
        finally:
            stop_group(proc)
            os.close(lifeline)
    records = read_metrics(metrics)
    rows = [records[s] for s in sorted(records)]
    k3 = " ".join(f"{v:.3g}" if isinstance(v, (int, float)) else "-"
                  for v in (r.get("actor/mismatch/k3") for r in rows))
    say(f"{tag} {cand.name}: " + (error or f"{len(rows)} steps, k3 by step {k3 or '-'}")
        + f" ({time.monotonic() - start:.0f} s)")
    return cand, rows, findings, error, time.monotonic() - start


def _last_error(log: Path) -> str:
    """The last line of verl's log that names an error (what a reader of the report needs first)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    hits = [line.strip() for line in lines if re.search(r"(Error|Exception|error:)", line)]
    return (hits[-1] if hits else (lines[-1].strip() if lines else "empty log"))[:300]


def write_report(results, candidates, out_dir: Path, budget, reference, factor, say=None, final=True,
                 interrupted=False) -> dict:
    """Judge the candidates run so far and write ``admit.json`` / ``admit.md`` / ``admit.png``
    (atomically: a reader never sees half a file). A ``reference`` that failed (or has no k3)
    falls back to the default budget with a warning; one not run yet gives a provisional default."""
    say = say or (lambda line: None)
    warnings = []
    provisional = budget or Budget(1.0)
    reports = [judge(c.name, rows, provisional, findings, err) for c, rows, findings, err, _ in results]
    if budget is None:
        budget = Budget(DEFAULT_BUDGET_K3)
        if reference and any(r.name == reference for r in reports):
            try:
                budget = calibrated_budget(reports, reference, factor)
            except ValueError as err:
                warnings.append(f"{err}: the default budget {DEFAULT_BUDGET_K3:g} is used instead")
        elif reference:
            warnings.append(f"--reference {reference!r} has not run yet: the default budget is used so far")
        reports = [judge(c.name, rows, budget, findings, err) for c, rows, findings, err, _ in results]
    data = report_json(budget, reports)
    for entry, (cand, _, _, _, wall) in zip(data["candidates"], results):
        entry["wall_s"] = round(wall, 1)
        entry["overrides"] = cand.overrides
        entry["env"] = cand.env
    data["warnings"] = warnings
    data["complete"] = len(results) == len(candidates) and not interrupted
    data["not_run"] = [c.name for c in candidates[len(results):]]
    figure = None
    if final:  # progress lines read "lrstab admit ...": the figure's note joins them
        figure = plot_tails(reports, out_dir / "admit.png", say=lambda line: say(line.removeprefix("lrstab: ")))
    data["figure"] = None if figure is None else str(figure)
    _write_atomic(out_dir / "admit.json", json.dumps(data, indent=1))
    _write_atomic(out_dir / "admit.md", report_table(budget, reports) + "\n"
                  + "".join(f"\nwarning: {w}" for w in warnings) + ("\n" if warnings else "")
                  + (f"\nnot run (interrupted): {', '.join(data['not_run'])}\n" if interrupted and data["not_run"] else ""))
    if final:
        for w in warnings:
            say(f"warning: {w}")
    return data


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def print_report(data: dict, out_dir: Path) -> None:
    """What ``lrstab admit`` prints after the runs: the table, each candidate's reasons, the figure."""
    print((out_dir / "admit.md").read_text())
    for c in data["candidates"]:
        for reason in c["reasons"]:
            print(f"{c['name']}: {reason}")
    if data.get("figure"):
        print(f"figure: {data['figure']}")


def reports_of(data: dict) -> list[CandidateReport]:
    return [CandidateReport(**{k: v for k, v in c.items() if k in CandidateReport.__dataclass_fields__})
            for c in data["candidates"]]
