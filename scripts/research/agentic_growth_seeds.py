#!/usr/bin/env python
"""The agentic e2e run (a) over several seeds: how far the model's own turns drift while the tool's answers grow.

Usage::

    nice -n 10 python scripts/research/agentic_growth_seeds.py --trainers v0 v1 --seeds default 2 3 4 5 6 \\
        --out runs/agentic_seeds

Each run is ``tests/e2e/test_agentic_e2e.py``'s run (a) itself (its ``agentic_run`` with its ``GROWTH``
scenario and overrides, on ``configs/cpu_demo.yaml``) with one change: seed ``S`` adds ``data.seed=S`` (the
order verl's sampler draws the prompts in) and ``actor_rollout_ref.rollout.seed=S`` (every request's sampling
seed under ``full_determinism``); ``default`` adds nothing (``data.seed`` 1 from the config, the rollout's
verl default 42), which is the test's own run. A run at a fixed seed is bit-identical from run to run
(``docs/cpu_backend.md``), so the seeds are the only source of spread.

For every run it records the series of ``actor/lrstab/model_tokens``, its min and max, the mean of its last
three steps over the mean of its first three (the ratio run (b) calls a surge at 1.5), the largest step over
that early mean, verl's ``response_length/mean`` at the last step over the first, the steps the detector
fired on (``actor/lrstab/surge_step``), the LR and the step at which the same detector replayed on verl's
figure fires; then it runs the test function ``test_growing_tool_answers_are_no_surge`` on the run and
records whether it passes (and why not). One JSON line per run (trainer, seed, directory) is appended to
``<out>/results.jsonl`` as soon as it ends; every figure is read back from the run's directory (its
metrics and the rollout's trace), so ``--summary`` recomputes the table from the runs already made.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import test_agentic_e2e as e2e  # noqa: E402

from verl_lrstab.runs import read_metrics  # noqa: E402
from verl_lrstab.log_replay import replay  # noqa: E402
from verl_lrstab_cpu.assets import build_assets  # noqa: E402
from verl_lrstab_cpu.launch import REPO_ROOT, RunResult, run_main_ppo  # noqa: E402


def seed_overrides(seed: str) -> list[str]:
    if seed == "default":
        return []
    value = int(seed)
    return [f"data.seed={value}", f"actor_rollout_ref.rollout.seed={value}"]


class _Dirs:
    """``tmp_path_factory``'s ``mktemp`` for :func:`e2e.agentic_run`: a fresh directory under ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=False)
        return path


OPTIONS = {"skip_first_steps": 2, "cusum_span": 6, "cusum_lag": 1, "cusum_runaway_rise": 1.5,
           "period_factor": e2e.PERIOD_FACTOR}  # configs/cpu_demo.yaml's, as the test's replay uses them


def one_run(out: Path, assets: Path, trainer: str, seed: str, timeout_s: float) -> dict:
    """Run (a) once; its directory holds the metrics and the rollout's trace that :func:`describe` reads."""
    root = out / f"{trainer}-seed-{seed}-{time.strftime('%H%M%S')}"
    extra = seed_overrides(seed)

    def main_ppo(name, overrides, env=None):
        return run_main_ppo(root / name / "run", list(overrides) + extra, assets_dir=assets, timeout_s=timeout_s,
                            env=env).check()

    start = time.monotonic()
    e2e.agentic_run(main_ppo, _Dirs(root), "agentic-growth", trainer, e2e.GROWTH)
    return {"trainer": trainer, "seed": seed, "overrides": extra, "wall_s": round(time.monotonic() - start, 1),
            "dir": str(root)}


def describe(run: dict) -> dict:
    """The figures of a run, read back from its directory, and the test function's verdict on it."""
    root = Path(run["dir"]) / "agentic-growth"
    result = RunResult(returncode=0, wall_s=run["wall_s"], metrics_path=root / "run" / "metrics.jsonl",
                       log_path=root / "run" / "metrics.log", metrics=read_metrics(root / "run" / "metrics.jsonl"))
    records = e2e.trajectories(root / "trace")
    metrics = result.metrics
    steps = sorted(metrics)
    model = e2e.series(metrics, "actor/lrstab/model_tokens")
    verl = e2e.series(metrics, "response_length/mean")
    early, late = e2e.mean(model[s] for s in steps[:3]), e2e.mean(model[s] for s in steps[-3:])
    scores = e2e.series(metrics, "critic/score/mean")
    offline = replay(steps, [verl[s] for s in steps], OPTIONS, score=[scores[s] for s in steps])
    row = {
        **run,
        "model_tokens": [round(model[s], 4) for s in steps],
        "min": min(model.values()), "max": max(model.values()),
        "early3": early, "late3": late, "late_over_early": late / early,
        "max_over_early": max(model.values()) / early,
        "verl_first": verl[steps[0]], "verl_last": verl[steps[-1]], "verl_ratio": verl[steps[-1]] / verl[steps[0]],
        "surge_steps": sorted(set(e2e.series(metrics, "actor/lrstab/surge_step").values())),
        "lrs": sorted(set(e2e.series(metrics, "actor/lr").values())),
        "replay_of_verl_length_fires_at": offline.surge_step,
    }
    try:  # the test's own assertions on this run
        e2e.test_growing_tool_answers_are_no_surge(lambda scenario, t: (result, records), run["trainer"])
        row["test"] = "pass"
    except AssertionError as error:
        row["test"] = "FAIL: " + (str(error).splitlines() or [""])[0][:300]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| trainer | seed | model_tokens min to max | first 3 -> last 3 | last 3 / first 3 | max / first 3 "
             "| verl's response_length/mean | surge_step | replay of verl's figure fires at | test |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['seed']} | {r['min']:.2f} to {r['max']:.2f} | {r['early3']:.2f} -> "
                     f"{r['late3']:.2f} | {r['late_over_early']:.3f} | {r['max_over_early']:.3f} | "
                     f"{r['verl_first']:.1f} -> {r['verl_last']:.1f} ({r['verl_ratio']:.2f}x) | {r['surge_steps']} | "
                     f"{r['replay_of_verl_length_fires_at']} | {r['test']} |")
    for trainer in sorted({r["trainer"] for r in rows}):
        ratios = [r["late_over_early"] for r in rows if r["trainer"] == trainer]
        highs = [r["max_over_early"] for r in rows if r["trainer"] == trainer]
        lines.append(f"{trainer}: {len(ratios)} runs, last 3 / first 3 from {min(ratios):.3f} to {max(ratios):.3f}; "
                     f"max / first 3 from {min(highs):.3f} to {max(highs):.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainers", nargs="+", default=["v0", "v1"], choices=sorted(e2e.TRAINER))
    p.add_argument("--seeds", nargs="+", default=["default", "2", "3", "4", "5", "6"],
                   help="'default' (the test's own run) or integers (data.seed and the rollout's seed)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "agentic_seeds")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--summary", action="store_true", help="print the table of <out>/results.jsonl and exit")
    args = p.parse_args(argv)
    for seed in args.seeds:
        if seed != "default" and not seed.lstrip("-").isdigit():
            p.error(f"--seeds: 'default' or an integer, got {seed!r}")
    args.out = args.out.resolve()  # the runs' tool configs are read from another working directory
    results = args.out / "results.jsonl"
    if not args.summary:
        args.out.mkdir(parents=True, exist_ok=True)
        assets = Path(build_assets(Path(os.environ.get("LRSTAB_ASSETS", REPO_ROOT / ".assets")))["root"])
        for trainer in args.trainers:
            for seed in args.seeds:
                run = one_run(args.out, assets, trainer, seed, args.timeout_s)
                with open(results, "a") as f:
                    f.write(json.dumps(run) + "\n")
                row = describe(run)
                print(f"{trainer} seed {seed}: {row['wall_s']:.0f} s, last 3 / first 3 {row['late_over_early']:.3f}, "
                      f"max / first 3 {row['max_over_early']:.3f}, verl {row['verl_ratio']:.2f}x (replayed: fires at "
                      f"{row['replay_of_verl_length_fires_at']}), "
                      f"surge_step {row['surge_steps']}, test {row['test']}", flush=True)
    rows = [describe(json.loads(line)) for line in results.read_text().splitlines() if line.strip()]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
