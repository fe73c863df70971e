#!/usr/bin/env python
"""`make demo-guard`: `lrstab guard` around verl's real main_ppo on CPU, through a provoked surge.

The CPU demo's reward pays for length (configs/cpu_demo.yaml), so the response length surges
within about 15 steps: a provoked trouble, not a real collapse. The run itself only watches
(``length_surge.monitor_only``: constant LR); the guard sees the surge, rolls back to the newest
checkpoint at or before its onset (verl saves every 4 steps here), resumes with verl's own
``resume_mode=resume_path`` and the LR halved from there, and finishes. Then ``lrstab compare``
draws the final trajectory with the abandoned segment greyed and the rollback marked.

Usage: python scripts/demo_guard.py [--steps 24] [--out outputs/demo-guard]
The last line printed is the guard's run directory (events, segments, final metrics, figures).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from verl_lrstab_cpu.assets import build_assets
from verl_lrstab_cpu.launch import CONFIG_DIR, REPO_ROOT, cpu_env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-freq", type=int, default=4)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "demo-guard")
    args = p.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    assets = build_assets()["root"]
    env = cpu_env(assets, out / "unused.jsonl", out)
    from verl_lrstab.guard.plan import GuardOptions
    from verl_lrstab.guard.supervisor import Guard

    command = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR), "--config-name",
               "cpu_demo", f"hydra.run.dir={out / 'hydra'}", "trainer.use_v1=true",
               f"trainer.total_training_steps={args.steps}", f"trainer.save_freq={args.save_freq}",
               "++actor_rollout_ref.actor.optim.length_surge.monitor_only=true"]
    import os

    os.environ.update(env)  # the guard composes verl's config with the run's environment
    guard = Guard(command, run_dir=out / "guard", options=GuardOptions(), env=env, cwd=out)
    print(f"lrstab guard -- {' '.join(command[1:])}\n(events: {guard.events.path}; verl's log: "
          f"{guard.run_dir}/segment-*.log)", flush=True)
    start = time.monotonic()
    status = guard.run()
    wall = time.monotonic() - start
    events = [json.loads(line) for line in guard.events.path.read_text().splitlines()]
    for e in events:
        if e["event"] != "start":
            print(f"  {e['event']:>8} at step {e['step']}: " + ", ".join(
                f"{k}={v}" for k, v in e.items() if k not in ("event", "step", "time")), flush=True)
    print(f"guard status {status} in {wall:.0f} s")
    if status == 0:
        from verl_lrstab.cli import main as lrstab

        lrstab(["compare", str(guard.run_dir), "--out", str(guard.run_dir / "compare"), "--label", "guarded run"])
    print(guard.run_dir)
    return status


if __name__ == "__main__":
    sys.exit(main())
