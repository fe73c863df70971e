#!/usr/bin/env python
"""fp32 validation of a real-model pilot's checkpoints: the trainer's weights, not the sampler's.

Each ``checkpoints/global_step_N/actor/huggingface`` of a ``real_pilot.py`` run (saved every 10
steps), and the base model as step 0, sample the first ``--n`` validation word problems
``--samples`` times at temperature 1 with vLLM-CPU in **float32**
(:func:`verl_lrstab_cpu.real_model.measure_accuracy`), so training damage is told apart from the
bf16 sampler's. Steps already scored are skipped. One engine per checkpoint (~20 s to start).

Usage: python scripts/research/repro/real_eval.py RUN_DIR [--n 64] [--samples 2] [--every 10]
Writes ``RUN_DIR/fp32_val.json``: ``{"<step>": {"accuracy", "marked", "capped", "mean_tokens", "n", "example"}}``
(``example``: the first 600 characters of the checkpoint's first response, to the first problem).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from verl_lrstab_cpu import real_model

RESULT = "fp32_val.json"
_STEP = re.compile(r"global_step_(\d+)$")


def checkpoints(run_dir: Path) -> dict[int, Path]:
    found = {}
    for d in (run_dir / "checkpoints").glob("global_step_*"):
        m, hf = _STEP.search(d.name), d / "actor" / "huggingface"
        if m and (hf / "model.safetensors").exists():
            found[int(m.group(1))] = hf
    return dict(sorted(found.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--n", type=int, default=64, help="validation problems (default 64: all)")
    p.add_argument("--samples", type=int, default=2, help="samples per problem (default 2)")
    p.add_argument("--every", type=int, default=10, help="score the checkpoints at multiples of this step (default 10)")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    if min(args.n, args.samples, args.every, args.max_tokens) < 1:
        p.error("--n, --samples, --every and --max-tokens must be >= 1")
    out_path = args.run / RESULT
    done = json.loads(out_path.read_text()) if out_path.exists() else {}
    todo = {0: None, **{s: hf for s, hf in checkpoints(args.run).items() if s % args.every == 0}}
    for step, hf in todo.items():
        if str(step) in done:
            continue
        result = real_model.measure_accuracy(n=args.n, samples=args.samples, max_tokens=args.max_tokens, model=hf,
                                             dtype="float32", seed=1234)
        result["example"] = result.get("example", "")[:600]  # what the checkpoint writes to problem 1 (kept short)
        done[str(step)] = result
        out_path.write_text(json.dumps(dict(sorted(done.items(), key=lambda kv: int(kv[0]))), indent=1))
        print(f"step {step:4d}: fp32 accuracy {result['accuracy']:.3f}, mean {result['mean_tokens']:.1f} tokens, "
              f"capped {result['capped']:.3f}; problem 1: {result['example'][:200]!r}", flush=True)
    print(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
