"""The real-model pilots' report (scripts/research/repro/real_report.py): segments merged, rows summarised, runs archived.

The pilot's metrics are written with verl's own file logger (``verl.utils.tracking.Tracking``), two
segments of one run as a resumed pilot leaves them; the archive must give the same table row and
figure once the run's outputs are gone (a new checkout keeps only the archive).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "research"))
from repro import real_report  # noqa: E402


def log_segment(path: Path, monkeypatch, steps: range, length) -> None:
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    if steps.start == 1:  # verl's validation before training logs step 0, val metrics only
        tracker.log({"val-core/word_problems/acc/mean@1": 0.17}, step=0)
    for step in steps:
        tracker.log({"response_length/mean": length(step), "critic/score/mean": step / 100,
                     "actor/mismatch/k3": 1e-3, "actor/lrstab/clip_ratio": 0.0, "actor/grad_norm": 1.0,
                     "actor/lrstab/surge_step": 25.0 if step >= 27 else -1.0, "response_length/max": 256.0},
                    step=step)
    tracker.finish()


@pytest.fixture
def pilot(tmp_path, monkeypatch):
    run = tmp_path / "live" / "bp_const-t1-lr3e-05-s1"
    run.mkdir(parents=True)
    # segment 1 reaches step 44; the pilot resumed from its checkpoint at 30, segment 2 logs 31..40 again
    log_segment(run / "metrics.part1.jsonl", monkeypatch, range(1, 45), lambda s: 1000.0)
    log_segment(run / "metrics.part2.jsonl", monkeypatch, range(31, 41), lambda s: 50.0)
    (run / "run.json").write_text(json.dumps({"lr": 3e-5, "sampler_temperature": 1.0, "steps": 150,
                                              "max_response_length": 256}))
    (run / "fp32_val.json").write_text(json.dumps({"0": {"accuracy": 0.17}, "20": {"accuracy": 0.4}}))
    return run


def test_a_resumed_segment_replaces_the_steps_it_logged_again(pilot):
    row = real_report.summarize(pilot)
    # segment 1's steps from 31 on (1000 tokens; 41..44 too) were replaced by segment 2's (50 tokens)
    assert row["steps"] == 40 and row["of"] == 150 and row["lr"] == 3e-5
    assert row["length_first10"] == 1000.0 and row["length_last10"] == 50.0
    assert row["score_first10"] == pytest.approx(sum(range(1, 11)) / 10 / 100)
    assert row["fp32_val"] == {0: 0.17, 20: 0.4}
    assert row["surge_step"] == 25


def test_a_segment_resumed_with_validation_before_training_keeps_the_checkpoint_steps_training_row(
        tmp_path, monkeypatch):
    # resumed from the checkpoint at 40 with val_before_train: segment 2's first row is step 40's validation only
    from verl.utils.tracking import Tracking

    run = tmp_path / "bp32_const-t1-lr3e-05-p2-s1"
    run.mkdir()
    log_segment(run / "metrics.part1.jsonl", monkeypatch, range(1, 46), lambda s: 40.0)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part2.jsonl"))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    tracker.log({"val-core/word_problems/acc/mean@1": 0.172}, step=40)
    for step in range(41, 51):
        tracker.log({"response_length/mean": 60.0}, step=step)
    tracker.finish()
    df = real_report.load_run(real_report.metrics_file(run))
    assert list(df.index) == list(range(0, 51))
    assert df.loc[40, "response_length/mean"] == 40.0  # segment 1's training row at the checkpoint's step
    assert df.loc[40, "val-core/word_problems/acc/mean@1"] == pytest.approx(0.172)
    assert (df.loc[41:45, "response_length/mean"] == 60.0).all()  # steps trained again: segment 2's alone
    assert df.loc[41:45, "critic/score/mean"].isna().all()


def test_the_archive_gives_the_same_row_and_figure_without_the_outputs(pilot, tmp_path):
    live_row = real_report.summarize(pilot)
    kept = real_report.archive(pilot, to=tmp_path / "kept")
    assert sorted(p.name for p in kept.iterdir()) == ["fp32_val.json", "metrics.jsonl.gz", "run.json"]
    first_bytes = (kept / "metrics.jsonl.gz").read_bytes()
    real_report.archive(pilot, to=tmp_path / "kept")  # archiving again changes no byte (no git churn)
    assert (kept / "metrics.jsonl.gz").read_bytes() == first_bytes

    import shutil

    shutil.rmtree(pilot.parent)  # a new checkout: the outputs are gone
    assert real_report.pilot_runs(live=pilot.parent, kept=tmp_path / "kept") == [kept]
    assert real_report.summarize(kept) == live_row
    png = real_report.figure([kept], tmp_path / "pilots.png")
    assert png.stat().st_size > 10_000


def test_a_live_run_shadows_its_archived_copy(pilot, tmp_path):
    real_report.archive(pilot, to=tmp_path / "kept")
    other = tmp_path / "kept" / "bp_const-t1.1-lr1e-05-s1"
    other.mkdir()
    (other / "metrics.jsonl.gz").write_bytes((tmp_path / "kept" / pilot.name / "metrics.jsonl.gz").read_bytes())
    assert real_report.pilot_runs(live=pilot.parent, kept=tmp_path / "kept") == [pilot, other]


def test_block_medians_cover_the_run_in_blocks_of_the_asked_size(pilot):
    table = real_report.blocks(pilot, size=20)
    assert list(table.index) == ["1-20", "21-40"]
    # steps 21-30 logged 1000 tokens, 31-40 (the resumed segment) 50: the median of the block is their middle
    assert table.loc["1-20", "length"] == 1000.0 and table.loc["21-40", "length"] == pytest.approx(525.0)
    assert table.loc["1-20", "score"] == pytest.approx(0.105)  # steps 1..20 score step/100
    assert "k3" in table.columns and "PPO clipfrac" not in table.columns  # not logged by this run
    text = real_report.markdown(table)
    assert text.splitlines()[0].startswith("| steps | length |") and "| 21-40 | 525 |" in text


def test_real_pilot_4s_climb_back_after_its_length_collapse_is_no_surge_for_the_default_detector():
    """The committed log of real-model pilot 4 (verl's main_ppo, SmolLM2-135M, LR 3e-5): its length fell
    from ~45 to ~23 tokens and climbed back to ~30-40 from step 82 while k3 doubled. The detector the
    run was trained with fired at step 84; replayed on the very figures the trainer fed it, today's does not (with
    the run's own baseline window, 20 steps ending 3 back, nor with today's defaults)."""
    from verl_lrstab.config import LengthSurgeConfig
    from verl_lrstab.runs import load_run, metric_series
    from verl_lrstab.log_replay import replay

    df = load_run(real_report.ARCHIVE / "bp_const-t1-lr3e-05-p2-s1" / "metrics.jsonl.gz")
    fed = {k: metric_series(df, f"actor/lrstab/{k}") for k in ("response_length", "mismatch_kl", "score", "clip_ratio",
                                                               "surge_step", "cusum")}
    steps = fed["response_length"].index
    assert fed["surge_step"].loc[84] == 84 and (fed["surge_step"].loc[:83] == -1).all()  # the detector of that run, in the trainer
    cosignals = {k: fed[k].reindex(steps).tolist() for k in ("mismatch_kl", "score", "clip_ratio")}
    result = replay(steps.tolist(), fed["response_length"].tolist(),
                    LengthSurgeConfig(cusum_span=20, cusum_lag=3), **cosignals)
    # the replay is the trainer's detector on the trainer's figures: the same CUSUM up to the fire
    assert result.cusum[:83] == pytest.approx(fed["cusum"].reindex(steps).tolist()[:83], abs=1e-9)
    assert result.surge_step is None
    assert replay(steps.tolist(), fed["response_length"].tolist(), LengthSurgeConfig(), **cosignals).surge_step is None


# -- the dose-response report ---------------------------------------------------------
def dose_run(root: Path, monkeypatch, name: str, k3, lr: float, **info) -> Path:
    from verl.utils.tracking import Tracking

    run = root / name
    run.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part1.jsonl"))
    tracker = Tracking(project_name="p", experiment_name=name, default_backend=["file"])
    for step in range(1, 21):
        tracker.log({"actor/mismatch/k3": k3(step), "actor/mismatch/seq_k3": 50 * k3(step),
                     "response_length/mean": 50.0, "critic/score/mean": 0.2,
                     "actor/grad_norm": 0.0 if step % 4 == 0 else 1.0}, step=step)
    tracker.finish()
    shape = {"mode": "recompute", "sampler_dtype": "bf16", "prompts": 2, "samples": 6, "max_response_length": 192,
             "seed": 1, "sampler_temperature": 1.0, "last_step": 20}
    (run / "run.json").write_text(json.dumps({**shape, "lr": lr, **info}))
    return run


def test_the_dose_report_compares_each_lr_with_lr_0_on_the_same_steps(tmp_path, monkeypatch):
    from repro import real_dose

    base = dose_run(tmp_path, monkeypatch, "rc-lr0", lambda s: 1e-3, 0.0)
    # twice LR 0's k3 from step 2 (step 1: the same weights and samples in every run)
    high = dose_run(tmp_path, monkeypatch, "rc-lr1e-4", lambda s: 1e-3 if s == 1 else 2e-3, 1e-4)
    bypass = dose_run(tmp_path, monkeypatch, "bp-lr3e-5", lambda s: 9e-3, 3e-5, mode="bypass")
    other = dose_run(tmp_path, monkeypatch, "rc-lr3e-5-c256", lambda s: 9e-3, 3e-5, max_response_length=256,
                     last_step=5)
    runs = real_dose.dose_runs([base, high, bypass, other])
    assert runs == {0.0: base, 1e-4: high}  # not the bypass run, not the other shape
    table = real_dose.dose_table(real_dose.frames(runs))
    assert table.loc[1e-4, "k3 / LR 0 (median over steps 2+)"] == pytest.approx(2.0)
    assert table.loc[0.0, "k3 / LR 0 (median over steps 2+)"] == pytest.approx(1.0)
    assert table.loc[1e-4, "k3 step 1"] == table.loc[0.0, "k3 step 1"] == pytest.approx(1e-3)
    assert table.loc[1e-4, "zero-gradient share"] == pytest.approx(5 / 20)
    out = real_dose.report([base, high], tmp_path / "report")
    assert out.read_text().count("| 0.0001 |") == 1
    assert (tmp_path / "report" / "dose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_time_table_gives_each_phase_median_and_the_update_per_sequence(tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    run = tmp_path / "rc_const-t1-lr0-p2x6c192-s1"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"mode": "recompute", "prompts": 2, "samples": 6,
                                              "max_response_length": 192}))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run / "metrics.part1.jsonl"))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    for step, update in zip(range(1, 4), (50.0, 60.0, 90.0)):  # median 60 s
        tracker.log({"timing_s/step": update + 30, "timing_s/gen": 10.0, "timing_s/update_actor": update,
                     "prompt_length/mean": 250.0, "response_length/mean": 50.0}, step=step)
    tracker.finish()
    row = real_report.timing([run]).loc[run.name]
    assert (row["mode"], row["shape"], row["steps"]) == ("recompute", "2x6, cap 192", 3)
    assert row["step s"] == 90.0 and row["generation s"] == 10.0 and row["actor update s"] == 60.0
    assert row["update s a sequence"] == pytest.approx(60.0 / 12)  # 2 prompts x 6 samples
    assert row["tokens a sequence"] == pytest.approx(300.0)
    assert row["old log-prob s"] != row["old log-prob s"]  # not logged: NaN, not 0


def test_a_pilot_that_has_not_logged_a_step_yet_is_left_out(pilot, tmp_path):
    # a run just started: vLLM is loading, its first segment's file exists and is empty
    starting = pilot.parent / "bp_const-t1.03-lr1e-05-p2x6c192-s1"
    starting.mkdir()
    (starting / "metrics.part1.jsonl").write_text("")
    assert real_report.pilot_runs(live=pilot.parent, kept=tmp_path / "kept") == [pilot]
    # once archived (an earlier segment), the archived copy stands in for it
    kept = real_report.archive(pilot, to=tmp_path / "kept")
    (kept.parent / starting.name).mkdir()
    (kept.parent / starting.name / "metrics.jsonl.gz").write_bytes((kept / "metrics.jsonl.gz").read_bytes())
    assert real_report.pilot_runs(live=pilot.parent, kept=kept.parent) == [pilot, kept.parent / starting.name]
