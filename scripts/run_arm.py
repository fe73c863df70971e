#!/usr/bin/env python
"""Run one arm of the experiment kit with verl's own entry point.

    python scripts/run_arm.py ARM [hydra overrides ...] [--dry-run]
    python scripts/run_arm.py --list

ARM is a config of ``configs/experiments`` (``paper_constant``, ``paper_tis``, ...,
``starter_gsm8k``). This runs::

    python -m verl.trainer.main_ppo --config-path <repo>/configs/experiments --config-name ARM \\
        trainer.experiment_name=ARM[-MODEL][-ENGINE] [overrides ...]

with ``VERL_FILE_LOGGER_ROOT=runs`` unless set, so verl's file logger writes
``runs/<project>/<experiment>.jsonl``, which ``lrstab compare`` reads afterwards. The model
(``paper_model=qwen3_8b``) and the rollout engine (``actor_rollout_ref.rollout.name=sglang``)
are switched by one override each; they are added to the experiment name so arms do not
overwrite each other's logs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "experiments"


def arms() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def command(arm: str, overrides: list[str]) -> list[str]:
    """The main_ppo command line for ``arm`` (raises ValueError for an unknown arm)."""
    if arm not in arms():
        raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(arms())}")
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    name = arm
    if "paper_model" in given:
        name += "-" + given["paper_model"]
    if "actor_rollout_ref.rollout.name" in given:
        name += "-" + given["actor_rollout_ref.rollout.name"]
    extra = [] if "trainer.experiment_name" in given else [f"trainer.experiment_name={name}"]
    return [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR),
            "--config-name", arm, *extra, *overrides]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Own flags may come anywhere; everything else is the arm and Hydra's overrides (never "--x").
    flags = {a for a in argv if a in ("--list", "--dry-run", "-h", "--help")}
    rest = [a for a in argv if a not in flags]
    if flags & {"-h", "--help"}:
        print(__doc__)
        return 0
    if "--list" in flags or not rest:
        print("\n".join(arms()))
        return 0
    arm, overrides = rest[0], rest[1:]
    try:
        cmd = command(arm, overrides)
    except ValueError as err:
        print(f"run_arm: error: {err}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("VERL_FILE_LOGGER_ROOT", "runs")
    print(f"VERL_FILE_LOGGER_ROOT={env['VERL_FILE_LOGGER_ROOT']} " + shlex.join(cmd), flush=True)
    if "--dry-run" in flags:
        return 0
    code = subprocess.call(cmd, env=env)
    print(f"\nlogs: {env['VERL_FILE_LOGGER_ROOT']}/<project>/<experiment>.jsonl; compare the arms with e.g.\n"
          f"  lrstab compare {env['VERL_FILE_LOGGER_ROOT']}/lrstab_paper/*.jsonl --out runs/compare "
          "--max-response-length 8192", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
