"""Stage 0's go / no-go (scripts/research/repro/real_stage0.py), the rule written before the run started
(scripts/research/repro/real_results/PLAN_2026-12-03.md): it learns (best 10-step score after step 10 >= 2x steps 1-10),
the detector fires by step 45, after the best window started. Scores are built so each case's answer follows
from the rule by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "research"))
from repro import real_stage0  # noqa: E402


def score(values: dict[range, float], steps: int = 60) -> pd.Series:
    s = pd.Series(0.1, index=range(1, steps + 1), dtype=float)
    for r, v in values.items():
        s[list(r)] = v
    return s


def test_learning_then_a_surge_is_a_go():
    # steps 1-10 at 0.1; steps 21-30 at 0.3 (the best window starts at 21: 3x); the surge at 35
    v = real_stage0.verdict(score({range(21, 31): 0.3}), surge_step=35)
    assert v["verdict"] == "go"
    assert v["best window starts"] == 21 and v["best 10-step score after step 10"] == pytest.approx(0.3)
    assert v["score steps 1-10"] == pytest.approx(0.1)


@pytest.mark.parametrize("surge, failed", [
    (None, "not: fires by step 45"),
    (46, "not: fires by step 45"),          # 45 is the last allowed step
    (21, "not: fires after the learning"),  # at the best window's start is not after it
    (15, "not: fires after the learning"),
])
def test_the_surge_must_come_by_step_45_and_after_the_learning(surge, failed):
    v = real_stage0.verdict(score({range(21, 31): 0.3}), surge_step=surge)
    assert v["verdict"].startswith("no-go") and failed in v["verdict"] and "not: learns" not in v["verdict"]


def test_45_itself_is_in_time():
    assert real_stage0.verdict(score({range(21, 31): 0.3}), surge_step=45)["verdict"] == "go"


@pytest.mark.parametrize("best, go", [(0.2, True), (0.19, False)])  # twice steps 1-10's 0.1 is the bound
def test_learning_means_at_least_twice_the_first_ten_steps(best, go):
    v = real_stage0.verdict(score({range(21, 31): best}), surge_step=35)
    assert (v["verdict"] == "go") is go
    assert go or "not: learns" in v["verdict"]


def test_a_score_stuck_at_zero_never_learns():
    v = real_stage0.verdict(pd.Series(0.0, index=range(1, 61)), surge_step=30)
    assert "not: learns" in v["verdict"]


def test_the_first_ten_steps_are_not_a_later_window():
    # the best score sits in steps 1-10 only: no later window beats 2x it
    v = real_stage0.verdict(score({range(1, 11): 0.5}), surge_step=30)
    assert "not: learns" in v["verdict"]


def test_a_nan_step_is_skipped_not_a_zero():
    s = score({range(21, 31): 0.3})
    s[5] = float("nan")
    assert real_stage0.verdict(s, surge_step=35)["verdict"] == "go"


def test_first_surge_reads_the_first_report_of_the_detector():
    assert real_stage0.first_surge(pd.Series([-1, -1, 7, 7, 7], index=range(1, 6))) == 7
    assert real_stage0.first_surge(pd.Series([-1, -1], index=[1, 2])) is None


@pytest.mark.parametrize("info, expected", [
    ({"mode": "bypass", "sampler_temperature": 1.05}, True),
    ({"mode": "bypass", "sampler_temperature": 1.0}, False),
    ({"mode": "bypass", "sampler_temperature": 1.1}, False),
    ({"mode": "recompute", "sampler_temperature": 1.05}, False),
])
def test_a_stage0_run_is_bypass_with_a_sampler_between_1_and_1_1(info, expected):
    assert real_stage0.is_stage0(info) is expected


def test_the_control_is_the_same_run_at_the_1x_sampler(tmp_path):
    base = {"prompts": 2, "samples": 6, "max_response_length": 192, "seed": 1, "lr": 1e-5, "mode": "bypass",
            "sampler_dtype": "bf16"}
    runs = {}
    for name, extra in (("s0", {"sampler_temperature": 1.05}), ("c", {"sampler_temperature": 1.0}),
                        ("other_seed", {"sampler_temperature": 1.0, "seed": 2})):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "run.json").write_text(json.dumps({**base, **extra}))
    assert real_stage0.control_of(runs["s0"], list(runs.values())) == runs["c"]
    assert real_stage0.control_of(runs["s0"], [runs["s0"], runs["other_seed"]]) is None


def frame(entropy: dict[range, float], surge: int | None = None, k3: tuple[float, float] = (1e-3, 1e-3),
          steps: int = 60) -> pd.DataFrame:
    """A bypass run's training frame: the update's entropy at 1.0 except in ``entropy``'s ranges, the detector's
    ``surge_step`` (-1 until it fires) and k3 at ``k3[0]`` over steps 1-30, ``k3[1]`` after."""
    idx = range(1, steps + 1)
    ent = pd.Series(1.0, index=idx)
    for r, v in entropy.items():
        ent[list(r)] = v
    fired = [-1 if surge is None or s < surge else surge for s in idx]
    return pd.DataFrame({"actor/entropy_loss": ent, real_stage0.SURGE: fired,
                         real_stage0.K3: [k3[0] if s <= 30 else k3[1] for s in idx]}, index=idx)


def test_entropy_rise_is_the_highest_5_step_median_over_the_first_ten_steps():
    # 5 steps at 3.0 make the 5-step median 3.0 there: a 3x rise; a single spike moves no median of 5
    assert real_stage0.entropy_rise(frame({range(40, 45): 3.0})) == pytest.approx(3.0)
    assert real_stage0.entropy_rise(frame({range(40, 41): 9.0})) == pytest.approx(1.0)
    # nor right after step 10, where a window of fewer than 5 steps would be a median of 2 or 3
    assert real_stage0.entropy_rise(frame({range(11, 13): 9.0})) == pytest.approx(1.0)
    # an early high in steps 1-10 is the reference, not a rise
    assert real_stage0.entropy_rise(frame({range(1, 11): 2.0})) == pytest.approx(0.5)
    # the recompute form's old-log-prob entropy (actor/entropy) is read first
    df = frame({}).assign(**{"actor/entropy": 2.0})
    df.loc[df.index > 30, "actor/entropy"] = 3.0
    assert real_stage0.entropy_rise(df) == pytest.approx(1.5)


@pytest.mark.parametrize("run, control, reading", [
    # stage 0 as it was: fired at 43, entropy ~2.9x; the control quiet and flat
    (frame({range(30, 61): 2.9}, surge=43), frame({range(30, 61): 1.2}), "needs the sampler"),
    # the control fires too: the drift is not the sampler's
    (frame({range(30, 61): 2.9}, surge=43), frame({range(30, 61): 1.2}, surge=50), "does not need"),
    # the control's entropy doubles without firing: drifts alike
    (frame({range(30, 61): 2.9}, surge=43), frame({range(30, 61): 2.0}), "does not need"),
    # the control rises 1.7x: neither outcome
    (frame({range(30, 61): 2.9}, surge=43), frame({range(30, 61): 1.7}), "between"),
    # the run itself did not fire: the control cannot tell
    (frame({range(30, 61): 2.9}), frame({}), "between"),
    # a longer control that fires after step 60 only: the reading looks up to step 60
    (frame({range(30, 61): 2.9}, surge=43), frame({range(30, 101): 1.2}, surge=80, steps=100), "needs the sampler"),
])
def test_the_controls_reading_follows_the_registered_rule(run, control, reading):
    assert reading in real_stage0.control_reading(run, control)["reading"]


def test_the_reading_reports_both_runs_k3_early_and_late():
    out = real_stage0.control_reading(frame({}, k3=(4e-3, 6e-3)), frame({}, k3=(1e-3, 2e-3)))
    assert (out["k3 steps 1-10"], out["k3 last 10 steps"]) == (pytest.approx(4e-3), pytest.approx(6e-3))
    assert (out["control's k3 steps 1-10"], out["control's k3 last 10 steps"]) == (pytest.approx(1e-3),
                                                                                   pytest.approx(2e-3))


def test_two_stage0_runs_sharing_their_control_list_it_once(tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    base = {"prompts": 2, "samples": 6, "max_response_length": 192, "seed": 1, "lr": 1e-5, "mode": "bypass",
            "sampler_dtype": "bf16", "steps": 20}
    for name, t in (("t105", 1.05), ("t103", 1.03), ("ctl", 1.0)):
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps({**base, "sampler_temperature": t}))
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part1.jsonl"))
        tracker = Tracking(project_name="p", experiment_name=name, default_backend=["file"])
        for step in range(1, 21):
            tracker.log({"response_length/mean": 50.0, "critic/score/mean": 0.1, "actor/entropy_loss": 1.0,
                         "actor/mismatch/k3": 1e-3, real_stage0.SURGE: -1}, step=step)
        tracker.finish()
    text = real_stage0.report(sorted(tmp_path.iterdir()), tmp_path / "report").read_text()
    lines = text.splitlines()
    verdicts = text.split("Each control's reading")[0].splitlines()
    assert sum(line.startswith("| ctl |") for line in verdicts) == 1  # one verdict row for the shared control
    assert sum(line.startswith("| ctl |") for line in lines) == 2  # and one row in the figures table
    assert sum(line.startswith(("| t105 | ctl |", "| t103 | ctl |")) for line in lines) == 2  # a reading each
    assert (tmp_path / "report" / "stage0.png").stat().st_size > 10_000


def test_a_longer_control_is_read_on_steps_1_to_60_only():
    # the control's entropy doubles from step 70: after the registered window, so it still "stays put"
    run, control = frame({range(30, 61): 2.9}, surge=43), frame({range(70, 101): 2.5}, steps=100)
    out = real_stage0.control_reading(run, control, cause=real_stage0.BYPASS_CAUSE)
    assert out["reading"] == "the drift needs bypass's old log-probs (the control stays put)"
    assert out["control's entropy rise"] == pytest.approx(1.0)
    # the same drift inside the window is read as the control drifting alike
    early = frame({range(40, 101): 2.5}, steps=100)
    assert "does not need bypass's" in real_stage0.control_reading(run, early, real_stage0.BYPASS_CAUSE)["reading"]


def test_a_stage0_run_is_read_against_its_recompute_control_too(tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    base = {"prompts": 2, "samples": 6, "max_response_length": 192, "seed": 1, "lr": 1e-5, "sampler_dtype": "bf16"}
    runs = {"t105": ("bypass", 1.05, 60), "ctl": ("bypass", 1.0, 60), "rc105": ("recompute", 1.05, 100),
            "rc1": ("recompute", 1.0, 100), "rc103": ("recompute", 1.03, 100)}  # the last two: not its controls
    for name, (mode, t, steps) in runs.items():
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps({**base, "mode": mode, "sampler_temperature": t, "steps": steps}))
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part1.jsonl"))
        tracker = Tracking(project_name="p", experiment_name=name, default_backend=["file"])
        for step in range(1, steps + 1):
            drift = name == "t105" and step > 30
            tracker.log({"response_length/mean": 50.0, "critic/score/mean": 0.1,
                         "actor/entropy_loss" if mode == "bypass" else "actor/entropy": 3.0 if drift else 1.0,
                         "actor/mismatch/k3": 1e-3, real_stage0.SURGE: 43 if drift and step >= 43 else -1}, step=step)
        tracker.finish()
    assert real_stage0.controls_of(tmp_path / "t105", sorted(tmp_path.iterdir())) == [
        (tmp_path / "ctl", real_stage0.SAMPLER_CAUSE), (tmp_path / "rc105", real_stage0.BYPASS_CAUSE)]
    text = real_stage0.report(sorted(tmp_path.iterdir()), tmp_path / "report").read_text()
    assert "| t105 | rc105 | bypass's old log-probs |" in text
    assert "the drift needs bypass's old log-probs (the control stays put)" in text
    assert "| t105 | ctl | the sampler's mismatch |" in text
    # the controls' figures, each run over all its steps: the recompute control's 100, the run's 60
    figures = text.split("over all the steps each logged")[1]
    assert figures.count("| rc105 | 100 |") == 1 and figures.count("| t105 | 60 |") == 1
    assert "| rc1 |" not in figures and "| rc103 |" not in figures


from repro.real_pilot import ARCHIVE  # noqa: E402  (the archive the scripts read and write)
# the page that states the readings (its summary table), beside the sections that derive them
REPRODUCTIONS = Path(__file__).resolve().parents[2] / "docs" / "reproductions.md"


@pytest.mark.parametrize("control, cause, reading", [
    ("bp_const-t1-lr1e-05-p2x6c192-s1", real_stage0.SAMPLER_CAUSE, "the drift needs the sampler's mismatch"),
    ("rc_const-t1.05-lr1e-05-p2x6c192-s1", real_stage0.BYPASS_CAUSE, "the drift needs bypass's old log-probs"),
])
def test_the_documented_stage0_readings_are_the_archives(control, cause, reading):
    # the page states each registered reading in bold; recomputed here from the archived runs alone
    from repro.real_dose import training_frame

    run = training_frame(ARCHIVE / "bp_const-t1.05-lr1e-05-p2x6c192-s1")
    out = real_stage0.control_reading(run, training_frame(ARCHIVE / control), cause)
    assert out["reading"].startswith(reading)
    assert f"**{reading}**" in REPRODUCTIONS.read_text(encoding="utf-8")


def test_the_documented_recompute_control_learns_in_the_archive():
    # "learns (fp32 0.14 / 0.55 / 0.65 at 0 / 50 / 100), entropy falls, no alarm"
    from repro.real_controls import fp32_validation
    from repro.real_dose import training_frame

    d = ARCHIVE / "rc_const-t1.05-lr1e-05-p2x6c192-s1"
    val, df = fp32_validation(d), training_frame(d)
    assert [round(val[k], 2) for k in (0, 50, 100)] == [0.14, 0.55, 0.65]
    assert "fp32 0.14 / 0.55 / 0.65 at 0 / 50 / 100" in REPRODUCTIONS.read_text(encoding="utf-8")
    assert real_stage0.first_surge(df[real_stage0.SURGE]) is None
    assert real_stage0.entropy_rise(df) < 1.0
