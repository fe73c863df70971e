#!/usr/bin/env python
"""`make repro` / `make repro-ci`: warm start (if missing), every arm x seed one at a time, then the report.

Usage:
    python scripts/research/repro/all.py                 # full: 8000-step warm start, 6 bypass-recipe arms x 3 seeds x 100 steps
    python scripts/research/repro/all.py --ci            # CI: 600-step warm start, bp_const + bp_ls_surge, 1 seed, 12 steps
    python scripts/research/repro/all.py --arms bp_const recompute --seeds 1 2 --steps 100
    python scripts/research/repro/all.py --recipe noise  # the noise recipe's table (transformers rollout, injected weight noise)

After each bypass-recipe run, evaluate.py scores its checkpoints in fp32 (the table's validation).
A run whose ``run.json`` says it finished is not run again (delete its directory to redo it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from repro import arms as noise_arms  # noqa: E402
from repro import bypass_arms  # noqa: E402
from repro import run as repro_run  # noqa: E402

RECIPES = {"bypass": bypass_arms, "noise": noise_arms}
CI_ARMS = {"bypass": ["bp_const", "bp_ls_surge"], "noise": ["const", "ls_surge"]}
STEPS = {"bypass": 100, "noise": 150}  # bypass: 18 runs x ~5.5 min on 2 cores (measured per step and start-up)
CI_STEPS = 12  # --ci: RL steps of each arm
SFT_STEPS, CI_SFT_STEPS = 8000, 600  # warm-start steps: full, --ci

REPO_ROOT = HERE.parents[2]
# The warm-start recipe of the committed table (scripts/research/repro/README.md, "Warm start").
WARMSTART = {"min_digits": 3, "max_digits": 4, "worked_fraction": 0.4}


def warmstart_cmd(py: str, assets: Path, args) -> list[str]:
    return [py, str(HERE / "warmstart.py"), "--out", str(assets), "--steps", str(args.sft_steps),
            "--min-digits", str(args.min_digits), "--max-digits", str(args.max_digits),
            "--worked-fraction", str(args.worked_fraction)]


def check_recipe(assets: Path, args) -> None:
    """Refuse to reuse a warm start built with another recipe: the table would silently mix them."""
    built = json.loads((assets / "warmstart.json").read_text())["args"]
    wanted = {"steps": args.sft_steps, "min_digits": args.min_digits, "max_digits": args.max_digits,
              "worked_fraction": args.worked_fraction}
    what = _differences(built, wanted, "built")
    if what:
        raise SystemExit(f"{assets} was built with another warm-start recipe ({what}); "
                         "delete it or pass the recipe it was built with")


def finished_run(info_path: Path, **setting) -> bool:
    """True if the run finished with this setting; a finished run with another one is refused."""
    if not info_path.exists():
        return False
    info = json.loads(info_path.read_text())
    if info.get("returncode") != 0 or info.get("timed_out"):
        return False
    what = _differences(info, setting, "ran")
    if what:
        raise SystemExit(f"{info_path.parent} finished with another setting ({what}); delete it or use another --out")
    return True


def fp32_validated(run_dir: Path) -> bool:
    """True if ``fp32_val.json`` scores step 0 and every checkpoint of the run (evaluate.py has nothing to do)."""
    path = run_dir / "fp32_val.json"
    if not path.exists():
        return False
    scored = set(json.loads(path.read_text()))
    saved = {d.name.rsplit("_", 1)[1] for d in (run_dir / "checkpoints").glob("global_step_*")
             if (d / "actor" / "huggingface" / "config.json").exists()}
    return {"0", *saved} <= scored


def _differences(recorded: dict, wanted: dict, verb: str) -> str:
    """``"key: <verb> X, asked Y"`` for every key of ``wanted`` that ``recorded`` does not match; "" if none."""
    return ", ".join(f"{k}: {verb} {recorded.get(k)}, asked {v}" for k, v in wanted.items() if recorded.get(k) != v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="the small version CI runs (< 10 min)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="bypass")
    p.add_argument("--arms", nargs="*", default=None,
                   help=f"bypass: {sorted(bypass_arms.ARMS)}; noise: {sorted(noise_arms.ARMS)} (default all)")
    p.add_argument("--seeds", nargs="*", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help=f"RL steps (default {STEPS['bypass']} bypass, {STEPS['noise']} noise; {CI_STEPS} with --ci)")
    p.add_argument("--lr", type=float, default=None, help="default: the recipe's")
    p.add_argument("--sampler", choices=bypass_arms.SAMPLERS, default=bypass_arms.DEFAULT_SAMPLER,
                   help="bypass recipe: the sampler's weight precision")
    p.add_argument("--sampler-temperature", type=float, default=bypass_arms.DEFAULT_SAMPLER_TEMPERATURE,
                   help="bypass recipe: factor on the sampler's temperature (1 = off)")
    p.add_argument("--grader", choices=sorted(bypass_arms.GRADERS), default=bypass_arms.DEFAULT_GRADER,
                   help="bypass recipe: the reward's grader (see run.py)")
    p.add_argument("--noise", type=float, default=noise_arms.DEFAULT_NOISE, help="noise recipe: weight-noise sigma")
    p.add_argument("--sft-steps", type=int, default=None, help=f"warm-start steps (default {SFT_STEPS}; {CI_SFT_STEPS} with --ci)")
    p.add_argument("--min-digits", type=int, default=WARMSTART["min_digits"])
    p.add_argument("--max-digits", type=int, default=WARMSTART["max_digits"])
    p.add_argument("--worked-fraction", type=float, default=WARMSTART["worked_fraction"])
    p.add_argument("--out", type=Path, default=None,
                   help="default outputs/repro (bypass) or outputs/repro-noise; -ci appended with --ci")
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe]
    bad = [a for a in args.arms or [] if a not in recipe.ARMS]
    if bad:
        p.error(f"--arms {bad} not in the {args.recipe} recipe: allowed values are {sorted(recipe.ARMS)}")
    args.lr = args.lr if args.lr is not None else recipe.DEFAULT_LR
    return args


def run_argv(args, arm: str, seed: int, steps: int, assets: Path, runs: Path) -> list[str]:
    """run.py's arguments for one run of this setting."""
    knob = (["--sampler", args.sampler, "--sampler-temperature", str(args.sampler_temperature), "--grader", args.grader]
            if args.recipe == "bypass" else ["--noise", str(args.noise)])
    return ["--recipe", args.recipe, "--arm", arm, "--seed", str(seed), "--steps", str(steps), "--lr", str(args.lr),
            *knob, "--assets", str(assets), "--out", str(runs)]


def sh(cmd: list[str]) -> int:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO_ROOT)


def main(argv=None) -> int:
    args = parse_args(argv)
    base = "repro" if args.recipe == "bypass" else "repro-noise"
    out = args.out or REPO_ROOT / "outputs" / (base + ("-ci" if args.ci else ""))
    arms = args.arms or (CI_ARMS[args.recipe] if args.ci else list(RECIPES[args.recipe].ARMS))
    seeds = args.seeds or ([1] if args.ci else [1, 2, 3])
    steps = args.steps or (CI_STEPS if args.ci else STEPS[args.recipe])
    args.sft_steps = args.sft_steps or (CI_SFT_STEPS if args.ci else SFT_STEPS)
    assets, runs = out / "assets", out / "runs"
    py = sys.executable
    start = time.monotonic()
    if not (assets / "warmstart.json").exists():
        if sh(warmstart_cmd(py, assets, args)) != 0:
            return 1
    check_recipe(assets, args)
    failed, todo = [], [(seed, arm) for seed in seeds for arm in arms]
    for i, (seed, arm) in enumerate(todo, 1):
        run_dir = runs / f"{arm}-s{seed}"
        argv = run_argv(args, arm, seed, steps, assets, runs)
        # the setting run.py would record in run.json (all.py reuses a run only on a match)
        if not finished_run(run_dir / "run.json", **repro_run.setting(repro_run.parse_args(argv))):
            elapsed = time.monotonic() - start
            print(f"== repro run {i}/{len(todo)}: {arm}-s{seed} ({elapsed / 60:.0f} min elapsed)", flush=True)
            rc = sh([py, str(HERE / "run.py"), *argv])
            if rc != 0:
                failed.append(f"{arm}-s{seed}")
                continue
        if args.recipe == "bypass" and not fp32_validated(run_dir) and sh(
                [py, str(HERE / "evaluate.py"), str(run_dir), "--assets", str(assets),
                 "--max-new-tokens", str(bypass_arms.RESPONSE_CAP)]) != 0:
            failed.append(f"{arm}-s{seed} (fp32 validation)")
    rc = sh([py, str(HERE / "report.py"), "--runs", str(runs), "--out", str(out / "report")])
    print(f"repro: {time.monotonic() - start:.0f}s; report in {out / 'report'}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed or rc else 0


if __name__ == "__main__":
    sys.exit(main())
