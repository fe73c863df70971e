"""``lrstab admit --candidate NAME=OVERRIDES ... -- python -m verl.trainer.main_ppo ...``: screen rollout
configurations' mismatch at LR 0 against a budget (:mod:`verl_lrstab.admit.verdict`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_admit(args) -> int:
    from verl_lrstab.admit.verdict import Budget
    from verl_lrstab.admit.runner import parse_candidate, print_report, run_candidates
    from verl_lrstab.guard.plan import GuardError

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if args.budget is not None and args.reference is not None:
            raise ValueError("--budget and --reference are alternatives: give one")
        candidates = [parse_candidate(c) for c in args.candidate]
        budget = Budget(args.budget, "fixed") if args.budget is not None else None
        data = run_candidates(command, candidates, args.steps, Path(args.out), budget=budget,
                              reference=args.reference, factor=args.budget_factor, ray_address=args.ray_address,
                              timeout_s=args.timeout,
                              progress=lambda line: print(f"lrstab admit {line}", file=sys.stderr, flush=True))
    except (ValueError, GuardError) as err:
        print(f"lrstab admit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(Path(args.out).resolve() / "admit.json")
        return 130
    print_report(data, Path(args.out))
    print(Path(args.out).resolve() / "admit.json")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("admit", help="screen rollout configurations' mismatch at LR 0 against a budget",
                       usage="lrstab admit --candidate NAME=\"overrides\" [...] [options] -- python -m "
                             "verl.trainer.main_ppo [verl overrides]",
                       description="Each candidate runs verl's main_ppo for --steps steps at LR 0 (no parameter "
                                   "update: the trainer scores what the rollout sampled); its median "
                                   "actor/mismatch/k3 is judged against the budget (default 5e-4, below the public "
                                   "collapsing runs' 6e-4..1.2e-3), a k3 that grows at LR 0 is a system mismatch, "
                                   "and configurations known to bias the figures are named. Writes admit.json, "
                                   "admit.md and admit.png (each candidate's per-token |d| distribution); the last "
                                   "line printed is the JSON's path.")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME=OVERRIDES",
                   help="a name and its verl overrides, space-separated, env:VAR=VALUE for an environment variable "
                        "(repeatable; NAME= alone: the base command)")
    p.add_argument("--steps", type=int, default=4, help="no-update steps per candidate (default 4)")
    p.add_argument("--budget", type=float, help="a fixed budget on the median k3")
    p.add_argument("--reference", help="calibrate the budget: this candidate's median k3 x --budget-factor")
    p.add_argument("--budget-factor", type=float, default=4.0, help="default 4 (as the mismatch trigger's)")
    p.add_argument("--out", default="lrstab_admit", help="report folder (default lrstab_admit)")
    p.add_argument("--ray-address", help="a running Ray cluster every candidate joins (e.g. auto; default: each "
                                         "candidate starts its own)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds per candidate; past it the candidate is stopped and reported as failed (default 1800; "
                        "inf: no limit)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m verl.trainer.main_ppo ...")
    p.set_defaults(func=cmd_admit)
