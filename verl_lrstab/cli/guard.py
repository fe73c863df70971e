"""``lrstab guard -- python -m verl.trainer.main_ppo ...``: supervise verl's run, roll back on trouble
(:mod:`verl_lrstab.guard`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def cmd_guard(args) -> int:
    from verl_lrstab.guard.plan import GuardError, GuardOptions
    from verl_lrstab.guard.supervisor import Guard

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        options = GuardOptions(max_rollbacks=args.max_rollbacks, margin=args.margin, on_surge=not args.no_surge,
                               on_reward_crash=not args.no_reward_crash, on_non_finite=not args.no_non_finite,
                               crash_fraction=args.crash_fraction, reseed=args.reseed)
        guard = Guard(command, run_dir=Path(args.run_dir) if args.run_dir else None, options=options)
    except GuardError as err:
        print(f"lrstab guard: error: {err}", file=sys.stderr)
        return 2
    logging.getLogger("verl_lrstab").setLevel(logging.WARNING)
    status = guard.run()
    print(guard.run_dir)
    return status


def add_parser(sub) -> None:
    p = sub.add_parser("guard", help="run verl's main_ppo; on a surge, reward crash or NaN, roll back and continue",
                       usage="lrstab guard [options] -- python -m verl.trainer.main_ppo [verl overrides]",
                       description="Supervise verl's own entry point: on trouble, stop it, keep the abandoned "
                                   "segment, resume from the newest checkpoint at or before the onset (verl's "
                                   "resume_mode=resume_path) with the LR halved from there and every P steps after "
                                   "(P = period_factor x the surge step, or x the onset step for a reward crash or a NaN), at most "
                                   "--max-rollbacks times. Exit "
                                   "status: 0 finished, 3 gave up (too many rollbacks or no checkpoint), 4 verl "
                                   "failed, 2 a bad command or option.")
    p.add_argument("--run-dir", help="events, segments and the final metrics (default: next to verl's checkpoints, "
                                     "<trainer.default_local_dir>/../lrstab_guard)")
    p.add_argument("--max-rollbacks", type=int, default=2, help="default 2")
    p.add_argument("--margin", type=int, default=2,
                   help="roll back to the newest checkpoint at or before onset - MARGIN steps (default 2)")
    p.add_argument("--crash-fraction", type=float, default=0.6,
                   help="reward crash: 5-point rolling median score below this x its earlier peak (default 0.6)")
    for name, what in (("surge", "the detector's surge"), ("reward-crash", "a reward crash"),
                       ("non-finite", "a NaN/inf loss or grad norm")):
        p.add_argument(f"--no-{name}", action="store_true", help=f"do not roll back on {what}")
    p.add_argument("--reseed", action="store_true", help="change the rollout seed on each rollback")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m verl.trainer.main_ppo ...")
    p.set_defaults(func=cmd_guard)
