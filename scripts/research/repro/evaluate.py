#!/usr/bin/env python
"""fp32 validation of the trainer's own weights: every HF checkpoint of a run, sampled without the sampler.

verl's validation runs through the rollout server, so in the bypass recipe it is scored on the
(amplified) bf16 sampler. This scores the trainer's weights instead: each
``checkpoints/global_step_N/actor/huggingface`` (saved every ``bypass_arms.VAL_EVERY`` steps) and
the warm start (step 0) are loaded in fp32 and sample the validation prompts ``--n`` times at
temperature 1 (the rollout's sampling), with a fixed seed per step. The table's validation and
collapse rule use this (``fp32_val.json``), so training damage is separated from evaluation noise.

Usage: python scripts/research/repro/evaluate.py RUN_DIR [RUN_DIR ...] [--assets outputs/repro/assets] [--n 4]
Writes ``RUN_DIR/fp32_val.json``: ``{"<step>": {"acc": ..., "mean_length": ..., "worked_share": ...}}``;
checkpoints already scored are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/` (verl ships its own `scripts` package)
from repro import task  # noqa: E402
from repro.task import answer_mode  # noqa: E402

from verl_lrstab_cpu.launch import REPO_ROOT  # noqa: E402

RESULT = "fp32_val.json"
_STEP = re.compile(r"global_step_(\d+)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (outputs/repro/runs/<name>)")
    p.add_argument("--assets", type=Path, default=REPO_ROOT / "outputs" / "repro" / "assets")
    p.add_argument("--n", type=int, default=4, help="samples per validation prompt (default 4, as verl's val_kwargs.n)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response cap (default 128, the bypass recipe's)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1:
        p.error("--n and --max-new-tokens must be >= 1")
    return args


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """``{step: huggingface dir}`` of a run's checkpoints."""
    found = {}
    for d in (run_dir / "checkpoints").glob("global_step_*"):
        m = _STEP.search(d.name)
        hf = d / "actor" / "huggingface"
        if m and (hf / "config.json").exists():
            found[int(m.group(1))] = hf
    return dict(sorted(found.items()))


def validation_prompts(assets: Path) -> list[tuple[str, int]]:
    """``[(question, sum)]`` of the RL validation set (``data/val.parquet``)."""
    import pandas as pd

    df = pd.read_parquet(assets / "data" / "val.parquet")
    return [(row["prompt"][0]["content"], int(row["reward_model"]["ground_truth"])) for _, row in df.iterrows()]


def run_grader(run_dir: Path):
    """The reward function the run trained with (``grader`` in its run.json; runs without one: strict)."""
    from repro.bypass_arms import GRADERS

    info = run_dir / "run.json"
    grader = json.loads(info.read_text()).get("grader", "strict") if info.exists() else "strict"
    return getattr(task, GRADERS[grader])


def score_model(model_dir: Path, prompts: list[tuple[str, int]], n: int, max_new_tokens: int, seed: int,
                compute_score=task.compute_score) -> dict:
    """Sample every prompt ``n`` times (fp32, temperature 1, one left-padded batch) and score it with ``compute_score``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q, _ in prompts]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(batch.input_ids.repeat_interleave(n, 0), attention_mask=batch.attention_mask.repeat_interleave(n, 0),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             eos_token_id=im_end, pad_token_id=tok.pad_token_id)
    scores, lengths, worked = [], [], []
    for i, row in enumerate(out[:, batch.input_ids.shape[1]:].tolist()):
        length = row.index(im_end) + 1 if im_end in row else len(row)
        text = tok.decode(row[:length], skip_special_tokens=True)
        scores.append(compute_score("", text, prompts[i // n][1]))
        lengths.append(length)
        worked.append(answer_mode(text) == "worked")
    k = len(scores)
    return {"acc": sum(scores) / k, "mean_length": sum(lengths) / k, "worked_share": sum(worked) / k, "samples": k}


def evaluate_run(run_dir: Path, assets: Path, n: int, max_new_tokens: int, seed: int) -> dict:
    """Score step 0 (the warm start) and every checkpoint not yet in ``fp32_val.json``; returns the file's content."""
    path = run_dir / RESULT
    done = json.loads(path.read_text()) if path.exists() else {}
    prompts = validation_prompts(assets)
    todo = {0: assets / "model", **checkpoints(run_dir)}
    grade = run_grader(run_dir)
    for step, model_dir in todo.items():
        if str(step) in done:
            continue
        done[str(step)] = score_model(model_dir, prompts, n, max_new_tokens, seed + step, grade)
        print(f"{run_dir.name}: step {step:4d} fp32 val {done[str(step)]['acc']:.3f} "
              f"len {done[str(step)]['mean_length']:.1f}", flush=True)
        path.write_text(json.dumps(dict(sorted(done.items(), key=lambda kv: int(kv[0]))), indent=1))
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for run_dir in args.runs:
        if not (run_dir / "checkpoints").is_dir():
            print(f"{run_dir}: no checkpoints/ (was it run with the bypass recipe?)", file=sys.stderr)
            return 1
        evaluate_run(run_dir, args.assets, args.n, args.max_new_tokens, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
