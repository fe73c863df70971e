"""``lrstab admit``: run each candidate rollout configuration in verl's real ``main_ppo`` at LR 0.

For each candidate (a name and verl overrides on top of the user's command) the runner checks
the configuration (:mod:`verl_lrstab.config_checks`), runs a few steps with no parameter update
(``optim.lr=0``; the ``length_surge`` scheduler in ``monitor_only`` mode only so that the
package's ``actor/mismatch/*`` figures are logged every step), and judges the logged figures
against the budget (:mod:`verl_lrstab.admit`). One failing candidate is reported and the others
still run. Each candidate is its own ``main_ppo`` launch (its own Ray cluster): the wall time per
candidate is in the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from verl_lrstab.admit import (DEFAULT_BUDGET_K3, Budget, CandidateReport, calibrated_budget, judge, report_json,
                               report_table)
from verl_lrstab.config_checks import check_rollout_config
from verl_lrstab.guard.supervisor import compose_config, split_command
from verl_lrstab.runs import read_metrics

OPTIM = "actor_rollout_ref.actor.optim"
NO_UPDATE = [
    f"{OPTIM}.lr=0.0",  # AdamW's step and its decoupled weight decay both scale with the LR: no parameter moves
    f"{OPTIM}.lr_warmup_steps=0",
    f"{OPTIM}.lr_scheduler_type=length_surge",
    f"++{OPTIM}.length_surge.monitor_only=true",  # logs actor/mismatch/* every step
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


@dataclass
class Candidate:
    name: str
    overrides: list


def parse_candidate(text: str) -> Candidate:
    """``NAME=override override ...`` (the overrides space-separated; none for the base command)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or "/" in name or " " in name.strip():
        raise ValueError(f"--candidate {text!r}: expected NAME=\"override override ...\" with a NAME of letters, "
                         "digits, '-', '_' or '.'")
    return Candidate(name.strip(), rest.split())


def run_candidates(command: Sequence[str], candidates: Sequence[Candidate], steps: int, out_dir: Path,
                   budget: Optional[Budget] = None, reference: Optional[str] = None, factor: float = 4.0,
                   env: Optional[dict] = None, cwd: Optional[Path] = None, timeout_s: float = 1800) -> dict:
    """Run and judge every candidate; write ``admit.json`` and ``admit.md`` under ``out_dir``.

    Args:
        command: ``python -m verl.trainer.main_ppo <the user's overrides>``.
        candidates: names and overrides, run in order.
        steps: no-update steps per candidate (>= 2; 4+ for the drift test).
        out_dir: the report's folder (each candidate's verl metrics and log go there too).
        budget: a fixed budget; None: ``reference`` x ``factor`` if given, else the default.
        env, cwd: the command's environment and folder (default: this process's).
        timeout_s: hard limit per candidate.

    Returns:
        The JSON report (see :func:`verl_lrstab.admit.report_json`), with ``wall_s`` per candidate.
    """
    if steps < 2:
        raise ValueError(f"--steps must be >= 2, got {steps}")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"--candidate names must be given and distinct, got {names}")
    if reference is not None and reference not in names:
        raise ValueError(f"--reference {reference!r} is not a candidate: allowed values are {names}")
    launcher, base = split_command(command)
    cwd = Path(cwd or os.getcwd()).resolve()
    env = dict(os.environ if env is None else env)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []  # (candidate, per-step rows, findings, error, wall)
    for cand in candidates:
        overrides = base + cand.overrides + NO_UPDATE + [f"trainer.total_training_steps={steps}"]
        try:
            findings = check_rollout_config(compose_config(launcher, overrides, cwd))
        except Exception as exc:  # noqa: BLE001 - a bad override: this candidate fails, the others run
            results.append((cand, [], [], f"its overrides do not compose ({' '.join(cand.overrides)}): {exc}", 0.0))
            continue
        metrics, log = out_dir / f"{cand.name}.jsonl", out_dir / f"{cand.name}.log"
        metrics.unlink(missing_ok=True)
        start = time.monotonic()
        error = None
        with open(log, "w") as out:
            try:
                proc = subprocess.run(launcher + overrides + ["trainer.logger=[console,file]"], cwd=cwd,
                                      env={**env, "VERL_FILE_LOGGER_PATH": str(metrics)}, stdout=out,
                                      stderr=subprocess.STDOUT, timeout=timeout_s)
                if proc.returncode != 0:
                    error = f"verl exited with status {proc.returncode} (log: {log})"
            except subprocess.TimeoutExpired:
                error = f"no result within {timeout_s:.0f} s (log: {log})"
        records = read_metrics(metrics)
        results.append((cand, [records[s] for s in sorted(records)], findings, error, time.monotonic() - start))
    provisional = budget or Budget(1.0)
    reports = [judge(c.name, rows, provisional, findings, err) for c, rows, findings, err, _ in results]
    if budget is None:
        budget = calibrated_budget(reports, reference, factor) if reference else Budget(DEFAULT_BUDGET_K3)
        reports = [judge(c.name, rows, budget, findings, err) for c, rows, findings, err, _ in results]
    data = report_json(budget, reports)
    for entry, (cand, _, _, _, wall) in zip(data["candidates"], results):
        entry["wall_s"] = round(wall, 1)
        entry["overrides"] = cand.overrides
    (out_dir / "admit.json").write_text(json.dumps(data, indent=1))
    (out_dir / "admit.md").write_text(report_table(budget, reports) + "\n")
    return data


def reports_of(data: dict) -> list[CandidateReport]:
    return [CandidateReport(**{k: v for k, v in c.items() if k in CandidateReport.__dataclass_fields__})
            for c in data["candidates"]]
