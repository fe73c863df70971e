"""The default rule's invariants (pure Python): no way fires with the length at its baseline, the two
healthy phenomena stay quiet, the surge twin is caught with the length alone, the way that fired is
named, and torch's ``step(...)`` and verl's ``observe_update`` decide alike from the same figures."""

from __future__ import annotations

import logging
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.cusum import WAYS, CusumDetector
from verl_lrstab.schedule import UpdateFigures, replay
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
        det.observe(s, **{NAMES[k]: v[i] for k, v in tr.cosignals.items()})
    return None, det


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
