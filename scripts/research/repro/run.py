#!/usr/bin/env python
"""Run one arm of the reproduction: verl's real ``main_ppo`` on CPU, one run at a time.

Usage:
    python scripts/research/repro/run.py --arm bp_const --seed 1 [--steps 100] [--lr 5e-4] [--sampler bf16] [--sampler-temperature 1.3] [--grader strict] [overrides ...]
    python scripts/research/repro/run.py --recipe noise --arm const --seed 1 [--steps 150] [--noise 0.3] [overrides ...]

Two recipes: ``bypass`` (the default: verl's vLLM rollout in bf16, bypass mode,
``bypass_arms.py``) and ``noise`` (the noise recipe's table: the transformers rollout with injected weight
noise, ``arms.py``). Writes ``outputs/repro/runs/<arm>-s<seed>/metrics.jsonl`` (verl's file
logger), the log next to it, and ``run.json`` (recipe, overrides, wall time, return code).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/` (verl ships its own `scripts` package)
from repro import arms as noise_arms  # noqa: E402
from repro import bypass_arms  # noqa: E402

from verl_lrstab_cpu.launch import REPO_ROOT, print_new_steps, run_main_ppo  # noqa: E402

REWARD_FILE = Path(__file__).resolve().parent / "task.py"
RECIPES = {"bypass": bypass_arms, "noise": noise_arms}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="bypass")
    p.add_argument("--arm", required=True, help=f"bypass: {sorted(bypass_arms.ARMS)}; noise: {sorted(noise_arms.ARMS)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None,
                   help=f"initial actor LR (default {bypass_arms.DEFAULT_LR} bypass, {noise_arms.DEFAULT_LR} noise)")
    p.add_argument("--sampler", choices=bypass_arms.SAMPLERS, default=bypass_arms.DEFAULT_SAMPLER,
                   help=f"bypass recipe: the sampler's weight precision (default {bypass_arms.DEFAULT_SAMPLER})")
    p.add_argument("--sampler-temperature", type=float, default=bypass_arms.DEFAULT_SAMPLER_TEMPERATURE,
                   help="bypass recipe: the sampler samples (and reports log-probs) at this factor x the trainer's "
                        f"temperature (default {bypass_arms.DEFAULT_SAMPLER_TEMPERATURE}: off)")
    p.add_argument("--grader", choices=sorted(bypass_arms.GRADERS), default=bypass_arms.DEFAULT_GRADER,
                   help="bypass recipe: strict (the answer ',=N' must end the response) or marked (the last ',=N' "
                        f"anywhere, what follows ignored) (default {bypass_arms.DEFAULT_GRADER})")
    p.add_argument("--noise", type=float, default=noise_arms.DEFAULT_NOISE,
                   help=f"noise recipe: weight-noise sigma of the mismatch arms, x std(param) (default {noise_arms.DEFAULT_NOISE})")
    p.add_argument("--assets", type=Path, default=REPO_ROOT / "outputs" / "repro" / "assets")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "repro" / "runs")
    p.add_argument("--name", default=None, help="run directory name (default <arm>-s<seed>)")
    p.add_argument("--timeout", type=float, default=None, help="hard limit in s (default 600 + 8 s per step: vLLM start-up alone took 140-400 s, measured)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = p.parse_args(argv)
    arms = RECIPES[args.recipe].ARMS
    if args.arm not in arms:
        p.error(f"--arm {args.arm!r} is not an arm of the {args.recipe} recipe: allowed values are {sorted(arms)}")
    args.lr = args.lr if args.lr is not None else RECIPES[args.recipe].DEFAULT_LR
    return args


def describe_step(d: dict) -> str:
    """The progress line after ``step k/N``: length, reward, LR, mismatch k3, surge, validation."""
    val = next((v for k, v in d.items() if k.startswith("val-core/")), None)
    return (f" len {d.get('response_length/mean', math.nan):5.1f} score {d.get('critic/score/mean', math.nan):.3f}"
            f" lr {d.get('actor/lr', math.nan):.2e} k3 {d.get('actor/mismatch/k3', math.nan):.2e}"
            f" surge {int(d.get('actor/lrstab/surge_step', -1))}" + (f" VAL {val:.3f}" if val is not None else ""))


def setting(args) -> dict:
    """What makes two runs comparable (recorded in run.json; all.py reuses a run only on a match)."""
    if args.recipe == "bypass":
        return {"recipe": "bypass", "steps": args.steps, "lr": args.lr, "sampler": args.sampler,
                "sampler_temperature": args.sampler_temperature, "grader": args.grader}
    return {"recipe": "noise", "steps": args.steps, "lr": args.lr, "noise": args.noise}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.assets / "model").exists():
        raise SystemExit(f"no assets under {args.assets}: run python scripts/research/repro/warmstart.py first")
    name = args.name or f"{args.arm}-s{args.seed}"
    run_dir = (args.out / name).resolve()
    env = {"LRSTAB_REPRO_REWARD": str(REWARD_FILE)}
    cleanup = contextlib.nullcontext()
    if args.recipe == "bypass":
        from verl_lrstab_cpu.vllm_rollout import engine_shm_cleanup, loopback_env

        overrides = bypass_arms.arm_overrides(args.arm, args.seed, args.steps, args.lr, args.grader)
        env.update(loopback_env(), **bypass_arms.sampler_env(args.sampler, args.sampler_temperature))
        cleanup = engine_shm_cleanup()  # the psm_* segments vLLM's engine leaves in /dev/shm
    else:
        overrides = noise_arms.arm_overrides(args.arm, args.seed, args.steps, args.lr, args.noise)
    overrides += list(args.overrides)
    timeout = args.timeout or 600 + 8 * args.steps
    print(f"run {name}: {' '.join(overrides)}", flush=True)
    with cleanup:
        result = run_main_ppo(run_dir, overrides, assets_dir=args.assets, config_name="cpu_demo", timeout_s=timeout,
                              env=env, on_progress=print_new_steps(args.steps, describe_step))
    info = {"arm": args.arm, "seed": args.seed, **setting(args),
            "overrides": overrides, "returncode": result.returncode, "timed_out": result.timed_out,
            "wall_s": round(result.wall_s, 1), "last_step": max(result.metrics, default=0)}
    (run_dir / "run.json").write_text(json.dumps(info, indent=1))
    print(f"{name}: rc={result.returncode} wall={result.wall_s:.0f}s steps={info['last_step']} -> {result.metrics_path}")
    if result.returncode != 0 or result.timed_out:
        print(result.log_tail(40), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
