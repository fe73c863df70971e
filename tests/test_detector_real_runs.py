"""The default rule on 48 public training logs (scripts/research/traces/real): the bench every change to the rule
is measured on first. Its headline numbers are the promise docs/detector.md makes, so a change that loses a
real surge, fires on a healthy run or falls behind the rolling z-score fails here."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "research"))
import bench_real  # noqa: E402


@pytest.fixture(scope="module")
def outcomes():
    return bench_real.bench()


def test_the_runs_are_carried_with_their_sources_and_expectations():
    expect = bench_real.expectations()
    assert len(expect) == 48
    assert len({bench_real.source(name) for name in expect}) == 8
    for name in expect:
        head = [line for line in (bench_real.RUNS / f"{name}.csv").read_text().splitlines() if line.startswith("#")]
        assert any(line.startswith("# source:") for line in head), name
    kinds = [("-" in e) + 2 * (e == "none") for e in expect.values()]
    assert (kinds.count(1), kinds.count(2), kinds.count(0)) == (6, 34, 8)  # judged, healthy, reported only


def test_every_judged_real_surge_fires_inside_its_window(outcomes):
    judged = [o for o in outcomes if o.window]
    assert [(o.name, o.verdict) for o in judged if o.verdict != "in window"] == []
    assert len(judged) == 6


def test_no_healthy_real_run_fires(outcomes):
    assert [(o.name, o.step, o.way) for o in outcomes if o.expect == "none" and o.step is not None] == []


def test_the_rule_fires_no_later_than_the_rolling_z_score_in_the_median_judged_surge(outcomes):
    lags = [o.lag for o in outcomes if o.window and o.lag is not None]
    assert len(lags) == 6  # the z-score fires on every judged surge
    assert bench_real.summarize(outcomes).median_lag <= 0, lags


def test_the_table_prints_every_run_with_its_decision_and_the_summary(outcomes, capsys):
    assert bench_real.main([]) == 0
    out = capsys.readouterr().out
    for o in outcomes:
        row = next(line for line in out.splitlines() if line.startswith(o.name + " "))
        assert row.split()[1] == o.expect and row.split()[2] == ("-" if o.step is None else str(o.step)), row
    assert bench_real.summarize(outcomes).line() in out
    assert "judged surges in window: 6/6; healthy runs firing: 0/34" in out


def test_the_z_score_reference_fires_where_the_rule_describes():
    # 20 steps at 100 +- 1, then 110: 10 sd above the previous mean (z > 4); 102 is 2 sd (no)
    steps = list(range(1, 23))
    flat = [100.0 + (1 if s % 2 else -1) for s in steps[:20]]
    assert bench_real.z_score_step(steps, flat + [102.0, 110.0]) == 22
    assert bench_real.z_score_step(steps[:21], flat + [102.0]) is None
    # fewer than 10 earlier rows: no reference yet
    assert bench_real.z_score_step(list(range(1, 11)), [100.0] * 9 + [1000.0]) is None


def test_replay_reads_a_real_run_as_the_bench_does(tmp_path, capsys):
    # the bench's rename is the README's column map: the CSV written back with verl's names, read by
    # `lrstab replay`, decides at the step the bench prints
    from verl_lrstab.cli import main as lrstab

    name = "dumbkin_mixedcuts_qwen3_surge_collapse"
    path = tmp_path / "run.csv"
    bench_real.verl_frame(bench_real.RUNS / f"{name}.csv").reset_index().to_csv(path, index=False)
    bench_step = bench_real.run_one(name, "48-55", bench_real.LengthSurgeConfig()).step
    assert bench_step is not None
    capsys.readouterr()
    assert lrstab(["replay", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["surge_step"] == bench_step


def test_the_manual_shows_the_real_run_table_the_bench_prints_first(outcomes):
    doc = (ROOT / "docs" / "detector.md").read_text(encoding="utf-8")
    table = bench_real.table(outcomes, markdown=True)
    assert table in doc
    assert doc.index(table) < doc.index("## The rule on one page")  # the first table of the manual
    assert bench_real.summarize(outcomes).line() in doc


def test_the_manual_is_no_history():
    doc = (ROOT / "docs" / "detector.md").read_text(encoding="utf-8")
    assert "Tried:" not in doc
    assert re.findall(r"\b[0-9a-f]{7,40}\b", doc) == []  # no commit id
    assert "../shared" not in doc  # every file it cites is in the repository
