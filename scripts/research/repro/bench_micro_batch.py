#!/usr/bin/env python
"""What the actor update's micro-batch size costs on the real model (the step time), side by side.

Usage: python scripts/research/repro/bench_micro_batch.py [--sizes 12 4 2 1] [--rounds 2] [--threads 2]
    [--check-packing] [--attn sdpa|eager]

The update is 60-85 % of a real-model step (``timing.md``). verl's FSDP engine pads each micro-batch
to its longest sequence (nested tensors, ``use_remove_padding: false``: packing needs flash-attn,
see ``--check-packing``), so the micro-batch size trades padding against matrix size. This times,
in one process and interleaved over ``--rounds``, the forward + backward of one 2 x 6 batch of
SmolLM2-135M-Instruct (fp32, sdpa, as ``configs/cpu_demo.yaml``): the 12 prompts of the real-model
data set with verl's chat template, and response lengths spread as a 2 x 6 run's (40-192 tokens,
one at the cap), in micro-batches of each size (``ppo_micro_batch_size_per_gpu``), the loss a sum
of the response tokens' log-probs. Prints the seconds a batch and the ratio to the size the pilots
use (4). ``--check-packing`` first compares a packed forward (two sequences, one row, no attention
mask: what remove-padding feeds the model) with the two run apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
RESPONSES = (40, 45, 50, 55, 60, 65, 70, 80, 90, 110, 150, 192)  # a 2 x 6 batch, one response at the cap 192
PILOTS = 4  # the pilots' ppo_micro_batch_size_per_gpu


def load(model_dir: Path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model, AutoTokenizer.from_pretrained(model_dir)


def batch(tokenizer, data: Path, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """12 (prompt + response ids, response length) pairs in a seeded order, as a 2 x 6 batch is unsorted."""
    import pandas as pd

    prompts = pd.read_parquet(data)["prompt"].head(len(RESPONSES))
    g = torch.Generator().manual_seed(seed)
    out = []
    for messages, n in zip(prompts, RESPONSES):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=False)
        out.append((torch.cat([torch.tensor(ids), torch.randint(5, 1000, (n,), generator=g)]), n))
    return [out[i] for i in torch.randperm(len(out), generator=g)]


def update_seconds(model, seqs, size: int) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    for i in range(0, len(seqs), size):
        chunk = seqs[i:i + size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (s, _) in enumerate(chunk):
            ids[row, :len(s)], mask[row, :len(s)] = s, 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
        loss = sum(picked[row, len(s) - 1 - n:len(s) - 1].sum() for row, (s, n) in enumerate(chunk))
        (-loss / len(seqs)).backward()
    return time.perf_counter() - start


def packing_error(model) -> tuple[float, float]:
    """Max |logit| difference of the second of two packed sequences against it run alone, and the logits' scale."""
    a, b = torch.randint(5, 1000, (30,)), torch.randint(5, 1000, (45,))
    with torch.no_grad():
        alone = model(b[None]).logits[0]
        packed = model(input_ids=torch.cat([a, b])[None], attention_mask=None,
                       position_ids=torch.cat([torch.arange(30), torch.arange(45)])[None]).logits[0, 30:]
    return float((packed - alone).abs().max()), float(alone.abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[12, 4, 2, 1])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2: the verl worker's)")
    p.add_argument("--assets", type=Path, default=REPO / ".assets-real", help="make assets-real's folder")
    p.add_argument("--check-packing", action="store_true")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                   help="transformers' attention (default sdpa: configs/cpu_demo.yaml's)")
    args = p.parse_args(argv)
    if any(s < 1 for s in args.sizes) or args.rounds < 1:
        p.error("--sizes and --rounds must be >= 1")
    if not (args.assets / "model").is_dir():
        p.error(f"no model under {args.assets}: run `make install-real` (it builds .assets-real)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load(args.assets / "model", args.attn)
    if args.check_packing:
        err, scale = packing_error(model.eval())
        print(f"packed forward, second sequence: max |logit diff| {err:.3g} (logits up to {scale:.3g}): "
              + ("packing is respected" if err < 1e-3 * scale else "sequences attend across the packing"))
    model.train()
    seqs = batch(tokenizer, args.assets / "data" / "train.parquet")
    tokens = sum(len(s) for s, _ in seqs)
    print(f"12 sequences, {tokens} tokens ({tokens / 12:.0f} a sequence), torch threads {args.threads}")
    times = {s: [] for s in args.sizes}
    update_seconds(model, seqs, max(args.sizes))  # warm-up, not timed
    for r in range(args.rounds):
        for s in args.sizes:
            times[s].append(update_seconds(model, seqs, s))
            print(f"  round {r + 1}: micro-batch {s:>2}: {times[s][-1]:.1f} s", flush=True)
    ref = statistics.median(times[PILOTS]) if PILOTS in times else None
    print("| micro-batch | padded tokens | s a batch (median) | ratio to 4 |\n|---|---|---|---|")
    for s in args.sizes:
        padded = sum(len(seqs[i:i + s]) * max(len(x) for x, _ in seqs[i:i + s]) for i in range(0, len(seqs), s))
        t = statistics.median(times[s])
        print(f"| {s} | {padded} | {t:.1f} | {t / ref:.2f} |" if ref else f"| {s} | {padded} | {t:.1f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
