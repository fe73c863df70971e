"""The controls' report (scripts/research/repro/real_controls.py): each control paired with the run that differs in that one
field, and the verdict rule written before run A started (scripts/research/repro/real_results/PLAN_stop39.md).

Runs are written with verl's own file logger (``verl.utils.tracking.Tracking``), as ``real_pilot.py`` leaves them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "research"))
from repro import real_controls  # noqa: E402

SHAPE = {"prompts": 2, "samples": 6, "max_response_length": 192, "seed": 1, "sampler_temperature": 1.0, "steps": 20}


def make_run(root: Path, monkeypatch, name: str, lengths: list[float], k3: float, **info) -> Path:
    from verl.utils.tracking import Tracking

    run = root / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": name, **SHAPE, **info}))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part1.jsonl"))
    tracker = Tracking(project_name="p", experiment_name=name, default_backend=["file"])
    for step, length in enumerate(lengths, start=1):
        tracker.log({"response_length/mean": length, "actor/mismatch/k3": k3, "actor/entropy": 1.0,
                     "critic/score/mean": 0.1, "actor/grad_norm": 0.0 if step % 2 else 1.0}, step=step)
    tracker.finish()
    return run


@pytest.mark.parametrize("k3, lr0_k3, tail, expected", [
    (5e-11, 7e-4, 91.0, "the surge needs the mismatch"),
    (5e-11, 7e-4, 100.0, "the surge needs the mismatch"),        # the bound is inclusive (<= 100 tokens)
    (5e-11, 7e-4, 150.0, "the surge does not need the mismatch"),  # and so is this one (>= 150)
    (5e-11, 7e-4, 120.0, "inconclusive"),
    (1e-4, 7e-4, 91.0, "uninformative"),     # k3 above a tenth of LR 0's: the control removed no mismatch
    (5e-11, None, 91.0, "uninformative"),    # no LR-0 run to judge the control's k3 against
    (float("nan"), 7e-4, 91.0, "uninformative"),
])
def test_the_pre_registered_rule(k3, lr0_k3, tail, expected):
    assert real_controls.verdict(k3, lr0_k3, tail).startswith(expected)


def test_a_control_is_paired_with_the_run_differing_in_that_field_only(tmp_path, monkeypatch):
    flat, surge = [60.0] * 20, [60.0] * 10 + [190.0] * 10
    ref = make_run(tmp_path, monkeypatch, "ref", surge, 2.6e-3, lr=1e-4, mode="recompute", sampler_dtype="bf16")
    ctl = make_run(tmp_path, monkeypatch, "fp32", [60.0] * 15 + [90.0] * 5, 5e-11, lr=1e-4, mode="recompute",
                   sampler_dtype="fp32")
    lr0 = make_run(tmp_path, monkeypatch, "lr0", flat, 7e-4, lr=0.0, mode="recompute", sampler_dtype="bf16")
    # not pairable: another LR; another shape (and so another LR-0 control)
    make_run(tmp_path, monkeypatch, "other_lr", surge, 2e-3, lr=3e-5, mode="recompute", sampler_dtype="bf16")
    make_run(tmp_path, monkeypatch, "other_seed", flat, 5e-11, lr=1e-4, mode="recompute", sampler_dtype="fp32", seed=2)
    pairs = real_controls.pair_controls(sorted(tmp_path.iterdir()))
    assert pairs == [(ctl, ref, "sampler_dtype", lr0)]

    row = real_controls.row(ctl)
    assert row["length last 5"] == pytest.approx(90.0)
    assert row["length first 5"] == pytest.approx(60.0)
    assert row["zero-gradient share"] == pytest.approx(0.5)  # odd steps logged a zero grad norm

    out = real_controls.report(sorted(tmp_path.iterdir()), tmp_path / "report")
    text = out.read_text()
    assert "control fp32 (sampler_dtype = fp32) against ref" in text
    assert "pre-registered verdict: the surge needs the mismatch" in text
    assert (tmp_path / "report" / "controls.png").stat().st_size > 10_000


def test_a_recompute_control_of_a_bypass_run(tmp_path, monkeypatch):
    ref = make_run(tmp_path, monkeypatch, "bp", [60.0] * 20, 2e-2, lr=1e-5, mode="bypass", sampler_dtype="bf16")
    ctl = make_run(tmp_path, monkeypatch, "rc", [60.0] * 20, 2e-2, lr=1e-5, mode="recompute", sampler_dtype="bf16")
    assert real_controls.pair_controls([ref, ctl]) == [(ctl, ref, "mode", None)]
    assert real_controls.report([ref, ctl], tmp_path / "report").read_text().count("uninformative") == 1


@pytest.mark.parametrize("val, expected", [
    ({0: 0.17, 50: 0.16, 100: 0.14}, "the failure needs the bf16 mismatch (D = 0.020)"),  # holds its base accuracy
    ({0: 0.17, 50: 0.07, 100: 0.08}, "the failure does not need the bf16 mismatch (D = 0.095)"),  # pilot 4's own
    ({0: 0.17, 50: 0.12, 100: 0.12}, "inconclusive (D = 0.050)"),
    ({0: 0.17, 50: 0.07}, "the failure does not need the bf16 mismatch (D = 0.100, interim: step 50 only)"),
    ({0: 0.17, 100: 0.17}, "not evaluated"),  # step 50's validation is missing
    ({}, "not evaluated"),
])
def test_the_long_controls_rule_on_the_fp32_validation(val, expected):
    assert real_controls.degradation_verdict(val, "sampler_dtype").startswith(expected)


def test_a_long_control_is_read_over_its_own_steps(tmp_path, monkeypatch):
    # pilot 4's shape: the reference runs 150 steps (short answers after step 100), the control 100
    ref = make_run(tmp_path, monkeypatch, "pilot4", [60.0] * 100 + [20.0] * 50, 2e-3, lr=3e-5, steps=150)
    ctl = make_run(tmp_path, monkeypatch, "rc", [60.0] * 100, 2e-3, lr=3e-5, steps=100, mode="recompute")
    # a 60-step run of the same setting is too short to be a long control of the 150-step one
    make_run(tmp_path, monkeypatch, "short", [60.0] * 60, 2e-3, lr=3e-5, steps=60, mode="recompute")
    for run, val in ((ref, {0: 0.17, 50: 0.07, 100: 0.08, 150: 0.07}), (ctl, {0: 0.17, 50: 0.16, 100: 0.16})):
        (run / "fp32_val.json").write_text(json.dumps({str(k): {"accuracy": v} for k, v in val.items()}))
    assert real_controls.pair_controls(sorted(tmp_path.iterdir())) == [(ctl, ref, "mode", None)]

    row = real_controls.row(ref, upto=100)
    assert row["steps"] == 100 and row["length last 5"] == pytest.approx(60.0)  # not step 146-150's 20 tokens
    assert row["fp32 val"] == "0: 0.17, 50: 0.07, 100: 0.08"  # step 150's validation is past the control's end

    text = real_controls.report(sorted(tmp_path.iterdir()), tmp_path / "report").read_text()
    assert "control rc (mode = recompute) against pilot4 (both over steps 1-100)" in text
    assert "pre-registered verdict: the failure needs bypass's old log-probs (the sampler's) (D = 0.010)" in text


def test_a_long_control_stopped_early_is_read_over_the_steps_it_logged(tmp_path, monkeypatch):
    make_run(tmp_path, monkeypatch, "pilot4", [60.0] * 60 + [20.0] * 90, 2e-3, lr=3e-5, steps=150)
    ctl = make_run(tmp_path, monkeypatch, "rc", [60.0] * 55, 2e-3, lr=3e-5, steps=100, mode="recompute")
    (ctl / "fp32_val.json").write_text(json.dumps({"0": {"accuracy": 0.17}, "50": {"accuracy": 0.07},
                                                   "bad": {"accuracy": 0.5}, "10": {"accuracy": None}}))
    assert real_controls.fp32_validation(ctl) == {0: 0.17, 50: 0.07}  # the malformed entries are no validation
    text = real_controls.report(sorted(tmp_path.iterdir()), tmp_path / "report").read_text()
    assert "(both over steps 1-55)" in text
    assert "| pilot4 | 55 |" in text  # the reference's 55 steps, all before its short answers from step 61
    assert "the failure does not need bypass's old log-probs (the sampler's) (D = 0.100, interim: step 50 only)" in text


def test_a_validation_that_is_not_a_number_is_not_evaluated():
    assert real_controls.degradation_verdict({0: float("nan"), 50: 0.1}, "mode").startswith("not evaluated")


from repro.real_pilot import ARCHIVE  # noqa: E402  (the archive the scripts read and write)
# the page that states the readings (its summary table), beside the sections that derive them
REPRODUCTIONS = Path(__file__).resolve().parents[2] / "docs" / "reproductions.md"


@pytest.mark.parametrize("control, field, reading, d", [
    ("rc_const-t1-lr3e-05-p2-s1", "mode", "the failure needs bypass's old log-probs (the sampler's)", 0.016),
    ("bp32_const-t1-lr3e-05-p2-s1", "sampler_dtype", "the failure needs the bf16 mismatch", -0.012),
])
def test_the_documented_degradation_readings_are_the_archives(control, field, reading, d):
    # recomputed from the archived fp32 validations alone, by the rule registered before the controls ran
    control_dir, pilot_4 = ARCHIVE / control, ARCHIVE / "bp_const-t1-lr3e-05-p2-s1"
    assert real_controls.pair_controls([pilot_4, control_dir]) == [(control_dir, pilot_4, field, None)]
    verdict = real_controls.degradation_verdict(real_controls.fp32_validation(control_dir, 100), field)
    assert verdict == f"{reading} (D = {d:.3f})"
    # pilot 4 itself degrades by the same rule: the controls are read against a real failure
    assert real_controls.degradation_verdict(real_controls.fp32_validation(pilot_4, 100), field).startswith(
        "the failure does not need")
    page = REPRODUCTIONS.read_text(encoding="utf-8")
    stated = {"mode": "**the degradation needs bypass's old log-probs**",
              "sampler_dtype": "**the degradation needs the bf16 mismatch**"}[field]
    row = next(line for line in page.splitlines() if stated in line)  # the reading and its D on one table row
    assert f"D = {d:.3f}" in row, row
