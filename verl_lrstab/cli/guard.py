"""``lrstab guard -- python -m verl.trainer.main_ppo ...``: supervise verl's run, roll back on trouble
(:mod:`verl_lrstab.guard`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def cmd_guard(args) -> int:
    from verl_lrstab.guard.files import say
    from verl_lrstab.guard.plan import GuardError, GuardOptions
    from verl_lrstab.guard.supervisor import Guard

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        options = GuardOptions(max_rollbacks=args.max_rollbacks, margin=args.margin, on_surge=not args.no_surge,
                               on_reward_crash=not args.no_reward_crash, on_non_finite=not args.no_non_finite,
                               crash_fraction=args.crash_fraction, reseed=args.reseed,
                               non_finite_steps=args.non_finite_steps, max_restarts=args.max_restarts,
                               max_resume_tries=args.max_resume_tries, skip_batches=args.skip_batches,
                               from_scratch=args.from_scratch)
        if args.resume is not None:
            if args.run_dir is not None and Path(args.run_dir).resolve() != Path(args.resume).resolve():
                raise GuardError("--resume RUN_DIR and --run-dir name different folders: give one")
            guard = Guard(command or None, run_dir=Path(args.resume), resume=True)
        else:
            guard = Guard(command, run_dir=Path(args.run_dir) if args.run_dir else None, options=options)
    except GuardError as err:
        say(f"lrstab guard: error: {err}")
        return 2
    logging.getLogger("verl_lrstab").setLevel(logging.WARNING)
    status = guard.run()
    say(str(guard.run_dir), file=sys.stdout)
    return status


def add_parser(sub) -> None:
    p = sub.add_parser("guard", help="run verl's main_ppo; on a surge, reward crash or NaN, roll back and continue",
                       usage="lrstab guard [options] -- python -m verl.trainer.main_ppo [verl overrides]",
                       description="Supervise verl's own entry point: on trouble, stop it, keep the abandoned "
                                   "segment, resume from the newest checkpoint at or before the onset (verl's "
                                   "resume_mode=resume_path) with the LR halved from there and every P steps after "
                                   "(P = period_factor x the surge step, or x the onset step for a reward crash or a NaN), at most "
                                   "--max-rollbacks times; a second rollback compounds (one more decay than the LR "
                                   "in force at its checkpoint). A verl crash is restarted from the newest complete "
                                   "checkpoint (--max-restarts). The state is kept in the run folder: a killed guard "
                                   "stops verl, and --resume RUN_DIR (or the same command with the same --run-dir) "
                                   "continues on the same LR rule. One guard per checkpoint folder and per run folder (a second is refused). Exit "
                                   "status: 0 finished, 2 a bad command, option or state file, a checkpoint folder "
                                   "verl could not resume from as it is, or another guard holds the checkpoint or run folder, 3 gave up (too many rollbacks or no checkpoint), 4 verl "
                                   "failed, 5 the guard's own file operation failed (a full or read-only disk: "
                                   "--resume once fixed), 128+N stopped by signal N.")
    p.add_argument("--run-dir", help="events, segments and the final metrics (default: next to verl's checkpoints, "
                                     "<trainer.default_local_dir>/../lrstab_guard)")
    p.add_argument("--max-rollbacks", type=int, default=2, help="default 2")
    p.add_argument("--margin", type=int, default=2,
                   help="roll back to the newest checkpoint at or before onset - MARGIN steps (default 2)")
    p.add_argument("--crash-fraction", type=float, default=0.6,
                   help="reward crash: 5-point rolling median score below this fraction of its earlier peak's height "
                        "above the score's floor (verl's lowest critic/score/min; default 0.6)")
    for name, what in (("surge", "the detector's surge"), ("reward-crash", "a reward crash"),
                       ("non-finite", "a NaN/inf loss or grad norm")):
        p.add_argument(f"--no-{name}", action="store_true", help=f"do not roll back on {what}")
    p.add_argument("--reseed", action="store_true", help="change the rollout seed on each rollback")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the guarded run of RUN_DIR on its LR rule (after the guard itself died, or after "
                        "verl failed with its restarts used up, once the cause is fixed); no command needed")
    p.add_argument("--max-restarts", type=int, default=1,
                   help="restarts from the newest complete checkpoint after a verl crash outside a rollback (default 1)")
    p.add_argument("--max-resume-tries", type=int, default=3,
                   help="checkpoints tried, newest first, when verl fails to load one (default 3)")
    p.add_argument("--non-finite-steps", type=int, default=2,
                   help="a NaN/inf loss or grad norm must repeat on this many consecutive steps (default 2)")
    p.add_argument("--skip-batches", type=int, default=0,
                   help="after a rollback, move verl's dataloader this many batches past the checkpoint's "
                        "position (data.pt), so the trouble window's batches are not replayed (default 0)")
    p.add_argument("--from-scratch", action="store_true",
                   help="train from step 0 although trainer.default_local_dir holds global_step_N folders: they are "
                        "moved aside (into the run folder's abandoned/) first, never overwritten; without it such a "
                        "launch is refused")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m verl.trainer.main_ppo ...")
    p.set_defaults(func=cmd_guard)
