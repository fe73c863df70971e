"""``lrstab``: replay the length-surge scheduler on logged runs; guard a verl run, screen its rollouts, check verl.

    lrstab replay RUN [--metric response_length/mean] [scheduler options] [--plot out.png] [--json]
    lrstab calibrate RUN [scheduler options]
    lrstab compare RUN [RUN ...] [--out DIR]
    lrstab guard [options] -- python -m verl.trainer.main_ppo [verl overrides]
    lrstab admit --candidate NAME=OVERRIDES [...] -- python -m verl.trainer.main_ppo [verl overrides]
    lrstab check-verl
    lrstab --version

RUN is verl's file-logger JSONL, a TensorBoard log directory or a CSV with a step column
(:mod:`verl_lrstab.runs`). The detector and the schedule are
:func:`verl_lrstab.log_replay.replay`, the code the trainer runs. Exit status: 0 done,
1 unreadable run / missing metric / invalid option value, 2 usage error, 3 ``calibrate``
found no surge. A module a subcommand; the shared options and metric names are in
:mod:`verl_lrstab.cli.common`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from verl_lrstab import __version__
from verl_lrstab.cli import admit, calibrate, check_verl, compare, guard, replay
from verl_lrstab.cli.common import EXIT_ERROR
from verl_lrstab.cli.compare import score_crash
from verl_lrstab.cli.replay import cosignal_names
from verl_lrstab.runs import RunError

__all__ = ["build_parser", "cosignal_names", "main", "score_crash"]
SUBCOMMANDS = (replay, calibrate, compare, guard, admit, check_verl)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lrstab", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the detector's log lines")
    parser.add_argument("--version", action="version", version=f"verl-lrstab {__version__}",
                        help="print the installed verl-lrstab version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lrstab`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand, with its usage (argparse would show the top level's)
        _subparsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("verl_lrstab").setLevel(logging.INFO if args.verbose else logging.ERROR)
    # what a run's reader left out (a line cut short, a step logged twice) is always said
    logging.getLogger("verl_lrstab.runs").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): not an error of lrstab's
        with contextlib.suppress(OSError, ValueError):  # no second error at exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (RunError, OSError) as err:
        print(f"lrstab: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
