"""Tokens/s of the CPU rollout's sampler (verl_lrstab_cpu.generation), three ways.

Not a timed test: prints a table. One "step" is what the demo's V1 server gets: 32 requests
(8 prompts x n=4), up to 48 new tokens each, temperature 1, log-probs on.

  * float32 batched: ``batch_invariant=False`` (the plain forward; its rounding, and so the
    log-probs and, rarely, the samples, depend on which requests share the batch);
  * batch-invariant batched: ``batch_invariant=True`` (float64 forward, logits rounded to float32);
  * one at a time: each request alone (invariant too, no batching); the first 8 requests only,
    tokens/s is a rate.

Models: the demo's tiny asset model (``.assets``, built if missing; per-token Python overhead
dominates) and a random Qwen2 of about 6M parameters (rarely stops early), where
the matmuls dominate.

    python scripts/research/bench_generation.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from verl_lrstab_cpu.generation import GenRequest, TransformersGenerator

REPO = Path(__file__).resolve().parents[2]


def _requests(tokenizer, n_prompts: int = 8, n: int = 4, max_tokens: int = 48) -> list[GenRequest]:
    questions = [f"{a} + {b} =" for a, b in ((3, 4), (12, 30), (7, 17), (25, 6), (1, 29), (14, 14), (9, 21), (30, 2))]
    prompts = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=False))["input_ids"]
        for q in questions[:n_prompts]
    ]
    return [GenRequest(p, max_tokens, 1.0, logprobs=True, seed=1000 * i + k) for i, p in enumerate(prompts)
            for k in range(n)]


def _models(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    yield "tiny asset model", lambda: AutoModelForCausalLM.from_pretrained(
        REPO / ".assets" / "model", attn_implementation="sdpa", dtype=torch.float32)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"

    def random_qwen2():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg)

    yield "random Qwen2", random_qwen2


def _time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from verl_lrstab_cpu.assets import build_assets

    build_assets(REPO / ".assets")
    tokenizer = AutoTokenizer.from_pretrained(REPO / ".assets" / "model")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    reqs = _requests(tokenizer)
    print(f"torch {torch.__version__}, {args.threads} threads, {len(reqs)} requests, best of {args.repeats}")
    print(f"| model | mode | s / step | tokens | tokens/s | vs float32 batched |")
    print("|---|---|---|---|---|---|")
    for name, make in _models(tokenizer):
        params = sum(p.numel() for p in make().parameters())
        base = None
        for mode, invariant, one_by_one in (("float32 batched", False, False),
                                            ("batch-invariant batched", True, False),
                                            ("one request at a time (float32)", False, True)):
            gen = TransformersGenerator(make(), stop, tokenizer.pad_token_id, batch_invariant=invariant)
            gen.generate(reqs[:2])  # warm-up
            run = (lambda: [gen.generate([r])[0] for r in reqs[:8]]) if one_by_one else (lambda: gen.generate(reqs))
            seconds, out = _time(run, 1 if one_by_one else args.repeats)
            tokens = sum(len(r.token_ids) for r in out)
            base = base or tokens / seconds
            print(f"| {name} ({params / 1e6:.2f}M) | {mode} | {seconds:.2f} | {tokens} | {tokens / seconds:.0f} | "
                  f"{tokens / seconds / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
