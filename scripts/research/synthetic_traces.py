#!/usr/bin/env python
"""Seeded synthetic response-length traces for ``scripts/research/bench_detector.py``.

Every trace is one value per step (``response_length/mean``, as verl logs it), 300 steps,
a base level of ~1000 tokens, multiplicative Gaussian noise (batch-mean noise: 4% unless
said otherwise), capped at 8192 (the paper's max response length). Each file carries its
ground truth in ``#`` comment lines:

- ``expect: fire``: a surge (the phenomenon of arXiv 2602.01826: the mean length runs
  away within tens of steps, well before the collapse); a detector must report it;
- ``expect: no_fire``: no surge (healthy growth, noise, outliers, length collapse, early
  format learning); any report is a false alarm;
- ``expect: either``: borderline (a 1.5x rise, or 1.8x spread over 40 steps): reported
  in the table, scored in neither count.

``onset`` is the first step of the rise. Regenerate (byte-identical) with::

    python scripts/research/synthetic_traces.py [--out scripts/research/traces] [--seed 0]
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEPS = 300
BASE = 1000.0
CAP = 8192.0  # the paper's max response length: a batch mean cannot exceed it
METRIC = "response_length/mean"
DEFAULT_OUT = Path(__file__).resolve().parent / "traces"


@dataclass
class Spec:
    name: str
    kind: str  # the class, for the table
    expect: str  # fire | no_fire | either
    onset: int | None
    doc: str
    shape: Callable[[np.ndarray], np.ndarray]  # steps -> noiseless multiple of BASE
    noise: float = 0.04


def ramp(start: int, duration: int, factor: float) -> Callable[[np.ndarray], np.ndarray]:
    """1 before ``start``, a smooth (half-cosine) rise to ``factor`` over ``duration`` steps, then flat."""
    def f(t):
        x = np.clip((t - start) / duration, 0.0, 1.0)
        return 1.0 + (factor - 1.0) * (1 - np.cos(np.pi * x)) / 2
    return f


def spikes(at: list[int], factor: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda t: np.where(np.isin(t, at), factor, 1.0)


def specs() -> list[Spec]:
    out = [
        Spec("flat", "plateau", "no_fire", None, "flat at 1000, 4% noise", lambda t: np.ones_like(t, float)),
        Spec("growth_1.5x_over_150", "healthy growth", "no_fire", None,
             "linear 1000 -> 1500 over steps 1-150, then flat", lambda t: 1 + 0.5 * np.clip(t / 150, 0, 1)),
        Spec("growth_1.5x_over_100", "healthy growth", "no_fire", None,
             "1000 -> 1500 over steps 50-150 (half-cosine)", ramp(50, 100, 1.5)),
        Spec("growth_2x_over_200", "healthy growth", "no_fire", None,
             "linear 1000 -> 2000 over steps 1-200, then flat", lambda t: 1 + np.clip(t / 200, 0, 1)),
    ]
    for pct in (5, 10, 20):
        out.append(Spec(f"noisy_plateau_{pct}pct", "noisy plateau", "no_fire", None,
                        f"flat at 1000, {pct}% noise", lambda t: np.ones_like(t, float), noise=pct / 100))
    out += [
        Spec("spike_single_3x", "spike", "no_fire", None, "one batch at 3x (step 120)", spikes([120], 3.0)),
        Spec("spike_double_adjacent_3x", "spike", "no_fire", None, "two adjacent batches at 3x (steps 120-121)",
             spikes([120, 121], 3.0)),
        Spec("spike_two_separate_3x", "spike", "no_fire", None, "single 3x batches at steps 100 and 130",
             spikes([100, 130], 3.0)),
        Spec("collapse_to_short_0.2x", "length collapse", "no_fire", None,
             "falls to 200 tokens over steps 120-135 (short answers)", ramp(120, 15, 0.2)),
        Spec("format_transient_down", "early format learning", "no_fire", None,
             "starts at 3000, settles to 1000 by step ~15 (verbose start)",
             lambda t: 1 + 2 * np.exp(-(t - 1) / 4)),
        Spec("format_transient_up", "early format learning", "no_fire", None,
             "starts at 300, rises to 1000 by step 20 (learns the answer format), then flat",
             lambda t: 0.3 + 0.7 * np.clip((t - 1) / 19, 0, 1)),
    ]
    for factor in (1.5, 1.8, 2.5, 4.0):
        for dur in (10, 20, 30, 40):
            expect = "either" if factor == 1.5 or (factor == 1.8 and dur > 30) else "fire"
            out.append(Spec(f"rise_{factor}x_in_{dur}", "rise", expect, 100,
                            f"1000 -> {factor * BASE:.0f} over steps 100-{100 + dur}, then flat",
                            ramp(100, dur, factor)))
    out += [
        Spec("rise_2.5x_in_20_noise10", "rise", "fire", 100, "as rise_2.5x_in_20 with 10% noise",
             ramp(100, 20, 2.5), noise=0.10),
        Spec("rise_early_2.5x_at_25", "rise", "fire", 25, "1000 -> 2500 over steps 25-40 (an early runaway)",
             ramp(25, 15, 2.5)),
        Spec("rise_late_2x_at_250", "rise", "fire", 250, "1000 -> 2000 over steps 250-270", ramp(250, 20, 2.0)),
        Spec("rise_after_growth", "rise", "fire", 150,
             "healthy growth 1000 -> 1400 over steps 1-150, then a 2.5x runaway over 150-175",
             lambda t: (1 + 0.4 * np.clip(t / 150, 0, 1)) * ramp(150, 25, 2.5)(t)),
        Spec("paper_like", "paper-like", "fire", 95,
             "slow growth, surge 1000 -> 3500 over steps 95-115, then drift to the 8192 cap by ~280",
             lambda t: np.minimum(8.192, (1 + 0.1 * t / 95) * ramp(95, 20, 3.2)(t) * ramp(200, 80, 2.3)(t))),
    ]
    return out


def generate(spec: Spec, seed: int = 0) -> np.ndarray:
    """The trace's values for steps 1..STEPS (rounded to 0.1 token, deterministic per name and seed)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    t = np.arange(1, STEPS + 1)
    values = BASE * spec.shape(t) * (1 + spec.noise * rng.standard_normal(STEPS))
    return np.round(np.clip(values, 1.0, CAP), 1)


def write(spec: Spec, out: Path, seed: int = 0) -> Path:
    path = out / f"{spec.name}.csv"
    lines = [f"# synthetic trace generated by scripts/research/synthetic_traces.py (seed {seed}): {spec.doc}",
             f"# class: {spec.kind}", f"# expect: {spec.expect}",
             f"# onset: {spec.onset if spec.onset is not None else ''}", f"# noise: {spec.noise:g}",
             f"step,{METRIC}"]
    lines += [f"{s},{v:.1f}" for s, v in zip(range(1, STEPS + 1), generate(spec, seed))]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_meta(path: Path) -> dict:
    """The ``# key: value`` ground-truth lines of a trace file."""
    meta = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].partition(":")
        if sep and key.strip() in ("class", "expect", "onset"):
            meta[key.strip()] = value.strip()
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in specs():
        write(spec, args.out, args.seed)
    print(f"wrote {len(specs())} traces to {args.out}")


if __name__ == "__main__":
    main()
