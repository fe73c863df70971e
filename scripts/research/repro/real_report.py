#!/usr/bin/env python
"""The real-model pilots' table and figure: what each ``real_pilot.py`` run shows.

Usage: python scripts/research/repro/real_report.py [RUN_DIR ...] [--out outputs/repro/real/report] [--block 20] [--no-archive]

Per run (default: every run under ``outputs/repro/real/``, and every run kept in
``scripts/research/repro/real_results/`` that is not there), from verl's metrics JSONL: steps
logged, the response length (mean of the first and last 10 steps, the highest 5-step median),
the share at the cap, the training score and verl's validation (through the sampler), the
mismatch k3 (median of the first and last 20 steps: does it grow with training?), the fp32
validation of ``real_eval.py`` where it ran, the grad
norm, and the detector's surge step. Writes ``pilots.md``, ``pilots.json``, ``blocks.md`` (block medians of the length, the share at
the cap, the score, k3, PPO's clip fraction, the entropy and the grad norm: ``--block`` steps)
``pilots.png``
(length, score, k3 and the longest response against the step, one colour per run) and ``timing.md``
(what a step costs: the median of each of verl's phase timers, per run and shape); then the
dose-response (``real_dose.py``: ``dose.md``, ``dose.png``) and the controls (``real_controls.py``:
``controls.md``, ``controls.png``) and stage 0's go / no-go (``real_stage0.py``: ``stage0.md``,
``stage0.png``) among the runs.

A pilot's outputs (checkpoints, logs) are large and not kept; what the report needs is: each run
read from ``outputs/`` is archived into ``scripts/research/repro/real_results/<run>/`` (``metrics.jsonl.gz``,
``run.json``, ``fp32_val.json``: a few hundred KB, committed), so a later checkout still has the
table and the figure of every pilot, and a run resumed there can be compared with the ones before.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/`
import pandas as pd  # noqa: E402

from repro import real_controls, real_dose, real_stage0  # noqa: E402
from repro.real_pilot import ARCHIVE, OUT, archive, metrics_file, pilot_runs  # noqa: E402,F401  (archive, pilot_runs: also this module's API)

from verl_lrstab_cpu.launch import REPO_ROOT  # noqa: E402
from verl_lrstab.plots import plt  # noqa: E402  (the Agg backend)
from verl_lrstab.runs import load_run  # noqa: E402

LENGTH, SCORE, K3, CLIP, GN = ("response_length/mean", "critic/score/mean", "actor/mismatch/k3",
                               "actor/lrstab/clip_ratio", "actor/grad_norm")
LONGEST = "response_length/max"
SURGE = "actor/lrstab/surge_step"
# The block medians of each run (``--block`` steps a block): what the notes quote.
BLOCK_METRICS = {LENGTH: "length", CLIP: "share at cap", SCORE: "score", K3: "k3", "actor/pg_clipfrac": "PPO clipfrac",
                 "actor/entropy": "entropy", GN: "grad norm"}


def _col(df: pd.DataFrame, key: str) -> pd.Series:
    return df[key].dropna() if key in df else pd.Series(dtype=float)


def summarize(run_dir: Path) -> dict:
    """The table row of one pilot (its segments merged first: a pilot still running is read as far as it got)."""
    df = load_run(metrics_file(run_dir))
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    length, score, k3, clip = (_col(df, k) for k in (LENGTH, SCORE, K3, CLIP))
    val = [c for c in df.columns if c.startswith("val-core/")]
    surge = _col(df, SURGE)
    fired = surge[surge >= 0]

    def head_tail(s: pd.Series, n: int, how: str = "mean"):
        if s.empty:
            return None, None
        a, b = s.iloc[:n], s.iloc[-n:]
        return (float(a.mean()), float(b.mean())) if how == "mean" else (float(a.median()), float(b.median()))

    return {
        "run": run_dir.name, "lr": info.get("lr"), "sampler_temperature": info.get("sampler_temperature"),
        "steps": int(df.index.max()) if len(df) else 0, "of": info.get("steps"),
        "length_first10": head_tail(length, 10)[0], "length_last10": head_tail(length, 10)[1],
        "length_peak5": float(length.rolling(5).median().max()) if len(length) >= 5 else None,
        "cap": (info.get("max_response_length")), "clip_max": float(clip.max()) if not clip.empty else None,
        "score_first10": head_tail(score, 10)[0], "score_last10": head_tail(score, 10)[1],
        "val": {int(s): float(v) for s, v in _col(df, val[0]).items()} if val else {},
        "k3_first20": head_tail(k3, 20, "median")[0], "k3_last20": head_tail(k3, 20, "median")[1],
        "grad_norm_max": float(_col(df, GN).max()) if GN in df else None,
        "fp32_val": {int(k): v["accuracy"] for k, v in json.loads((run_dir / "fp32_val.json").read_text()).items()}
        if (run_dir / "fp32_val.json").exists() else {},
        "surge_step": int(fired.iloc[0]) if not fired.empty else None,
    }


def blocks(run_dir: Path, size: int = 20) -> pd.DataFrame:
    """Medians of :data:`BLOCK_METRICS` over blocks of ``size`` steps (``1-20``, ``21-40``, ...), one row a block."""
    df = real_dose.training_frame(run_dir)
    cols = {k: v for k, v in BLOCK_METRICS.items() if k in df}
    block = (df.index - 1) // size
    out = df[list(cols)].groupby(block).median().rename(columns=cols)
    out.index = [f"{b * size + 1}-{min((b + 1) * size, int(df.index.max()))}" for b in out.index]
    out.index.name = "steps"
    return out


# verl's own timers (``marked_timer``) of a step's phases, as logged; ``old_log_prob`` only in recompute mode
TIMING = {"timing_s/step": "step s", "timing_s/gen": "generation s", "timing_s/old_log_prob": "old log-prob s",
          "timing_s/update_actor": "actor update s", "timing_s/update_weights": "weight sync s"}


def timing(run_dirs: list[Path]) -> pd.DataFrame:
    """What a step costs, one row a run: its shape, the median of each of verl's phase timers over its steps,
    the mean real tokens of a sequence (prompt + response) and the actor update's seconds per sequence."""
    rows = []
    for run_dir in run_dirs:
        df = real_dose.training_frame(run_dir)
        info = real_dose.run_info(run_dir)
        sequences = (info.get("prompts") or 4) * (info.get("samples") or 4)  # the pilots' first shape: 4 x 4
        row = {"run": run_dir.name, "mode": info.get("mode", "bypass"),
               "shape": f"{info.get('prompts') or 4}x{info.get('samples') or 4}, cap {info.get('max_response_length')}",
               "steps": len(df)}
        row.update({label: float(_col(df, key).median()) if key in df else float("nan") for key, label in TIMING.items()})
        row["tokens a sequence"] = float((_col(df, "prompt_length/mean") + _col(df, LENGTH)).mean())
        row["update s a sequence"] = row["actor update s"] / sequences
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def markdown(df: pd.DataFrame) -> str:
    """A small table as Markdown (pandas' ``to_markdown`` needs ``tabulate``, not installed here)."""
    head = [df.index.name or ""] + list(df.columns)
    rows = [[str(i)] + ["-" if pd.isna(v) else format(v, ".3g") for v in r] for i, r in zip(df.index, df.values)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])


def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| run | LR | sampler T | steps | length first 10 -> last 10 (peak 5-step median) | max share at cap | "
            "score first 10 -> last 10 | verl val, bf16 sampler (step: acc) | fp32 val (step: acc) | "
            "k3 median first 20 -> last 20 | max grad norm | surge |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        val = ", ".join(f"{s}: {v:.2f}" for s, v in sorted(r["val"].items()))
        fp32 = ", ".join(f"{s}: {v:.2f}" for s, v in sorted(r["fp32_val"].items()))
        lines.append(f"| {r['run']} | {_fmt(r['lr'])} | {_fmt(r['sampler_temperature'])} | {r['steps']}/{r['of']} | "
                     f"{_fmt(r['length_first10'], '.1f')} -> {_fmt(r['length_last10'], '.1f')} "
                     f"({_fmt(r['length_peak5'], '.1f')}; cap {r['cap']}) | {_fmt(r['clip_max'], '.2f')} | "
                     f"{_fmt(r['score_first10'], '.2f')} -> {_fmt(r['score_last10'], '.2f')} | {val or '-'} | {fp32 or '-'} | "
                     f"{_fmt(r['k3_first20'], '.2e')} -> {_fmt(r['k3_last20'], '.2e')} | "
                     f"{_fmt(r['grad_norm_max'], '.2f')} | {r['surge_step'] if r['surge_step'] else 'none'} |")
    return "\n".join(lines)


def figure(run_dirs: list[Path], path: Path) -> Path:
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for run_dir in run_dirs:
        df = load_run(metrics_file(run_dir))
        for ax, key in zip(axes, (LENGTH, SCORE, K3, LONGEST)):
            s = _col(df, key)
            ax.plot(s.index, s.rolling(5, min_periods=1).median() if key != LONGEST else s, label=run_dir.name, lw=1.2)
            ax.set_ylabel({LENGTH: "response length\n(5-step median)", SCORE: "training score\n(5-step median)",
                           K3: "mismatch k3\n(5-step median)", LONGEST: "longest response\n(cap dashed)"}[key])
        info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
        if info.get("max_response_length"):
            axes[3].axhline(info["max_response_length"], ls="--", lw=1, color="0.5")
        surge = _col(df, SURGE)
        if (surge >= 0).any():
            for ax in axes:
                ax.axvline(int(surge[surge >= 0].iloc[0]), ls="--", lw=1, color="k", alpha=0.6)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("RL step")
    fig.suptitle("SmolLM2-135M-Instruct, verl main_ppo on vLLM-CPU (bf16 sampler), bypass mode, constant LR")
    return real_dose.save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=OUT / "report")
    p.add_argument("--block", type=int, default=20, help="steps per block of the block medians (default 20)")
    p.add_argument("--no-archive", action="store_true",
                   help=f"do not copy the runs' metrics into {ARCHIVE.relative_to(REPO_ROOT)}/")
    args = p.parse_args(argv)
    runs = args.runs or pilot_runs()
    if not runs:
        raise SystemExit(f"no pilot runs (metrics.part*.jsonl) under {OUT} nor in {ARCHIVE}: "
                         "run scripts/research/repro/real_pilot.py first")
    rows = [summarize(d) for d in runs]
    if not args.no_archive:
        for d in runs:
            if d.parent != ARCHIVE:
                print(f"kept: {archive(d)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pilots.md").write_text(table(rows) + "\n")
    (args.out / "pilots.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    with open(args.out / "blocks.md", "w") as f:
        for d in runs:
            text = f"{d.name}: {args.block}-step block medians\n" + markdown(blocks(d, args.block))
            f.write(text + "\n\n")
            print(text)
    print(args.out / "blocks.md")
    print(figure(runs, args.out / "pilots.png"))
    steps = "What a step costs (medians of verl's timing_s/* over each run's steps, 2 shared CPU cores)\n\n" + \
        real_dose._markdown(timing(runs))
    (args.out / "timing.md").write_text(steps + "\n")
    print(steps)
    print(args.out / "timing.md")
    real_dose.report(runs, args.out)  # the dose-response runs among them: dose.md, dose.png
    real_controls.report(runs, args.out)  # each control against its reference: controls.md, .png
    real_stage0.report(runs, args.out)  # stage 0's go / no-go: stage0.md, stage0.png
    return 0


if __name__ == "__main__":
    sys.exit(main())
