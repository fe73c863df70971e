#!/usr/bin/env python
"""Seeded synthetic runs of the surge phenomena (classes A-T), with co-signal columns.

Each run is one row per step with the figures verl logs: ``response_length/mean``,
``critic/score/mean`` (batch accuracy), ``actor/mismatch/k3`` and ``response_length/clip_ratio``.
The numbers come from descriptions of real runs; every seed draws the plateau, the noise, the rise speed, the
cap and the times within the stated ranges, so the set is not one curve copied:

- **A** mismatch collapse, fast: plateau 300-450 tokens, noise 6-10 % (sd/mean) for 40+ steps;
  k3 doubles over the 20-30 steps before; then 1.25x within 3 steps, 1.45x within 12, the cap
  (1.85-2x the plateau) within 17 (time axis scaled 0.85-1.2); accuracy 0.82-0.88 falls to
  0.65-0.75 during the rise and below 0.5 12-15 steps after the onset (``crash``).
- **B** mismatch collapse, slower: 1.3x over 22-28 steps, then to the cap in 10-20 more;
  accuracy sags 0.88 -> 0.82 during the rise, crosses 0.5 8-15 steps after the cap is reached.
  ``rise_end`` is the step the cap is reached (a detection must come before it).
- **C** healthy early rebound: the length drops 2-2.5x over steps 1-5, climbs back (0.9-1.1x the
  drop) over 20-40 steps while accuracy rises ~0.1 -> ~0.7.
- **D** long stable run: 3000-5000 steps, noise 10-15 %, slow drift (1.5x over 1000-3000 steps),
  2-5 excursions of 1.3-1.9x lasting 25-40 steps that revert; the score rises slowly.
- **E** healthy growth: 2x over 100-200 steps with accuracy rising.
- **F** collapse to short answers (300 -> 5 tokens), or mismatch-KL drift (k3 x3-10) without a
  length rise.
- **G** a 10x excursion within 8 steps that reverts, then 150-400 steps later an A-like
  surge-and-collapse: firing on either is a detection.
- **H** long healthy run: 800-1200 steps, noise 5-10 %, slow growth to 1.2-1.8x, 3-8
  short excursions of 1.3-2x that revert within 5-15 steps; accuracy rises slowly; flat k3. Real
  logs of this kind often carry the score on every 10th row only (:func:`sparse_score`).

Three shapes of real surges an earlier default was late on or missed, and their healthy twins.
These carry what verl logs on every step instead of the mismatch k3 (NaN):
``actor/entropy``, ``actor/grad_norm``, ``actor/kl_loss``, ``actor/pg_clipfrac`` (``COSIGNALS``):

- **I** a slow healthy drift (~1.6x over 60 steps, score stable), then a 1.3-2x surge within 6-9
  steps with the clip share, grad norm (3-5x), KL loss (4-8x), entropy (1.2-1.4x) and clip
  fraction up from its first steps; the accuracy crashes 4-9 steps after the onset.
- **J** a flat length whose entropy and grad norm turn up 3-5 steps before a 4x explosion to the
  cap in 3-5 steps, the score falling to zero with it.
- **K** an early high (3-6x the later level) that recovers, a short phase, then a return to about
  that high within 2-4 steps with the score collapsing to zero in the same steps.
- **L** (healthy) growth of 1.5-1.9x within 25-45 steps with the entropy and the score rising.
- **M** (healthy) grad-norm spikes of 3-10x over 1-3 steps that revert, several at the start of a
  1.3-1.8x length excursion that reverts.
- **N** (healthy) the KL loss rising slowly (3-8x over the run) under such excursions.

Two more shapes of hidden real runs and their twins (O and Q carry the mismatch k3 too):

- **O** a flat length that climbs slowly and noisily to ~1.5x within ~15 steps and ~2x within ~35,
  k3 doubling over the climb's first ~15 steps (after settling from a higher early level), the
  entropy flat or falling slightly, a grad-norm spike or two, the accuracy high and noisy and
  falling ~25 steps into the climb.
- **P** (healthy) a learning run with a long-tailed length: single steps +20-30 % that revert, a
  level drifting up ~1.2x over 30 steps, and steps +35-55 % whose batch accuracy dips 0.15-0.25
  in the same step, both back the next step.
- **Q** (healthy) a slow drift (1.3-1.7x over 20-40 steps) with a flat k3.

Two healthy shapes of small-batch GRPO runs logged every step, and the surge twin of the second:

- **R** (healthy) a very noisy length at its baseline (15-25 % a step, no trend), a noisy entropy
  (15-25 % a step, no trend), the score rising slowly and the KL loss to the reference growing
  steadily from the start (4-8x over 25-40 steps, single steps 1.4-1.8x above its trend).
- **S** (healthy) a slow drift (1.2-1.4x over 20-25 steps), then a **two-step excursion**: +20-30 %
  over the step before, the next step 8-15 % above that pre-excursion step, the third back below it;
  the batch accuracy (noise about 0.1) dips 0.15-0.25 on the first excursion step, half that on the
  second, and recovers on the third.
- **T** the surge twin of S: the same start, but the length keeps rising for 5 more steps (to
  1.8-2.2x the pre-excursion step) and the accuracy keeps falling (below 0.5 within 4-7 steps).

:func:`sparse_score` turns any run's score column into the forms real logs have: every k-th row
only (NaN elsewhere), the same forward-filled, or absent.

Ground truth goes in ``#`` lines (``class``, ``expect``, ``onset``, ``crash``, ``rise_end``,
``excursion``). ``python scripts/research/phenomena.py`` writes seed 0 of each class to
``scripts/research/traces/classes/*.csv`` (byte-identical on every run; ``lrstab replay`` reads them);
the benchmark and the tests call :func:`traces` directly.
"""

from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LENGTH, SCORE, K3, CLIP = ("response_length/mean", "critic/score/mean", "actor/mismatch/k3",
                           "response_length/clip_ratio")
# The figures verl logs on every step that the detector reads: classes I-Q carry them.
ENTROPY, GRAD_NORM, KL_LOSS, PG_CLIPFRAC = "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/pg_clipfrac"
COSIGNALS = (ENTROPY, GRAD_NORM, KL_LOSS, PG_CLIPFRAC)
CLASSES = "ABCDEFGHIJKLMNOPQRST"
#: the classes that carry verl's co-signals
COSIGNAL_CLASSES = "IJKLMNOPQRST"
SEEDS = range(8)
OUT = Path(__file__).resolve().parent / "traces" / "classes"


@dataclass
class Trace:
    name: str
    cls: str
    expect: str  # fire | no_fire
    doc: str
    length: np.ndarray
    score: np.ndarray
    k3: np.ndarray
    clip: np.ndarray
    onset: int | None = None
    crash: int | None = None  # first step the noiseless accuracy is below 0.5
    rise_end: int | None = None  # B: the step the cap is reached
    excursion: tuple[int, int] | None = None  # G: first and last step of the 10x excursion
    meta: dict = field(default_factory=dict)
    cosignals: dict = field(default_factory=dict)  # classes I-Q: {ENTROPY: array, ...} (COSIGNALS)

    @property
    def steps(self) -> list[int]:
        return list(range(1, len(self.length) + 1))

    def columns(self) -> dict[str, list]:
        cols = {LENGTH: self.length.tolist(), SCORE: self.score.tolist(), K3: self.k3.tolist(),
                CLIP: self.clip.tolist()}
        return {**cols, **{k: v.tolist() for k, v in self.cosignals.items()}}


# -- building blocks ------------------------------------------------------------------------------
def _interp_log(t, knots):
    """Piecewise log-linear curve through ``knots`` [(t, factor)], flat outside."""
    xs, ys = zip(*knots)
    return np.exp(np.interp(t, xs, np.log(ys)))


def _noisy_length(rng, level, cv, cap):
    values = level * (1 + cv * rng.standard_normal(len(level)))
    return np.round(np.clip(values, 1.0, 0.995 * cap), 1)


def _clip_ratio(rng, level, cap):
    # Share of responses at the cap if lengths were gamma(shape 2) around the batch mean.
    x = 2 * cap / np.maximum(level, 1.0)
    p = np.exp(-x) * (1 + x)
    return np.round(np.clip(p + 0.01 * rng.standard_normal(len(level)) * np.sqrt(p + 1e-3), 0, 1), 4)


def _noisy_score(rng, acc, batch):
    sd = np.sqrt(np.clip(acc * (1 - acc), 0.01, None) / batch)
    return np.round(np.clip(acc + sd * rng.standard_normal(len(acc)), 0, 1), 4)


def _noisy_k3(rng, k3):
    return np.array([float(f"{v:.4g}") for v in k3 * np.exp(0.15 * rng.standard_normal(len(k3)))])


def _format_transient(rng, t, steps=8):
    """The first steps' level relative to the plateau (format learning), 1 from ``steps`` on."""
    start = rng.uniform(0.7, 1.3)
    return np.where(t < steps, start + (1 - start) * (t - 1) / (steps - 1), 1.0)


def _excursions(rng, count, starts, min_gap, durations, amplitudes) -> list[tuple[int, int, float]]:
    """``[(start, duration, amplitude)]``: ``count`` (integer range) excursions with starts in the range
    ``starts``, at least ``min_gap`` steps apart (50 tries each), durations and amplitudes drawn in theirs."""
    out: list[tuple[int, int, float]] = []
    for _ in range(int(rng.integers(*count))):
        for _try in range(50):
            at = int(rng.integers(*starts))
            if all(abs(at - e) > min_gap for e, _, _ in out):
                out.append((at, int(rng.integers(*durations)), rng.uniform(*amplitudes)))
                break
    return out


def _with_excursions(level, t, excursions):
    """``level`` times each excursion: a sin^2 bump to ``amplitude`` x over ``duration`` steps, then back."""
    for at, dur, amp in excursions:
        x = np.clip((t - at) / dur, 0, 1)
        level = level * np.exp(np.log(amp) * np.sin(np.pi * x) ** 2)
    return level


def _collapse_run(rng, cls, name, rise, onset, n, plateau, cv, cap, acc_knots, k3_base, k3_start, doc, **kw):
    t = np.arange(1, n + 1)
    level = np.minimum(plateau * rise * _format_transient(rng, t), cap)
    acc = np.interp(t, *zip(*acc_knots))
    k3 = k3_base * _interp_log(t, [(k3_start, 1.0), (onset, 2.0), (onset + 15, 8.0)])
    crash = int(t[np.argmax(acc < 0.5)]) if (acc < 0.5).any() else None
    return Trace(name, cls, "fire", doc, _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, kw.pop("batch")),
                 _noisy_k3(rng, k3), _clip_ratio(rng, level, cap), onset=onset, crash=crash, **kw)


# -- the classes ----------------------------------------------------------------------------------
def class_a(rng, name, onset=None, n_after=None) -> Trace:
    plateau, cv = rng.uniform(300, 450), rng.uniform(0.06, 0.10)
    onset = onset or int(rng.integers(55, 131))
    cap, speed = plateau * rng.uniform(1.85, 2.0), rng.uniform(0.85, 1.2)
    knots = [(onset, 1.0), (onset + 3 * speed, 1.25), (onset + 12 * speed, 1.45), (onset + 17 * speed, 1.95)]
    acc0, mid, cross = rng.uniform(0.82, 0.88), rng.uniform(0.65, 0.75), rng.uniform(12, 15)
    acc = [(1, acc0 - 0.1), (30, acc0), (onset, acc0), (onset + 9, mid), (onset + cross, 0.5),
           (onset + cross + 8, 0.15)]
    n = onset + int(cross) + (n_after or 25)
    t = np.arange(1, n + 1)
    return _collapse_run(rng, "A", name, _interp_log(t, knots), onset, n, plateau, cv, cap, acc,
                         6e-4 * rng.uniform(0.5, 2), onset - int(rng.integers(20, 31)),
                         f"A: plateau {plateau:.0f}, noise {cv:.0%}, cap {cap:.0f}, rise speed x{1 / speed:.2f}, "
                         f"accuracy {acc0:.2f} -> below 0.5 at +{cross:.1f}", batch=int(rng.integers(256, 1025)))


def class_b(rng, name) -> Trace:
    plateau, cv = rng.uniform(300, 450), rng.uniform(0.06, 0.10)
    onset, cap = int(rng.integers(55, 131)), plateau * rng.uniform(1.8, 2.0)
    t1, t2 = int(rng.integers(22, 29)), int(rng.integers(10, 21))
    rise_end = onset + t1 + t2
    acc0, cross = rng.uniform(0.86, 0.90), rise_end + rng.uniform(8, 15)
    acc = [(1, acc0 - 0.15), (30, acc0), (onset, acc0), (rise_end, acc0 - 0.06), (cross, 0.5), (cross + 10, 0.2)]
    n = int(cross) + 20
    t = np.arange(1, n + 1)
    rise = _interp_log(t, [(onset, 1.0), (onset + t1, 1.3), (rise_end, cap / plateau)])
    return _collapse_run(rng, "B", name, rise, onset, n, plateau, cv, cap, acc,
                         6e-4 * rng.uniform(0.5, 2) / 1.2, onset - int(rng.integers(20, 31)),
                         f"B: plateau {plateau:.0f}, noise {cv:.0%}, 1.3x over {t1} steps then the cap "
                         f"{cap:.0f} at {rise_end}", rise_end=rise_end, batch=int(rng.integers(256, 1025)))


def class_c(rng, name) -> Trace:
    l0, cv, n = rng.uniform(600, 1500), rng.uniform(0.05, 0.10), int(rng.integers(200, 301))
    drop, trough, climb = rng.uniform(2.0, 2.5), int(rng.integers(0, 6)), int(rng.integers(20, 41))
    back = drop * rng.uniform(0.9, 1.1)
    start = 5 + trough
    t = np.arange(1, n + 1)
    x = np.clip((t - start) / climb, 0, 1)
    level = l0 * np.exp(-np.log(drop) * np.clip((t - 1) / 4, 0, 1) + np.log(back) * (1 - np.cos(np.pi * x)) / 2)
    cap = l0 * rng.uniform(2.5, 4.0)
    acc = 0.1 + 0.6 * x + 0.05 * np.clip((t - start - climb) / 200, 0, 1)
    return Trace(name, "C", "no_fire", f"C: {l0:.0f} tokens, drop {drop:.2f}x by step 5, climb back {back:.2f}x over "
                 f"steps {start}-{start + climb}, accuracy 0.1 -> 0.7",
                 _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, 512), _noisy_k3(rng, np.full(n, 5e-4)),
                 _clip_ratio(rng, level, cap))


def class_d(rng, name) -> Trace:
    n, plateau, cv = int(rng.integers(3000, 5001)), rng.uniform(400, 1500), rng.uniform(0.10, 0.15)
    t = np.arange(1, n + 1)
    drift_steps = rng.uniform(1000, 3000)
    level = plateau * 1.5 ** np.clip(t / drift_steps, 0, 1) * (1 + 0.05 * np.sin(2 * np.pi * t / rng.uniform(500, 1500)))
    excursions = _excursions(rng, (2, 6), (100, n - 60), 300, (25, 41), (1.3, 1.9))
    level = _with_excursions(level, t, excursions)
    cap = plateau * rng.uniform(4, 6)
    acc = 0.3 + 0.35 * t / n
    exc = ", ".join(f"{amp:.2f}x at {at} ({dur} steps)" for at, dur, amp in sorted(excursions))
    return Trace(name, "D", "no_fire", f"D: {n} steps, plateau {plateau:.0f}, noise {cv:.0%}, drift 1.5x over "
                 f"{drift_steps:.0f} steps, excursions {exc}",
                 _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, 512),
                 _noisy_k3(rng, 5e-4 * (1 + 0.3 * t / n)), _clip_ratio(rng, level, cap))


def class_e(rng, name) -> Trace:
    plateau, cv = rng.uniform(300, 1000), rng.uniform(0.05, 0.10)
    start, dur = int(rng.integers(20, 61)), int(rng.integers(100, 201))
    n = start + dur + 100
    t = np.arange(1, n + 1)
    x = np.clip((t - start) / dur, 0, 1)
    level = plateau * 2 ** x
    cap = plateau * rng.uniform(3, 5)
    a0, a1 = rng.uniform(0.2, 0.4), rng.uniform(0.6, 0.8)
    return Trace(name, "E", "no_fire", f"E: {plateau:.0f} -> x2 over steps {start}-{start + dur}, accuracy "
                 f"{a0:.2f} -> {a1:.2f}", _noisy_length(rng, level, cv, cap), _noisy_score(rng, a0 + (a1 - a0) * x, 512),
                 _noisy_k3(rng, np.full(n, 5e-4)), _clip_ratio(rng, level, cap))


def class_f(rng, name, kind) -> Trace:
    n, cv = 300, rng.uniform(0.05, 0.10)
    t = np.arange(1, n + 1)
    if kind == "short":
        at, dur = int(rng.integers(80, 151)), int(rng.integers(10, 31))
        level = _interp_log(t, [(at, 300.0), (at + dur, 5.0)])
        acc = np.interp(t, [1, at, at + dur], [0.6, 0.6, 0.05])
        k3 = np.full(n, 5e-4)
        doc = f"F: collapse to short answers, 300 -> 5 tokens over steps {at}-{at + dur}"
    else:
        at, dur, factor = int(rng.integers(50, 101)), int(rng.integers(100, 201)), rng.uniform(3, 10)
        level = np.full(n, rng.uniform(300, 1000))
        acc = 0.5 + 0.1 * t / n
        k3 = 5e-4 * _interp_log(t, [(at, 1.0), (at + dur, factor)])
        doc = f"F: mismatch k3 x{factor:.1f} over steps {at}-{at + dur}, no length rise"
    cap = float(level.max()) * 3
    return Trace(name, "F", "no_fire", doc, _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, 512),
                 _noisy_k3(rng, k3), _clip_ratio(rng, level, cap))


def class_g(rng, name) -> Trace:
    first = int(rng.integers(60, 121))
    later = first + int(rng.integers(150, 401))
    trace = class_a(rng, name, onset=later)
    up, down = int(rng.integers(3, 6)), 8
    t = np.arange(1, len(trace.length) + 1)
    bump = _interp_log(t, [(first, 1.0), (first + up, 10.0), (first + down, 1.0)])
    cap = float(trace.length.max()) / 0.995
    trace.length = np.round(np.minimum(trace.length * bump, 0.995 * cap * 10), 1)
    trace.cls, trace.excursion = "G", (first, first + down)
    trace.doc = f"G: 10x excursion over steps {first}-{first + down}, then " + trace.doc
    return trace


def class_h(rng, name) -> Trace:
    n, plateau, cv = int(rng.integers(800, 1201)), rng.uniform(300, 1000), rng.uniform(0.05, 0.10)
    t = np.arange(1, n + 1)
    growth = rng.uniform(1.2, 1.8)
    level = plateau * growth ** (t / n)
    excursions = _excursions(rng, (3, 9), (60, n - 20), 60, (5, 16), (1.3, 2.0))
    level = _with_excursions(level, t, excursions)
    cap = plateau * growth * rng.uniform(3, 5)  # 3-5x the final level: a healthy run's truncation stays low
    acc = 0.3 + 0.3 * t / n
    exc = ", ".join(f"{amp:.2f}x at {at} ({dur} steps)" for at, dur, amp in sorted(excursions))
    return Trace(name, "H", "no_fire", f"H: {n} steps, plateau {plateau:.0f}, noise {cv:.0%}, growth {growth:.2f}x, "
                 f"excursions {exc}", _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, 512),
                 _noisy_k3(rng, np.full(n, 5e-4)), _clip_ratio(rng, level, cap))


# -- the classes with verl's co-signals: real shapes and their healthy twins ---------------------
def _lognoise(rng, curve, sd):
    """``curve`` times log-normal noise of ``sd`` (grad norms, KLs and clip fractions are positive)."""
    return np.array([float(f"{v:.4g}") for v in curve * np.exp(sd * rng.standard_normal(len(curve)))])


def _cosignals(rng, t, entropy=None, grad=None, kl=None, clipfrac=None) -> dict:
    """verl's per-step figures around their base levels; each argument a factor curve over ``t`` (None: flat)."""
    flat = np.ones(len(t))
    e0, g0, k0, c0 = rng.uniform(0.3, 0.6), rng.uniform(0.15, 0.4), rng.uniform(1e-3, 4e-3), rng.uniform(2e-3, 6e-3)
    return {ENTROPY: _lognoise(rng, e0 * (flat if entropy is None else entropy), 0.03),
            GRAD_NORM: _lognoise(rng, g0 * (flat if grad is None else grad), 0.15),
            KL_LOSS: _lognoise(rng, k0 * (1 + 0.3 * t / len(t)) * (flat if kl is None else kl), 0.08),
            PG_CLIPFRAC: _lognoise(rng, c0 * (flat if clipfrac is None else clipfrac), 0.15)}


def _new_trace(rng, name, cls, expect, doc, level, cv, cap, acc, cosignals, k3=None, batch=256, **kw) -> Trace:
    """A run with verl's co-signals; ``k3``: its mismatch-KL column (None: not logged, NaN)."""
    n, onset = len(level), kw.get("onset")
    after = (acc < 0.5) & (np.arange(1, n + 1) >= (onset or 1))  # the crash: the first step from the onset below 0.5
    crash = int(np.argmax(after)) + 1 if expect == "fire" and after.any() else None
    return Trace(name, cls, expect, doc, _noisy_length(rng, level, cv, cap), _noisy_score(rng, acc, batch),
                 np.full(n, np.nan) if k3 is None else k3, _clip_ratio(rng, level, cap), crash=crash,
                 cosignals=cosignals, **kw)


def class_i(rng, name) -> Trace:
    """Healthy drift ~1.6x over 60 steps with a stable score, then a 1.3-2x surge within ~9 steps
    whose clip share, grad norm, KL and entropy turn up from its first steps; the accuracy crashes
    4-9 steps after the onset (bf16 Qwen3-1.7B GRPO runs)."""
    plateau, cv = rng.uniform(250, 450), rng.uniform(0.04, 0.07)
    d0 = int(rng.integers(15, 31))
    onset = d0 + 60 + int(rng.integers(0, 11))
    surge, rise = rng.uniform(1.3, 2.0), int(rng.integers(6, 10))
    crash_in = int(rng.integers(4, 10))
    n = onset + crash_in + 15
    t = np.arange(1, n + 1)
    drift = _interp_log(t, [(d0, 1.0), (d0 + 60, rng.uniform(1.5, 1.7))])
    level = plateau * drift * _interp_log(t, [(onset, 1.0), (onset + rise, surge)])
    cap = plateau * drift[onset - 1] * rng.uniform(1.6, 2.2)  # the clip share: ~0.1 before the surge, x2.5 in it
    acc0 = rng.uniform(0.55, 0.7)
    acc = np.interp(t, [1, 20, onset + crash_in - 3, onset + crash_in, onset + crash_in + 6],
                    [acc0 - 0.1, acc0, acc0, 0.45, 0.1])
    # the real runs' log shows them up from the surge's first steps: at full height half-way through it
    up = lambda factor: _interp_log(t, [(onset, 1.0), (onset + rise // 2, factor)])  # noqa: E731
    co = _cosignals(rng, t, entropy=up(rng.uniform(1.2, 1.4)), grad=up(rng.uniform(3, 5)), kl=up(rng.uniform(4, 8)),
                    clipfrac=up(rng.uniform(2, 3)))
    return _new_trace(rng, name, "I", "fire", f"I: plateau {plateau:.0f}, noise {cv:.0%}, drift from {d0}, surge "
                      f"{surge:.2f}x over {rise} steps from {onset}, crash at +{crash_in}", level, cv, cap, acc, co,
                      onset=onset)


def class_j(rng, name) -> Trace:
    """A flat length whose entropy and grad norm turn up ~4 steps before a 4x explosion to the cap,
    the score falling to zero with it."""
    plateau, cv = rng.uniform(250, 600), rng.uniform(0.04, 0.08)
    onset, lead, rise = int(rng.integers(50, 121)), int(rng.integers(3, 6)), int(rng.integers(3, 6))
    n = onset + 30
    t = np.arange(1, n + 1)
    cap = plateau * rng.uniform(3.8, 4.5)
    level = plateau * _interp_log(t, [(onset, 1.0), (onset + rise, 4.2)])
    acc0 = rng.uniform(0.55, 0.75)
    acc = np.interp(t, [1, 20, onset + 1, onset + rise + 1, n], [acc0 - 0.1, acc0, acc0, 0.02, 0.0])
    early = lambda factor: _interp_log(t, [(onset - lead, 1.0), (onset, factor), (onset + rise, factor * 1.2)])  # noqa: E731
    late = lambda factor: _interp_log(t, [(onset, 1.0), (onset + rise, factor)])  # noqa: E731
    co = _cosignals(rng, t, entropy=early(rng.uniform(1.25, 1.5)), grad=early(rng.uniform(3, 5)),
                    kl=late(rng.uniform(4, 8)), clipfrac=late(rng.uniform(2, 3)))
    return _new_trace(rng, name, "J", "fire", f"J: flat {plateau:.0f}, noise {cv:.0%}, entropy and grad norm up "
                      f"from {onset - lead}, 4x to the cap {cap:.0f} over {rise} steps from {onset}", level, cv, cap,
                      acc, co, onset=onset)


def class_k(rng, name) -> Trace:
    """An early high (3-6x the later level) and recovery, a long short phase, then a return to about
    that high with the score collapsing to zero in the same steps."""
    low, cv, high = rng.uniform(120, 250), rng.uniform(0.05, 0.08), rng.uniform(3, 6)
    fall_at, onset, rise = int(rng.integers(10, 21)), int(rng.integers(55, 91)), int(rng.integers(2, 5))
    back = high * rng.uniform(0.8, 1.1)
    n = onset + 40
    t = np.arange(1, n + 1)
    level = low * _interp_log(t, [(1, high), (fall_at, high), (fall_at + 8, 1.0), (onset, 1.0), (onset + rise, back)])
    cap = low * high * rng.uniform(1.5, 2.0)
    acc0 = rng.uniform(0.5, 0.7)
    acc = np.interp(t, [1, fall_at + 8, onset + 1, onset + rise + 1, n], [0.2, acc0, acc0, 0.02, 0.0])
    late = lambda factor: _interp_log(t, [(onset, 1.0), (onset + rise, factor)])  # noqa: E731
    co = _cosignals(rng, t, entropy=late(rng.uniform(1.1, 1.3)), grad=late(rng.uniform(1.5, 3)))
    return _new_trace(rng, name, "K", "fire", f"K: {high:.1f}x early high until {fall_at}, {low:.0f} tokens, back to "
                      f"{back:.1f}x over {rise} steps from {onset} with the score to zero", level, cv, cap, acc, co,
                      onset=onset)


def class_l(rng, name) -> Trace:
    """Healthy twin: the length grows 1.5-1.9x within 25-45 steps (the length alone alarms) with the
    entropy rising and the score rising."""
    plateau, cv = rng.uniform(250, 700), rng.uniform(0.04, 0.08)
    start, dur, growth = int(rng.integers(30, 81)), int(rng.integers(25, 46)), rng.uniform(1.5, 1.9)
    n = start + dur + 100
    t = np.arange(1, n + 1)
    x = np.clip((t - start) / dur, 0, 1)
    level = plateau * growth ** x
    cap = plateau * growth * rng.uniform(3, 4.5)
    a0, a1 = rng.uniform(0.2, 0.4), rng.uniform(0.6, 0.8)
    co = _cosignals(rng, t, entropy=rng.uniform(1.2, 1.4) ** x)
    return _new_trace(rng, name, "L", "no_fire", f"L: {plateau:.0f} -> x{growth:.2f} over steps {start}-{start + dur}, "
                      f"entropy and accuracy ({a0:.2f} -> {a1:.2f}) rising", level, cv, cap, a0 + (a1 - a0) * x, co)


def _long_healthy(rng, n):
    plateau, cv = rng.uniform(300, 800), rng.uniform(0.05, 0.08)
    t = np.arange(1, n + 1)
    excursions = _excursions(rng, (3, 7), (40, n - 20), 60, (5, 16), (1.3, 1.8))
    level = _with_excursions(plateau * rng.uniform(1.1, 1.5) ** (t / n), t, excursions)
    return t, plateau, cv, excursions, level, plateau * rng.uniform(3, 5), 0.3 + 0.3 * t / n


def class_m(rng, name) -> Trace:
    """Healthy twin: grad-norm spikes (3-10x for 1-3 steps) that revert, several at the start of a
    length excursion of 1.3-1.8x (itself reverting within 5-15 steps)."""
    t, plateau, cv, excursions, level, cap, acc = _long_healthy(rng, int(rng.integers(300, 601)))
    grad = np.ones(len(t))
    spikes = [at + int(rng.integers(0, 3)) for at, _, _ in excursions] + list(rng.integers(20, len(t), 4))
    for at in spikes:
        grad[at - 1:at - 1 + int(rng.integers(1, 4))] *= rng.uniform(3, 10)
    co = _cosignals(rng, t, grad=grad)
    exc = ", ".join(f"{amp:.2f}x at {at}" for at, _, amp in sorted(excursions))
    return _new_trace(rng, name, "M", "no_fire", f"M: {len(t)} steps, {plateau:.0f} tokens, excursions {exc}, grad-norm "
                      f"spikes at {sorted(int(s) for s in spikes)}", level, cv, cap, acc, co)


def class_n(rng, name) -> Trace:
    """Healthy twin: the KL loss to the reference rises slowly (3-8x over the run) while the length
    makes excursions of 1.3-1.8x that revert."""
    t, plateau, cv, excursions, level, cap, acc = _long_healthy(rng, int(rng.integers(300, 601)))
    factor = rng.uniform(3, 8)
    co = _cosignals(rng, t, kl=factor ** (t / len(t)))
    exc = ", ".join(f"{amp:.2f}x at {at}" for at, _, amp in sorted(excursions))
    return _new_trace(rng, name, "N", "no_fire", f"N: {len(t)} steps, {plateau:.0f} tokens, KL loss x{factor:.1f} over "
                      f"the run, excursions {exc}", level, cv, cap, acc, co)


def class_o(rng, name) -> Trace:
    """A flat length that climbs slowly and noisily to ~1.5x within ~15 steps and ~2x within ~35, the
    mismatch KL (k3) doubling over the climb's first ~15 steps (it rises with the length), the entropy
    flat or falling slightly, the grad norm spiking once or twice, the batch accuracy high and noisy
    and falling only ~25 steps into the climb."""
    plateau, cv = rng.uniform(300, 700), rng.uniform(0.08, 0.12)
    onset = int(rng.integers(60, 121))
    mid, top = rng.uniform(12, 18), rng.uniform(30, 40)
    fall, cross = int(rng.integers(22, 29)), rng.uniform(8, 12)
    n = onset + fall + int(cross) + 15
    t = np.arange(1, n + 1)
    # the climb wobbles around its log-linear path (a noisy climb, not a ramp)
    wobble = np.exp(np.where(t > onset, 0.04 * rng.standard_normal(n), 0.0))
    level = plateau * wobble * _interp_log(t, [(onset, 1.0), (onset + mid, rng.uniform(1.4, 1.6)),
                                               (onset + top, rng.uniform(1.8, 2.2))])
    cap = plateau * rng.uniform(2.8, 3.5)
    kl_mid = rng.uniform(1.8, 2.4)
    # k3 settles from the early steps' higher level (1.5-2.2x) to its plateau before the climb: the
    # steps 30-60 back hold more than the climb's start, so a KL test against them sees it late
    k3 = 5e-4 * rng.uniform(0.5, 2) * _interp_log(t, [(1, rng.uniform(1.5, 2.2)), (onset - int(rng.integers(5, 16)), 1.0),
                                                      (onset, 1.0), (onset + mid * rng.uniform(0.8, 1.2), kl_mid),
                                                      (onset + top, kl_mid * rng.uniform(1.5, 2.0))])
    acc0 = rng.uniform(0.75, 0.88)
    acc = np.interp(t, [1, 20, onset + fall, onset + fall + cross, onset + fall + cross + 10],
                    [acc0 - 0.1, acc0, acc0, 0.5, 0.2])
    grad = np.ones(n)
    spikes = sorted(onset + int(rng.integers(0, 21)) for _ in range(int(rng.integers(1, 3))))
    for at in spikes:
        grad[at - 1] *= rng.uniform(2, 4)
    co = _cosignals(rng, t, entropy=_interp_log(t, [(onset, 1.0), (onset + top, rng.uniform(0.85, 1.0))]), grad=grad)
    return _new_trace(rng, name, "O", "fire", f"O: flat {plateau:.0f}, noise {cv:.0%}, climb from {onset} "
                      f"(~1.5x at +{mid:.0f}, ~2x at +{top:.0f}), k3 x{kl_mid:.1f} with it, grad-norm spikes at "
                      f"{spikes}, accuracy {acc0:.2f} falling from +{fall}", level, cv, cap, acc, co, onset=onset,
                      k3=_noisy_k3(rng, k3), batch=int(rng.integers(64, 129)))


def class_p(rng, name) -> Trace:
    """Healthy twin: a GRPO run that learns steadily (batch accuracy high and noisy, entropy low and
    flat, grad norm flat) with a long-tailed length: single steps +20-30 % that revert the next step,
    the level drifting up slowly (1.15-1.25x over 25-40 steps, two to four times), and two to four
    steps where the length jumps +35-55 % while that step's batch accuracy dips by 0.15-0.25 (long
    answers are more often wrong or cut off), both back the next step."""
    plateau, cv, n = rng.uniform(300, 800), rng.uniform(0.05, 0.08), int(rng.integers(200, 301))
    t = np.arange(1, n + 1)
    knots, at, ends = [(1, 1.0)], int(rng.integers(20, 41)), []
    factor = 1.0
    for _ in range(int(rng.integers(2, 5))):
        if at + 45 > n:
            break
        dur = int(rng.integers(25, 41))
        knots.append((at, factor))
        factor *= rng.uniform(1.15, 1.25)
        knots.append((at + dur, factor))
        ends.append(at + dur)
        at += dur + int(rng.integers(10, 41))
    level = plateau * _interp_log(t, knots)
    spike = np.where(rng.random(n) < 0.12, rng.uniform(1.2, 1.3, n), 1.0)
    spike[1:][spike[:-1] > 1] = 1.0  # single steps: each spike is back the next step
    big = sorted({int(np.clip(e + rng.integers(-6, 4), 25, n - 2)) for e in ends[:int(rng.integers(2, 5))]})
    dips = np.zeros(n)
    for s in big:
        spike[s - 2:s + 1] = 1.0  # a single step: the steps around it are not spikes
        spike[s - 1], dips[s - 1] = rng.uniform(1.35, 1.55), rng.uniform(0.15, 0.25)
    cap = plateau * factor * rng.uniform(3, 4)
    acc0 = rng.uniform(0.7, 0.85)
    acc = acc0 + rng.uniform(0.03, 0.08) * t / n
    co = _cosignals(rng, t)
    tr = _new_trace(rng, name, "P", "no_fire", f"P: {n} steps, {plateau:.0f} tokens, noise {cv:.0%}, drift to "
                    f"x{factor:.2f}, one-step spikes with a score dip at {big}", level * spike, cv, cap, acc, co,
                    batch=int(rng.integers(64, 129)))
    # the batch's composition: a long batch scores lower in the same step (more wrong or cut-off answers)
    tr.score = np.round(np.clip(tr.score - dips - 0.4 * np.log(spike) * (dips == 0), 0, 1), 4)
    return tr


def class_q(rng, name) -> Trace:
    """Healthy twin: a flat length that drifts up slowly and noisily (1.3-1.7x over 20-40 steps, then
    holds) with a flat mismatch KL, the entropy flat or falling slightly, a grad-norm spike or two and
    the batch accuracy high and noisy, not falling."""
    plateau, cv = rng.uniform(300, 700), rng.uniform(0.06, 0.10)
    onset, dur = int(rng.integers(60, 121)), int(rng.integers(20, 41))
    n = onset + dur + int(rng.integers(60, 121))
    t = np.arange(1, n + 1)
    wobble = np.exp(np.where(t > onset, 0.04 * rng.standard_normal(n), 0.0))
    level = plateau * wobble * _interp_log(t, [(onset, 1.0), (onset + dur, rng.uniform(1.3, 1.7))])
    cap = plateau * rng.uniform(2.8, 3.5)
    acc0 = rng.uniform(0.75, 0.88)
    acc = np.interp(t, [1, 20, n], [acc0 - 0.1, acc0, acc0 + rng.uniform(0, 0.05)])
    grad = np.ones(n)
    for _ in range(int(rng.integers(1, 3))):
        grad[onset + int(rng.integers(0, 21)) - 1] *= rng.uniform(2, 4)
    co = _cosignals(rng, t, entropy=_interp_log(t, [(onset, 1.0), (onset + dur, rng.uniform(0.85, 1.0))]), grad=grad)
    return _new_trace(rng, name, "Q", "no_fire", f"Q: flat {plateau:.0f}, noise {cv:.0%}, drift from {onset} over "
                      f"{dur} steps, flat k3, accuracy {acc0:.2f}", level, cv, cap, acc, co,
                      k3=_noisy_k3(rng, np.full(n, 5e-4 * rng.uniform(0.5, 2))), batch=int(rng.integers(64, 129)))


def class_r(rng, name) -> Trace:
    """Healthy: a small-batch run whose length is very noisy at its baseline (no trend), whose entropy is
    noisy too, whose score rises slowly, and whose KL loss to the reference grows steadily from the
    start (as in any run with a KL term), with single steps well above its trend."""
    plateau, cv, n = rng.uniform(80, 300), rng.uniform(0.15, 0.25), int(rng.integers(60, 151))
    t = np.arange(1, n + 1)
    level = np.full(n, plateau)
    cap = plateau * rng.uniform(4, 8)
    a0 = rng.uniform(0.5, 0.65)
    acc = a0 + rng.uniform(0.05, 0.1) * np.minimum(t / 30, 3)
    grow, over = rng.uniform(4, 8), int(rng.integers(25, 41))
    kl = _interp_log(t, [(1, 1.0), (over, grow), (max(n, over + 1), grow * rng.uniform(1.3, 2.0))])
    jumps = np.where(rng.random(n) < 0.08, rng.uniform(1.4, 1.8, n), 1.0)
    co = _cosignals(rng, t, kl=kl * jumps)
    co[ENTROPY] = _lognoise(rng, np.full(n, rng.uniform(0.35, 0.55)), rng.uniform(0.15, 0.25))
    return _new_trace(rng, name, "R", "no_fire", f"R: {plateau:.0f} tokens, noise {cv:.0%}, KL loss x{grow:.1f} over "
                      f"{over} steps, accuracy {a0:.2f} rising", level, cv, cap, acc, co,
                      batch=int(rng.integers(64, 129)))


def _two_step_excursion(rng, name, cls, expect) -> Trace:
    """A slow drift, then a two-step excursion (S: healthy) or its start followed by a surge (T)."""
    plateau, cv = rng.uniform(200, 600), rng.uniform(0.04, 0.07)
    d0, drift = int(rng.integers(15, 41)), rng.uniform(1.2, 1.4)
    at = d0 + int(rng.integers(20, 26)) + int(rng.integers(0, 6))  # the first excursion step
    up1, up2 = rng.uniform(1.2, 1.3), rng.uniform(1.08, 1.15)
    n = at + int(rng.integers(40, 101))
    t = np.arange(1, n + 1)
    level = plateau * _interp_log(t, [(d0, 1.0), (at - 3, drift)])
    pre = level[at - 2]  # the pre-excursion step's level
    acc0, noise_batch = rng.uniform(0.7, 0.8), int(rng.integers(32, 97))
    acc = np.interp(t, [1, 20, n], [acc0 - 0.1, acc0, acc0 + rng.uniform(0, 0.03)])
    dip = rng.uniform(0.15, 0.25)
    if cls == "S":
        level[at - 1], level[at], level[at + 1] = pre * up1, pre * up2, pre * rng.uniform(0.9, 0.98)
        acc = acc.copy()
        acc[at - 1] -= dip
        acc[at] -= dip / 2
        doc = f"S: drift x{drift:.2f}, two-step excursion +{up1 - 1:.0%}, +{up2 - 1:.0%} at {at}, score dip {dip:.2f}"
        onset = None
    else:
        top, fall = rng.uniform(1.8, 2.2), int(rng.integers(4, 8))
        rise = pre * _interp_log(t, [(at - 1, 1.0), (at, up1), (at + 1, max(up1, up2) * 1.02), (at + 6, top)])
        level = np.where(t >= at, rise, level)
        dip = min(dip, acc0 - 0.55)  # the crash (accuracy below 0.5) comes as the length keeps rising
        acc = np.where(t >= at, np.interp(t, [at - 1, at, at + 1, at + fall, n], [acc0, acc0 - dip, acc0 - dip * 1.1,
                                                                                 0.45, 0.1]), acc)
        doc = f"T: drift x{drift:.2f}, +{up1 - 1:.0%} at {at} then on to x{top:.2f} by {at + 6}, accuracy < 0.5 by +{fall}"
        onset = at
    cap = plateau * drift * rng.uniform(3, 4)
    co = _cosignals(rng, t)
    tr = _new_trace(rng, name, cls, expect, doc, level, cv, cap, acc, co, batch=noise_batch, onset=onset)
    # the excursion's first step is its size over the (noisy) step before; S's next two steps too
    last = at + 2 if cls == "S" else at
    tr.length[at - 1:last] = np.round(level[at - 1:last] * tr.length[at - 2] / pre, 1)
    return tr


def class_s(rng, name) -> Trace:
    """Healthy: a slow drift, then a two-step excursion whose first step's batch accuracy dips 2-3 noise units."""
    return _two_step_excursion(rng, name, "S", "no_fire")


def class_t(rng, name) -> Trace:
    """S's surge twin: the same start, then the length keeps rising 5 more steps and the accuracy keeps falling."""
    return _two_step_excursion(rng, name, "T", "fire")


SCORE_FORMS = ("dense", "every", "filled", "none")


def sparse_score(score: np.ndarray, form: str = "dense", every: int = 10) -> np.ndarray:
    """A score column as real logs carry it.

    Args:
        score: the dense column (one value per step).
        form: ``dense`` (as is), ``every`` (rows 1, 1 + every, ... only, NaN elsewhere: a validation
            accuracy in a wandb export), ``filled`` (the same, forward-filled to every row) or
            ``none`` (all NaN: a log without a score).
        every: the logging period of ``every`` and ``filled``.
    """
    if form not in SCORE_FORMS:
        raise ValueError(f"form {form!r}: allowed values are {list(SCORE_FORMS)}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    out = np.asarray(score, dtype=float).copy()
    if form == "dense":
        return out
    if form == "none":
        return np.full_like(out, np.nan)
    logged = np.arange(len(out)) % every == 0
    if form == "every":
        return np.where(logged, out, np.nan)
    return out[np.maximum.accumulate(np.where(logged, np.arange(len(out)), 0))]


def traces(seeds=SEEDS, classes=CLASSES) -> list[Trace]:
    """Every class for every seed (deterministic: the generator is seeded by class, seed and variant)."""
    out = []
    for cls in classes:
        for seed in seeds:
            variants = ("short", "kl_drift") if cls == "F" else ("",)
            for v in variants:
                name = f"{cls}{'_' + v if v else ''}_s{seed}"
                rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
                make = {"A": class_a, "B": class_b, "C": class_c, "D": class_d, "E": class_e, "G": class_g,
                        "H": class_h, "I": class_i, "J": class_j, "K": class_k, "L": class_l, "M": class_m,
                        "N": class_n, "O": class_o, "P": class_p, "Q": class_q, "R": class_r,
                        "S": class_s, "T": class_t}
                out.append(class_f(rng, name, v) if cls == "F" else make[cls](rng, name))
    return out


def write(trace: Trace, out: Path) -> Path:
    path = out / f"{trace.name}.csv"
    meta = {"class": trace.cls, "expect": trace.expect, "onset": trace.onset, "crash": trace.crash,
            "rise_end": trace.rise_end, "excursion": "-".join(map(str, trace.excursion)) if trace.excursion else None}
    lines = [f"# synthetic run generated by scripts/research/phenomena.py: {trace.doc}"]
    lines += [f"# {k}: {'' if v is None else v}" for k, v in meta.items()]
    cols = trace.columns()
    lines.append("step," + ",".join(cols))
    for i, s in enumerate(trace.steps):
        lines.append(f"{s}," + ",".join(f"{cols[c][i]:.6g}" for c in cols))
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seeds", type=int, default=1, help="seeds per class written (default 1: seed 0)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = traces(seeds=range(args.seeds))
    for tr in runs:
        write(tr, args.out)
    print(f"wrote {len(runs)} runs to {args.out}")


if __name__ == "__main__":
    main()
