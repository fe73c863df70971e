#!/usr/bin/env python
"""``make test``'s unit half on one pytest process against two xdist workers, side by side in one run.

Usage: python scripts/research/bench_test_workers.py [--workers 2] [TEST_PATH ...]

Runs ``pytest -m "not e2e and not slow"`` on the given files (default: the unit files that start processes
or real verl engines, the slowest part of the unit half) first with ``-n 0`` and then with
``-n WORKERS --dist loadfile`` (a file to a worker, as ``make test`` does), and prints both wall times and
their ratio. Both must pass; a failure in either is reported with its exit status. Alone on the machine the
ratio is what ``make test`` gains; beside other work it says little.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT = ["tests/test_engine.py", "tests/test_guard_supervisor.py", "tests/test_failsafe.py", "tests/test_admit_cli.py",
           "tests/test_megatron_worker.py", "tests/test_glue_guarantees.py", "tests/test_verl_config.py"]


def run(paths: list[str], workers: int) -> tuple[float, int]:
    dist = ["-n", "0"] if workers <= 1 else ["-n", str(workers), "--dist", "loadfile"]
    cmd = [sys.executable, "-m", "pytest", "-m", "not e2e and not slow", "-q", "-p", "no:cacheprovider", *dist, *paths]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - start
    print(f"{'one process' if workers <= 1 else f'{workers} workers'}: {wall:.0f} s, exit {proc.returncode}: "
          f"{proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]}", flush=True)
    return wall, proc.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", default=DEFAULT)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error(f"--workers must be >= 2, got {args.workers}")
    one, rc1 = run(args.paths, 1)
    many, rc2 = run(args.paths, args.workers)
    print(f"ratio (one process / {args.workers} workers): {one / many:.2f}x")
    return 0 if rc1 == rc2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
