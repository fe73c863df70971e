"""The default rule's invariants (pure Python): no way fires with the length at its baseline, the two
healthy phenomena stay quiet, the surge twin is caught with the length alone, the way that fired is
named, and torch's ``step(...)`` and verl's ``observe_update`` decide alike from the same figures."""

from __future__ import annotations

import ast
import logging
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab import cusum
from verl_lrstab.cusum import HOLDS, WAYS, CusumDetector
from verl_lrstab.detectors import UpdateFigures
from verl_lrstab.log_replay import replay
from verl_lrstab.scheduler import LengthSurgeLR

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "research"))
import phenomena  # noqa: E402

logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
NAMES = {phenomena.ENTROPY: "entropy", phenomena.GRAD_NORM: "grad_norm", phenomena.KL_LOSS: "kl_loss",
         phenomena.PG_CLIPFRAC: "pg_clipfrac"}


def feed(tr, det=None):
    det = det or CusumDetector(LengthSurgeConfig())
    for i, s in enumerate(tr.steps):
        k3 = tr.k3[i]
        if det.update(s, tr.length[i], score=tr.score[i], kl=None if math.isnan(k3) else k3, clip_ratio=tr.clip[i]):
            return s, det
        det.add_cosignals(s, **{NAMES[k]: v[i] for k, v in tr.cosignals.items()})
    return None, det


def _literals(source: str) -> list:
    """The numeric literals other than 0, 1 and -1 of ``source`` (the module holding the decision)."""
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Constant) and type(n.value) in (int, float) and n.value not in (0, 1, -1)]


def _options_read(source: str) -> set:
    """The config options the detector's constructor reads (``c.<option>``): its parameters, one per option."""
    init = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {n.attr for n in ast.walk(init)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "c"}


def test_the_rule_is_small():
    # at most 30 numbers shape a decision (the literals and the options read), at most 5 ways to fire and 5 holds,
    # each a method the ablation removes
    source = Path(cusum.__file__).read_text()
    literals, options = _literals(source), _options_read(source)
    assert options == {"skip_first_steps", "max_surges"} | {f for f in LengthSurgeConfig.__dataclass_fields__
                                                             if f.startswith("cusum_")}
    assert len(literals) + len(options) <= 30, (literals, sorted(options))
    assert len(WAYS) <= 5 and len(HOLDS) <= 5
    for name in WAYS:
        assert callable(getattr(CusumDetector, f"_way_{name}"))
    for name in HOLDS:
        assert callable(getattr(CusumDetector, f"_hold_{name}"))


def test_the_number_count_counts_each_literal_and_option_and_not_0_1():
    source = Path(cusum.__file__).read_text()
    base, options = len(_literals(source)), _options_read(source)
    assert len(_literals(source + "\nEXTRA = 2.5\nOTHER = 1\nNEG = -1\n")) == base + 1
    more = source.replace("self.rows = _Rows()", "self.extra = c.cusum_extra\n        self.rows = _Rows()", 1)
    assert _options_read(more) == options | {"cusum_extra"}


def test_the_rules_constants_are_read_when_called_so_the_ablation_can_set_them():
    # scripts/research/ablation.py sets a module constant (mock.patch.object(cusum, NAME, value)); a constant
    # bound as a default argument would keep its value and the ablation would measure nothing
    tree = ast.parse(Path(cusum.__file__).read_text())
    constants = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name) and t.id.isupper()}
    assert {"MIN_ROWS", "FEW_ROWS", "LEVEL_STEPS", "NOISE_ROWS", "HALF"} <= constants
    bound = [(f.name, d.id) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
             for d in f.args.defaults + f.args.kw_defaults if isinstance(d, ast.Name) and d.id in constants]
    assert bound == []
    rows = [[s, float(s)] for s in range(0, 100, 10)]  # a log written every 10 steps
    assert len(cusum._window(rows, 60, 90)) == cusum.MIN_ROWS
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cusum, "MIN_ROWS", 4)
        assert len(cusum._window(rows, 60, 90)) == 4


def test_no_way_fires_on_a_noisy_length_at_its_baseline_with_a_growing_kl_loss():
    # a small-batch run: the length 15-25 % noisy around its baseline, the entropy as noisy, the KL loss to the
    # reference growing 4-8x from the start: nothing in it is a surge
    for tr in phenomena.traces(seeds=range(8), classes="R"):
        assert feed(tr)[0] is None, tr.name


@pytest.mark.parametrize("seed", range(6))
def test_no_way_fires_with_the_length_at_its_baseline_whatever_every_witness_does(seed):
    # a hand-made run: the length at a flat baseline (5 % step noise) for 160 steps; from step 60 on every witness
    # says "surge" (the score falls 0.7 -> 0.3, k3 triples, the clip share rises 0.3, entropy 1.5x, grad norm 3x)
    # and the length stays where it was: nothing fires, the length is what the LR decay answers
    rng = random.Random(seed)
    det = CusumDetector(LengthSurgeConfig())
    for s in range(1, 161):
        late = min(max(s - 60, 0) / 20, 1.0)  # 0 before step 60, 1 from step 80
        assert not det.update(s, 500.0 * math.exp(rng.gauss(0, 0.05)), score=0.7 - 0.4 * late + rng.gauss(0, 0.02),
                              kl=1e-3 * (1 + 2 * late) * math.exp(rng.gauss(0, 0.15)), clip_ratio=0.02 + 0.3 * late), s
        det.add_cosignals(s, entropy=0.4 * (1 + 0.5 * late) * math.exp(rng.gauss(0, 0.05)),
                    grad_norm=(1 + 2 * late) * math.exp(rng.gauss(0, 0.2)))


def test_no_way_fires_on_a_very_noisy_length_at_its_baseline_with_the_kl_loss_growing_by_hand():
    # the phenomenon as described, built by hand: a small-batch GRPO run logged every step, its mean length very
    # noisy (25 % a step around 95 tokens, no trend), the score rising slowly (0.58 -> 0.65 over 30 steps), the
    # entropy noisy (20 % a step), the KL loss to the reference growing from 8e-4 to 5e-3 over 30 steps with single
    # steps 1.6x above its trend. A CUSUM of that noise reaches half its threshold now and then; the KL loss's
    # ordinary growth and a high entropy must not confirm it (60 runs)
    for seed in range(60):
        rng = random.Random(seed)
        det = CusumDetector(LengthSurgeConfig())
        for s in range(1, 81):
            score = 0.58 + 0.07 * min(s / 30, 2) + rng.gauss(0, 0.05)
            assert not det.update(s, 95.0 * math.exp(rng.gauss(0, 0.25)), score=score), (seed, s, det.fired_by)
            kl_loss = 8e-4 * 6.25 ** min(s / 30, 1.5) * (1.6 if rng.random() < 0.08 else 1.0)
            det.add_cosignals(s, entropy=0.45 * math.exp(rng.gauss(0, 0.2)), kl_loss=kl_loss)


def test_a_two_step_excursion_over_a_slow_drift_is_no_surge_and_its_surge_twin_is():
    for tr in phenomena.traces(seeds=range(6), classes="S"):
        assert feed(tr)[0] is None, tr.name
    for tr in phenomena.traces(seeds=range(6), classes="T"):
        fired, _ = feed(tr)
        alone = replay(tr.steps, tr.length).surge_step  # the length alone (no witness logged)
        assert fired is not None and fired >= tr.onset, tr.name
        if alone is not None and alone >= tr.onset:
            assert fired - alone <= 2, (tr.name, fired, alone)  # within 2 steps of the length alone


@pytest.mark.parametrize("form", ["dense", "every", "filled", "none"])
def test_a_two_step_excursion_over_a_slow_drift_never_fires_whatever_the_score_form(form):
    # the score dense, on every 10th row only, forward-filled from it, or absent: the excursion's first step's
    # score dip (2-3 noise units) and its length are no surge (20 seeds)
    for tr in phenomena.traces(seeds=range(20), classes="S"):
        tr.score = phenomena.sparse_score(tr.score, form, 10)
        assert feed(tr)[0] is None, (tr.name, form)


@pytest.mark.xfail(strict=True, reason="a limit of the default rule, measured in docs/detector.md: T dense is caught "
                                       "3-5 steps after the length alone in 4 of 40 seeds (the score's 5-step level "
                                       "needs those steps to fall 3.5 noise units)")
def test_the_surge_twin_is_caught_within_2_steps_of_the_length_alone_in_every_seed():
    gaps = {}
    for tr in phenomena.traces(seeds=range(40), classes="T"):
        fired, _ = feed(tr)
        alone = replay(tr.steps, tr.length).surge_step
        if alone is not None and alone >= tr.onset:
            gaps[tr.name] = None if fired is None else fired - alone
    assert gaps and all(g is not None and g <= 2 for g in gaps.values()), gaps


def test_every_firing_has_the_length_above_its_baseline_and_is_named():
    # whatever fired, on every surge class: the newest step at min_rise x the baseline and the level above it
    for tr in phenomena.traces(seeds=range(3), classes="ABIJKOT"):
        fired, det = feed(tr)
        if fired is None:
            continue
        assert det.fired_by and det.fired_by[0] in WAYS, tr.name
        assert det.metrics()[f"fired_by/{det.fired_by[0]}"] == fired
        newest = tr.length[tr.steps.index(fired)]
        assert newest >= det.cusum_min_rise * det.baseline * (1 - 1e-9) or det.fired_by[0] == "return", tr.name


def test_a_rising_length_with_nothing_else_logged_fires_by_the_length_alone():
    rng = random.Random(3)
    lengths = [1000.0 * (1.6 if s >= 60 else 1.0) * (1 + rng.gauss(0, 0.03)) for s in range(1, 121)]
    det = CusumDetector()
    fired = [s for s, v in enumerate(lengths, 1) if det.update(s, v)]
    assert fired and det.fired_by == ["length"]


def _torch_sched():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, LengthSurgeLR(opt, {"skip_first_steps": 10})


@pytest.mark.parametrize("cls", ["A", "I", "J"])
def test_torch_step_and_verl_observe_update_decide_alike(cls):
    # one way in: step(length, kl, score=..., clip_ratio=..., entropy=..., ...) against verl's glue path
    # (observe_update before a bare step(), the update's own figures after it)
    (tr,) = phenomena.traces(seeds=[0], classes=cls)
    opt_a, a = _torch_sched()
    opt_b, b = _torch_sched()
    for i, _ in enumerate(tr.steps):
        k3 = None if math.isnan(tr.k3[i]) else float(tr.k3[i])
        co = {NAMES[k]: float(v[i]) for k, v in tr.cosignals.items()}
        opt_a.step()
        a.step(float(tr.length[i]), k3, score=float(tr.score[i]), clip_ratio=float(tr.clip[i]), **co)
        b.observe_update(UpdateFigures(response_length=float(tr.length[i]), mismatch_kl=k3,
                                       score=float(tr.score[i]), clip_ratio=float(tr.clip[i])))
        opt_b.step()
        b.step()
        b.observe_update(UpdateFigures(cosignals=co))
        assert a.get_last_lr() == b.get_last_lr()
    assert a.schedule.surge_step == b.schedule.surge_step is not None
    assert a.schedule.detector.state_dict() == b.schedule.detector.state_dict()
