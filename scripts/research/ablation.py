#!/usr/bin/env python
"""Ablation of the default ``cusum`` rule: what each way to fire, each hold and each number saves.

Every variant removes one piece of the rule (a way to fire or a hold: the method returns "never"),
or sets one number to its neutral value, and is replayed on every class in every log form of
``bench_detector.FORMS``, on the 34 length-only traces and on the real traces; the table lists the
bench cells that change against the unchanged rule (``base -> variant``). Screening runs few
seeds; the final comparison runs the bench's 40 (``--seeds 40``) and the out-of-sample ones
(``--seed-start 40``)::

    python scripts/research/ablation.py --seeds 8 --workers 2
    python scripts/research/ablation.py --only none --seeds 40 --json old.json   # one variant's cells

``--compare A.json B.json`` prints the cells that differ between two saved runs (e.g. two commits).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "research"))

import bench_detector as bench  # noqa: E402
import phenomena  # noqa: E402

from verl_lrstab import cusum  # noqa: E402

_D = cusum.CusumDetector


def _never(*_args, **_kwargs):
    return False


def _attr(name, value):
    """Set the detector's option ``name`` (its attribute of that name) to ``value`` after its checks (a neutral
    value may be out of its bounds)."""
    init = _D.__init__
    assert hasattr(_D(), name), f"the detector has no option {name}"

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setattr(self, name, value)
    return lambda stack: stack.enter_context(mock.patch.object(_D, "__init__", patched))


def _const(name, value):
    return lambda stack: stack.enter_context(mock.patch.object(cusum, name, value))


def _method(name, replacement=_never):
    """The ways and holds are methods of the rule (``_way_<name>``, ``_hold_<name>``): None where the rule under
    test has no such method (it is then not ablated on it)."""
    if not hasattr(_D, name):
        return None
    return lambda stack: stack.enter_context(mock.patch.object(_D, name, replacement))


#: variant -> (kind, what it removes or sets, patch(stack))
VARIANTS: dict = {
    "none": ("-", "the default rule", lambda stack: None),
    # the ways to fire
    "score": ("way to fire", "the score falls", _method("_way_score")),
    "witnesses": ("way to fire", "two witnesses risen", _method("_way_witnesses")),
    "length": ("way to fire", "no witness logged: the length alone", _method("_way_length")),
    "runaway": ("way to fire", "the level at cusum_runaway_rise", _method("_way_runaway")),
    "return": ("way to fire", "verl's co-signals rise with a return to an earlier high", _method("_way_return")),
    # the holds
    # warmup (no baseline yet) is not removed alone: without a baseline there is nothing to measure; its number,
    # skip_first_steps, is set below
    "rebound": ("hold", "a level the run had before", _method("_hold_rebound")),
    "expiry": ("hold", "an alarm whose level fell back or that waited cusum_confirm_steps", _method("_hold_expiry")),
}
for name, value, what in (
        ("skip_first_steps", 0, "0"), ("cusum_span", 10, "10 (half)"), ("cusum_lag", 0, "0"),
        ("cusum_drift", 0.0, "0"), ("cusum_threshold", 2.5, "2.5 (half)"), ("cusum_min_rise", 1.0, "1"),
        ("cusum_noise_floor", 1e-9, "0"), ("cusum_rebound_margin", 1.0, "1"), ("cusum_rebound_memory", 50, "50 (half)"),
        ("cusum_confirm_steps", 10 ** 9, "inf"), ("cusum_score_z", 3.0, "3.0"), ("cusum_kl_rise", 1.0, "1"),
        ("cusum_clip_rise", 0.0, "0"), ("cusum_runaway_rise", 2.0, "2.0"), ("cusum_spike_rise", 1e9, "inf"),
        ("max_surges", 2, "2")):
    VARIANTS[f"{name}={what}"] = ("number", f"option {name}", _attr(name, value))
for name, value, what in (
        ("LEVEL_STEPS", 3, "3"), ("MIN_ROWS", 4, "4"), ("MAD_SD", 1.0, "1"), ("MEDIAN_SD", 1.0, "1"),
        ("OLD_STEPS", 0, "0 (no older reference)"), ("WITNESS_RISE", 1.0, "1"), ("WITNESSES", 1, "1"),
        ("FEW_ROWS", 1, "1"), ("NOISE_ROWS", 8, "8"), ("SCORE_FLOOR", 0.0, "0"),
        ("FAST_ROWS", 1, "1"), ("OLDER_KL_POWER", 1, "1"), ("HALF", 1.0, "1 (full evidence everywhere)")):
    if hasattr(cusum, name):
        VARIANTS[f"{name}={what}"] = ("number", f"constant {name}", _const(name, value))

VARIANTS = {name: v for name, v in VARIANTS.items() if v[2] is not None}


def _forms_runs(seeds):
    return {key: bench.phenomena_runs(seeds, **kw) for key, kw in bench.FORMS.items()}


_RUNS: dict = {}


def _init(seeds, real):
    _RUNS["forms"] = _forms_runs(seeds)
    _RUNS["other"] = bench.synthetic_runs() + bench.real_runs(real)


def cells(forms: dict, other: list) -> dict:
    """The bench cells the ablation compares: per form and class, detections, median lead, false alarms;
    T's steps after the length alone; the 34 traces' and the real traces' outcomes."""
    out = {}
    for key, runs in forms.items():
        for c in phenomena.CLASSES:
            sel = [r for r in runs if r["cls"] == c]
            if not sel:
                continue
            if c in bench.HEALTHY:
                out[f"{c} false alarms | {key}"] = sum(r["fired"]["cusum"] is not None for r in sel)
                continue
            ok = [r for r in sel if bench.outcome(r, r["fired"]["cusum"]) == "hit"]
            out[f"{c} detected | {key}"] = len(ok)
            leads = [bench._lead(r, "cusum") for r in ok if r.get("crash")]
            if leads:
                out[f"{c} median lead | {key}"] = statistics.median(leads)
        out[f"T after length alone | {key}"] = bench._after_length_alone(runs)
    must = [r for r in other if r["expect"] == "fire" and not r["cls"].startswith("real")]
    calm = [r for r in other if r["expect"] == "no_fire"]
    out["34 traces: detected"] = sum(bench.outcome(r, r["fired"]["cusum"]) == "hit" for r in must)
    out["34 traces: false alarms"] = sum(r["fired"]["cusum"] is not None for r in calm)
    out["34 traces: early"] = sum(bench.outcome(r, r["fired"]["cusum"]) == "early" for r in must)
    for r in other:
        if r["cls"].startswith("real"):
            out[f"real {r['name']}"] = r["fired"]["cusum"]
    return out


def run_variant(name: str) -> tuple[str, dict]:
    kind, doc, patch = VARIANTS[name]
    saved = dict(bench.OPTIONS)
    try:
        with ExitStack() as stack:
            patch(stack)
            for runs in _RUNS["forms"].values():
                for r in runs:
                    r["fired"] = {"cusum": bench._cusum(r)}
                    if r["cls"] == "T":
                        r["fired"]["cusum, length only"] = bench._cusum(r, ())
            for r in _RUNS["other"]:
                r["fired"] = {"cusum": bench._cusum(r)}
    except Exception as exc:  # a neutral value the rule cannot run with: say so in the table
        return name, {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        bench.OPTIONS.clear()
        bench.OPTIONS.update(saved)
    return name, cells(_RUNS["forms"], _RUNS["other"])


def changes(base: dict, other: dict) -> list[str]:
    return [f"{k}: {base.get(k)} -> {other.get(k)}" for k in {**base, **other} if base.get(k) != other.get(k)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="variants to run (default: all)")
    parser.add_argument("--real", type=Path, default=ROOT / "scripts" / "research" / "traces" / "sparse")
    parser.add_argument("--json", type=Path, help="write {variant: cells} here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        for name in a.keys() & b.keys():
            print(f"{name}: {len(changes(a[name], b[name]))} cells differ")
            for line in sorted(changes(a[name], b[name])):
                print("   ", line)
        return
    names = args.only or list(VARIANTS)
    seeds = range(args.seed_start, args.seed_start + args.seeds)
    bench.logging.getLogger("verl_lrstab").setLevel(bench.logging.ERROR)
    with multiprocessing.get_context("fork").Pool(args.workers, _init, (seeds, args.real)) as pool:
        results = dict(pool.imap_unordered(run_variant, names))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    base = results.get("none")
    print(f"| removed / set neutral | kind | cells changed ({args.seeds} seeds from {args.seed_start}) |")
    print("|---|---|---|")
    for name in names:
        if name == "none" or base is None:
            continue
        diff = changes(base, results[name])
        print(f"| {name}: {VARIANTS[name][1]} | {VARIANTS[name][0]} | {'; '.join(sorted(diff)) or 'none'} |")


if __name__ == "__main__":
    main()
