"""Reading logged runs: files written by verl's own loggers (``verl.utils.tracking.Tracking``), CSV, errors."""

from __future__ import annotations

import functools
import math

import pytest

from verl_lrstab.runs import (
    MissingMetricError,
    RunError,
    find_metric,
    load_run,
    metric_series,
)
from verl_lrstab.schedule import replay

PAPER_SURGE = 110


@functools.lru_cache
def _paper_onset() -> int:
    steps = list(range(1, 201))
    for onset in range(PAPER_SURGE, 1, -1):
        if replay(steps, [1000.0 if s < onset else 3500.0 for s in steps]).surge_step == PAPER_SURGE:
            return onset
    raise AssertionError("no jump makes the detector fire at step 110")


def paper_lengths(num_steps: int = 800) -> dict[int, float]:
    """A flat 1000-token run that jumps to 3500 tokens; the jump is placed so that the detector
    (whatever its delay on a clean jump) reports the surge at step 110, the paper's example."""
    onset = _paper_onset()
    return {s: 1000.0 if s < onset else 3500.0 for s in range(1, num_steps + 1)}


def val_score(step: int) -> float:
    """Rises to 0.5 at step 250, collapses to 0.1 from step 310 on."""
    return 0.1 if step >= 310 else 0.2 + 0.3 * min(step, 250) / 250


def write_verl_run(tmp_path, monkeypatch, backends=("file", "tensorboard"), num_steps: int = 800, name="run"):
    """Log a run through verl's real ``Tracking`` (FileLogger and/or the TensorBoard adapter).

    Like verl's trainer: validation metrics every 10 steps in their own ``log`` call, then the
    step's training metrics in a second call with the same step.

    Returns:
        (path of the JSONL file, path of the TensorBoard directory)
    """
    from verl.utils.tracking import Tracking

    jsonl, tb_dir = tmp_path / f"{name}.jsonl", tmp_path / f"tb_{name}"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(jsonl))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tb_dir))
    tracker = Tracking(project_name="lrstab_test", experiment_name=name, default_backend=list(backends))
    for step, length in paper_lengths(num_steps).items():
        if step % 10 == 0:
            tracker.log({"val-core/math_dapo/acc/mean@4": val_score(step)}, step=step)
        tracker.log({"response_length/mean": length, "actor/lr": 1e-6, "actor/grad_norm": 0.5 + step / 1000,
                     "actor/entropy": 0.6, "mismatch/k3": 1e-4 * (1 + step / 100)}, step=step)
    tracker.finish()
    return jsonl, tb_dir


def test_reads_verl_file_logger(tmp_path, monkeypatch):
    jsonl, _ = write_verl_run(tmp_path, monkeypatch, backends=("file",), num_steps=200)
    df = load_run(jsonl)
    assert df.index.name == "step" and list(df.index) == list(range(1, 201))
    assert {"response_length/mean", "actor/lr", "val-core/math_dapo/acc/mean@4"} <= set(df.columns)
    # the two log calls of a validation step are merged into one row
    assert df.loc[20, "val-core/math_dapo/acc/mean@4"] == pytest.approx(val_score(20))
    assert df.loc[20, "response_length/mean"] == paper_lengths(200)[20]
    val = metric_series(df, "val-core/math_dapo/acc/mean@4")
    assert list(val.index) == list(range(10, 201, 10))  # sparse metric: logged steps only


def test_reads_tensorboard_directory_written_by_verl(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard")
    _, tb_dir = write_verl_run(tmp_path, monkeypatch, backends=("tensorboard",), num_steps=200)
    df = load_run(tb_dir)
    lengths = metric_series(df, "response_length/mean")
    assert lengths.to_dict() == paper_lengths(200)
    assert metric_series(df, "mismatch/k3").loc[100] == pytest.approx(2e-4, rel=1e-6)  # float32 on disk
    # the parent directory holds one run too: found below it
    assert list(load_run(tmp_path).columns) == list(df.columns)


def test_tensorboard_directory_with_two_runs_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard")
    write_verl_run(tmp_path, monkeypatch, backends=("tensorboard",), num_steps=5, name="a")
    write_verl_run(tmp_path, monkeypatch, backends=("tensorboard",), num_steps=5, name="b")
    with pytest.raises(RunError, match="holds 2 TensorBoard runs, pass one of"):
        load_run(tmp_path)


def test_reads_csv_with_comments_and_wandb_columns(tmp_path):
    p = tmp_path / "export.csv"
    p.write_text("# exported from wandb\n"
                 "Step,myrun - response_length/mean,myrun - response_length/mean__MIN,myrun - actor/lr\n"
                 "1,1000,990,1e-6\n2,1010.5,1000,1e-6\n# a comment line inside\n3,,1000,5e-7\n")
    df = load_run(p)
    assert list(df.columns) == ["response_length/mean", "actor/lr"]
    assert metric_series(df, "response_length/mean").to_dict() == {1: 1000.0, 2: 1010.5}
    assert df.loc[3, "actor/lr"] == pytest.approx(5e-7)


def test_reads_the_shared_sparse_traces():
    from pathlib import Path

    p = Path(__file__).resolve().parents[2] / "shared" / "traces" / "fleet_negotiation_9b_length_runaway.csv"
    if not p.exists():
        pytest.skip("../shared/traces not present")
    s = metric_series(load_run(p), "response_length")
    assert list(s.index) == [4, 16, 36, 44, 52, 56, 60, 64, 108] and s[36] == 5995


def test_missing_metric_names_it_and_lists_the_available(tmp_path, monkeypatch):
    jsonl, _ = write_verl_run(tmp_path, monkeypatch, backends=("file",), num_steps=3)
    with pytest.raises(MissingMetricError) as err:
        metric_series(load_run(jsonl), "response_length/max")
    msg = str(err.value)
    assert "response_length/max" in msg and "response_length/mean" in msg and "\n" not in msg
    assert err.value.available == sorted(load_run(jsonl).columns)


def test_find_metric_patterns(tmp_path, monkeypatch):
    jsonl, _ = write_verl_run(tmp_path, monkeypatch, backends=("file",), num_steps=20)
    df = load_run(jsonl)
    assert find_metric(df, ["val-core/*/acc/mean@*"]) == "val-core/math_dapo/acc/mean@4"
    assert find_metric(df, ["rollout_corr/k3_kl", "mismatch/k3"]) == "mismatch/k3"
    assert find_metric(df, ["nope/*"]) is None


@pytest.mark.parametrize("name,content,message", [
    ("empty.jsonl", "", "the file is empty"),
    ("blank.jsonl", "\n\n", "has no records"),
    ("bad.jsonl", '{"step": 1, "data": {"a": 1}}\nnot json\n', r"bad.jsonl:2: not a verl file-logger line"),
    ("nodata.jsonl", '{"step": 1, "metrics": {}}\n', "not a verl file-logger line"),
    ("header.csv", "# only a comment\nstep,response_length\n", "header but no rows"),
    ("comments.csv", "# nothing else\n", "no header and no rows"),
    ("nostep.csv", "epoch,loss\n1,2\n", "no step column"),
    ("floatstep.csv", "step,loss\n1.5,2\n", "must hold integer step numbers"),
])
def test_bad_files_give_one_line_errors(tmp_path, name, content, message):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(RunError, match=message) as err:
        load_run(p)
    assert "\n" not in str(err.value)


def test_missing_path_and_empty_tensorboard_dir(tmp_path):
    with pytest.raises(RunError, match="no such file or directory"):
        load_run(tmp_path / "nope.jsonl")
    with pytest.raises(RunError, match="no TensorBoard event files"):
        load_run(tmp_path)


def test_non_numeric_values_are_named(tmp_path):
    p = tmp_path / "run.jsonl"
    p.write_text('{"step": 1, "data": {"response_length/mean": 900.0}}\n'
                 '{"step": 2, "data": {"response_length/mean": "n/a"}}\n'
                 '{"step": 3, "data": {"response_length/mean": null}}\n')
    df = load_run(p)
    with pytest.raises(RunError, match=r"response_length/mean .* non-numeric values \(first: 'n/a' at step 2\)"):
        metric_series(df, "response_length/mean")
    csv = tmp_path / "run.csv"
    csv.write_text("step,response_length/mean\n1,900\n2,abc\n")
    with pytest.raises(RunError, match="non-numeric values"):
        metric_series(load_run(csv), "response_length/mean")


def test_unlogged_and_nan_values_are_dropped_not_invented(tmp_path):
    p = tmp_path / "run.csv"
    p.write_text("step,response_length/mean,other\n1,900,1\n2,,1\n3,nan,1\n4,950,1\n")
    s = metric_series(load_run(p), "response_length/mean")
    assert s.to_dict() == {1: 900.0, 4: 950.0} and not any(math.isnan(v) for v in s)


def test_committed_synthetic_traces_are_reproducible_and_scored(tmp_path):
    """scripts/traces is what the seeded generator writes, and the bench scores it as the issue asks:
    slow healthy growth (and every other no-surge class) does not fire, a 1.8x rise within 30 steps does."""
    import filecmp
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    import bench_detector
    import synthetic_traces

    for spec in synthetic_traces.specs():
        fresh = synthetic_traces.write(spec, tmp_path)
        assert filecmp.cmp(fresh, scripts / "traces" / fresh.name, shallow=False), fresh.name
    traces = bench_detector.load_traces(scripts / "traces", None)
    bench_detector.report(traces)
    fired = {t["name"]: t["fired"]["ours"] for t in traces}
    for t in traces:
        if t["expect"] == "no_fire":
            assert fired[t["name"]] is None, t["name"]
        elif t["expect"] == "fire":
            assert fired[t["name"]] is not None and fired[t["name"]] >= t["onset"], t["name"]
    assert {"growth_1.5x_over_150", "growth_2x_over_200", "rise_1.8x_in_30"} <= set(fired)
