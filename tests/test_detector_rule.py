"""The default rule's invariants (pure Python): no way fires with the length at its baseline, the two
healthy phenomena stay quiet, the surge twin is caught with the length alone, the way that fired is
named, and torch's ``step(...)`` and verl's ``observe_update`` decide alike from the same figures."""

from __future__ import annotations

import ast
import inspect
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
from verl_lrstab.schedule import UpdateFigures, replay
from verl_lrstab.scheduler import LengthSurgeLR

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "research"))
import phenomena  # noqa: E402

logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
NAMES = {phenomena.ENTROPY: "entropy", phenomena.GRAD_NORM: "grad_norm", phenomena.KL_LOSS: "kl_loss",
         phenomena.PG_CLIPFRAC: "pg_clipfrac"}


def feed(tr, det=None):
    det = det or CusumDetector(**LengthSurgeConfig().detector_kwargs())
    for i, s in enumerate(tr.steps):
        k3 = tr.k3[i]
        if det.update(s, tr.length[i], score=tr.score[i], kl=None if math.isnan(k3) else k3, clip_ratio=tr.clip[i]):
            return s, det
        det.observe(s, **{NAMES[k]: v[i] for k, v in tr.cosignals.items()})
    return None, det


def _literals(source: str) -> list:
    """The numeric literals other than 0, 1 and -1 of ``source`` (the module holding the decision), the
    constructor's defaults left out (they are its parameters, counted as such)."""
    tree = ast.parse(source)
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    defaults = {id(d) for d in init.args.defaults + init.args.kw_defaults if d is not None}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and type(n.value) in (int, float) and n.value not in (0, 1, -1)
            and id(n) not in defaults]


def test_the_rule_is_small():
    # at most 30 numbers shape a decision, at most 5 ways to fire and 5 holds, each a method the ablation removes
    literals = _literals(Path(cusum.__file__).read_text())
    params = list(inspect.signature(CusumDetector).parameters)
    assert len(literals) + len(params) <= 30, (literals, params)
    assert len(WAYS) <= 5 and len(HOLDS) <= 5
    for name in WAYS:
        assert callable(getattr(CusumDetector, f"_way_{name}"))
    for name in HOLDS:
        assert callable(getattr(CusumDetector, f"_hold_{name}"))


def test_the_number_count_counts_each_literal_and_not_0_1_or_the_defaults():
    source = Path(cusum.__file__).read_text()
    base = len(_literals(source))
    assert len(_literals(source + "\nEXTRA = 2.5\nOTHER = 1\nNEG = -1\n")) == base + 1
    assert len(_literals(source.replace("def __init__(self, ", "def __init__(self, extra: float = 7.5, ", 1))) == base


def test_no_way_fires_on_a_noisy_length_at_its_baseline_with_a_growing_kl_loss():
    # a small-batch run: the length 15-25 % noisy around its baseline, the entropy as noisy, the KL loss to the
    # reference growing 4-8x from the start: nothing in it is a surge
    for tr in phenomena.traces(seeds=range(8), classes="R"):
        assert feed(tr)[0] is None, tr.name


def test_a_two_step_excursion_over_a_slow_drift_is_no_surge_and_its_surge_twin_is():
    for tr in phenomena.traces(seeds=range(6), classes="S"):
        assert feed(tr)[0] is None, tr.name
    for tr in phenomena.traces(seeds=range(6), classes="T"):
        fired, _ = feed(tr)
        alone = replay(tr.steps, tr.length).surge_step  # the length alone (no witness logged)
        assert fired is not None and fired >= tr.onset, tr.name
        if alone is not None and alone >= tr.onset:
            assert fired - alone <= 2, (tr.name, fired, alone)  # within 2 steps of the length alone


def test_every_firing_has_the_length_above_its_baseline_and_is_named():
    # whatever fired, on every surge class: the newest step at min_rise x the baseline and the level above it
    for tr in phenomena.traces(seeds=range(3), classes="ABIJKOT"):
        fired, det = feed(tr)
        if fired is None:
            continue
        assert det.fired_by and det.fired_by[0] in WAYS, tr.name
        assert det.metrics()[f"fired_by/{det.fired_by[0]}"] == fired
        newest = tr.length[tr.steps.index(fired)]
        assert newest >= det.min_rise * det.baseline * (1 - 1e-9) or det.fired_by[0] == "return", tr.name


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


def test_step_refuses_an_unknown_figure_by_name():
    opt, sched = _torch_sched()
    opt.step()
    with pytest.raises(ValueError, match="unknown co-signal 'entropi'"):
        sched.step(500.0, entropi=0.3)
