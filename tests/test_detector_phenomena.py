"""The synthetic phenomena as unit tests: each healthy class (scripts/research/phenomena.py: C D E F H L M N P Q R S,
one named phenomenon each) stays quiet in every log form a real log has (dense; the score every 4th or 10th row,
forward-filled or absent; verl's co-signals every 4th row or forward-filled; every column every 5 or 10 steps).
The surge classes are no target here: where a synthetic surge and a real run disagree, the real run decides
(tests/test_detector_real_runs.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "research"))
import bench_detector  # noqa: E402
import phenomena  # noqa: E402

logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
HEALTHY = "CDEFHLMNPQRS"
SEEDS = range(8)


def test_the_healthy_classes_are_every_no_fire_class():
    expect = {tr.cls: tr.expect for tr in phenomena.traces(seeds=range(1))}
    assert {c for c, e in expect.items() if e == "no_fire"} == set(HEALTHY)


@pytest.mark.parametrize("cls", HEALTHY)
def test_a_healthy_phenomenon_never_fires_in_any_log_form(cls):
    fired = [(run["name"], form, bench_detector._cusum(run))
             for form, kwargs in bench_detector.FORMS.items()
             for run in bench_detector.phenomena_runs(seeds=SEEDS, classes=cls, **kwargs)]
    assert [f for f in fired if f[2] is not None] == []
    assert len(fired) >= len(SEEDS) * len(bench_detector.FORMS)
