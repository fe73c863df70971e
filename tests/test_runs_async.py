"""Reading the logs of verl's async trainers: real file-logger logs of the one-step-off and fully-async
trainers (``tests/data/async_logs/``, written by ``tests/e2e/``'s runs; its README names the commands).

verl's fully-async trainer logs a sync cycle's figures when the next cycle ends, under the next cycle's
label (its ``training/global_step`` names the update), the last cycle's again under that label
(``test_freq`` > 0), and after a resume counts ``training/global_step`` from the checkpoint's version
+ 2. Each update must be read once, under its number as the run's scheduler counts it, by
``load_run`` (``lrstab replay | compare | calibrate``) and by ``read_metrics`` (the guard, ``admit``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from verl_lrstab.cli import main
from verl_lrstab.runs import load_run, metric_series, read_metrics

LOGS = Path(__file__).resolve().parent / "data" / "async_logs"
ROOT = Path(__file__).resolve().parent.parent
LR0 = 5e-4  # the runs' actor LR (tests/e2e/test_main_ppo_cpu.py's SURGE)
RESUME_AT, N_STEPS = 20, 26  # the resumed pair: a checkpoint at 20, resumed to 26


def raw_lines(path: Path) -> list[tuple[int, dict]]:
    """``(label, data)`` of every line, as verl's file logger wrote them."""
    return [(rec["step"], rec["data"]) for rec in map(json.loads, path.read_text().splitlines())]


def training_lines(path: Path) -> list[dict]:
    """The lines that hold an actor update (verl's training rows), in the file's order."""
    return [data for _, data in raw_lines(path) if "actor/lr" in data]


def updates(rows: dict) -> dict:
    """``{step: row}`` of the steps read that hold an actor update."""
    return {step: row for step, row in rows.items() if "actor/lr" in row}


def options() -> dict:
    """The runs' scheduler options: configs/cpu_demo.yaml with the e2e runs' period_factor."""
    config = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    return {**config["actor_rollout_ref"]["actor"]["optim"]["length_surge"], "period_factor": 0.3}


def option_args() -> list[str]:
    return [f"--{key.replace('_', '-')}={'null' if value is None else value}" for key, value in options().items()]


@pytest.fixture(scope="module")
def stitched(tmp_path_factory) -> Path:
    """The resumed run as one file: its two segments one after the other (verl writes each launch's own)."""
    path = tmp_path_factory.mktemp("stitched") / "fully_async_resumed.jsonl"
    path.write_text((LOGS / "fully_async_segment1.jsonl").read_text()
                    + (LOGS / "fully_async_segment2.jsonl").read_text())
    return path


# -- the logs as verl wrote them --------------------------------------------------------------------------
def test_the_fixtures_show_what_the_reader_handles():
    """The facts the reader stands on, in the real logs: if verl's logging changes, this fails first."""
    fresh = training_lines(LOGS / "fully_async_s1.jsonl")
    assert [(d["training/global_step"], d["fully_async/count/current_param_version"]) for d in fresh] == \
        [(u, u - 1) for u in range(1, 6)]
    labels = [label for label, data in raw_lines(LOGS / "fully_async_s1.jsonl") if "actor/lr" in data]
    assert labels == [u + 1 for u in range(1, 6)]  # a cycle's figures under the next cycle's label
    first = [(label, d["training/global_step"]) for label, d in raw_lines(LOGS / "fully_async_segment1.jsonl")
             if "actor/lr" in d]
    assert first[-2:] == [(RESUME_AT, RESUME_AT - 1), (RESUME_AT, RESUME_AT)]  # the last cycle: the label again
    resumed = training_lines(LOGS / "fully_async_segment2.jsonl")
    assert [d["training/global_step"] for d in resumed] == list(range(RESUME_AT + 2, N_STEPS + 2))
    assert [d["fully_async/count/current_param_version"] for d in resumed] == list(range(RESUME_AT, N_STEPS))


# -- each update once, under its number -------------------------------------------------------------------
def load_rows(path: Path) -> dict:
    """``load_run``'s table as ``{step: {metric: value}}``, the metrics a step did not log left out."""
    return {step: {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
            for step, row in load_run(path).to_dict("index").items()}


@pytest.mark.parametrize("reader", [read_metrics, load_rows])
def test_a_fully_async_log_reads_each_update_once_under_its_number(reader):
    rows = updates(reader(LOGS / "fully_async_s1.jsonl"))
    lines = training_lines(LOGS / "fully_async_s1.jsonl")
    assert sorted(rows) == [int(d["training/global_step"]) for d in lines] == [1, 2, 3, 4, 5]
    for data in lines:
        row = rows[int(data["training/global_step"])]
        assert all(row[k] == v for k, v in data.items()), data["training/global_step"]


def test_the_last_cycle_logged_under_the_label_before_is_its_own_update():
    rows = updates(read_metrics(LOGS / "fully_async_segment1.jsonl"))
    assert sorted(rows) == list(range(1, RESUME_AT + 1))
    last_two = training_lines(LOGS / "fully_async_segment1.jsonl")[-2:]
    for data in last_two:  # both lines of the shared label are read, each under its update
        assert rows[int(data["training/global_step"])]["response_length/mean"] == data["response_length/mean"]
    assert last_two[0]["response_length/mean"] != last_two[1]["response_length/mean"]


def test_a_resumed_launch_reads_from_the_update_after_the_checkpoint():
    """verl restarts ``training/global_step`` at the checkpoint's version + 2: the updates are read from + 1, as the
    run's scheduler counts them (and as its checkpoint's folder names the version)."""
    rows = updates(read_metrics(LOGS / "fully_async_segment2.jsonl"))
    assert sorted(rows) == list(range(RESUME_AT + 1, N_STEPS + 1))
    for data in training_lines(LOGS / "fully_async_segment2.jsonl"):
        assert rows[int(data["training/global_step"]) - 1]["actor/lr"] == data["actor/lr"]
    df = load_run(LOGS / "fully_async_segment2.jsonl")
    assert list(metric_series(df, "actor/lr").index) == list(range(RESUME_AT + 1, N_STEPS + 1))


def test_the_two_segments_of_a_resumed_run_stitched_read_as_one_run(stitched):
    rows = updates(read_metrics(stitched))
    assert sorted(rows) == list(range(1, N_STEPS + 1))
    for segment, shift in (("fully_async_segment1.jsonl", 0), ("fully_async_segment2.jsonl", 1)):
        for data in training_lines(LOGS / segment):
            row = rows[int(data["training/global_step"]) - shift]
            assert all(row[k] == data[k] for k in ("training/global_step", "actor/lr", "response_length/mean"))


def test_rows_without_an_update_stay_under_their_label():
    """The rollouter's timing rows (no ``training/global_step``) are logged under the version they follow."""
    lines = raw_lines(LOGS / "fully_async_s1.jsonl")
    timing = {label: data for label, data in lines if "training/global_step" not in data}
    rows = read_metrics(LOGS / "fully_async_s1.jsonl")
    assert sorted(timing) == list(range(0, 7)) and sorted(rows) == list(range(0, 7))
    assert rows[0] == timing[0] and rows[6] == timing[6]  # the first sync and the last cycle's (not logged)
    assert all(rows[u]["fully_async/rollouter/version_time"] == timing[u]["fully_async/rollouter/version_time"]
               for u in range(7))


def test_a_one_step_off_log_reads_by_its_labels_as_before():
    """No fully-async row: every line under its label, the lines of a label merged (the later value winning)."""
    path = LOGS / "one_step_off.jsonl"
    expected: dict = {}
    for label, data in raw_lines(path):
        expected.setdefault(label, {}).update(data)
    assert read_metrics(path) == expected == load_rows(path) and sorted(expected) == [1, 2, 3, 4]


# -- CSV and TensorBoard: the logger merged the rows of a label ---------------------------------------------
def label_merged(path: Path) -> dict:
    """The log as a logger that keeps one row per label (wandb's history, TensorBoard by step) holds it."""
    merged: dict = {}
    for label, data in raw_lines(path):
        merged.setdefault(label, {}).update(data)
    return merged


def test_a_csv_export_reads_each_training_row_under_its_update(tmp_path):
    import pandas as pd

    merged = label_merged(LOGS / "fully_async_segment1.jsonl")
    csv = tmp_path / "export.csv"
    pd.DataFrame.from_dict(merged, orient="index").rename_axis("step").to_csv(csv)
    df = load_run(csv)
    lr = metric_series(df, "actor/lr")
    # the last label's row holds the last cycle (the later line): the cycle before it is not in the export
    assert list(lr.index) == list(range(1, RESUME_AT - 1)) + [RESUME_AT]
    for label, data in merged.items():
        if "training/global_step" in data:
            step = int(data["training/global_step"])
            assert df.loc[step, "response_length/mean"] == pytest.approx(data["response_length/mean"], rel=1e-12)


def test_a_tensorboard_log_written_by_verl_reads_each_training_row_under_its_update(tmp_path, monkeypatch):
    pytest.importorskip("torch.utils.tensorboard")
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["tensorboard"])
    for label, data in raw_lines(LOGS / "fully_async_segment2.jsonl"):
        tracker.log(data={k: v for k, v in data.items() if isinstance(v, (int, float))}, step=label)
    tracker.logger["tensorboard"].finish()
    df = load_run(tmp_path / "tb")
    # the last label's events are the last cycle's (the later ones): the cycle before it is not in the log
    assert list(metric_series(df, "actor/lr").index) == list(range(RESUME_AT + 1, N_STEPS - 1)) + [N_STEPS]
    last = training_lines(LOGS / "fully_async_segment2.jsonl")[-1]
    assert df.loc[N_STEPS, "response_length/mean"] == pytest.approx(last["response_length/mean"], rel=1e-6)


# -- trigger_parameter_sync_step > 1: a row per sync cycle ---------------------------------------------------
def test_a_log_of_two_updates_a_cycle_reads_each_cycle_once_under_its_number(capsys):
    """verl's row at a cycle's end holds the cycle before's last update (where the scheduler's figures are
    logged) and this cycle's first; the last cycle's row its last update alone. Each cycle's figures are read
    under the cycle's number, as the run's scheduler counts (it steps once a cycle)."""
    path = LOGS / "fully_async_k2.jsonl"
    lines = training_lines(path)
    assert {d["fully_async/static/max_required_samples"] for d in lines} == {16.0}  # 4 x (1 + 1) x 2
    fed = [d for d in lines if "actor/lrstab/response_length" in d]
    rows = read_metrics(path)
    cycles = {step: row for step, row in rows.items() if "actor/lrstab/response_length" in row}
    assert sorted(cycles) == [1, 2, 3] and len(fed) == 3
    assert [cycles[c]["actor/lrstab/response_length"] for c in (1, 2, 3)] == \
        [d["actor/lrstab/response_length"] for d in fed]
    assert 0 in rows and "actor/lrstab/response_length" not in rows[0]  # the first cycle's first update alone
    # a replay of what the scheduler was fed decides as the run did (the scale logged after a cycle is the next's)
    assert main(["replay", str(path), "--json", "--metric", "actor/lrstab/response_length", *option_args()]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == [1, 2, 3]
    for cycle, scale in zip(out["steps"][1:], out["lr_scale"][1:]):
        assert cycles[cycle - 1]["actor/lrstab/lr_scale"] == pytest.approx(scale, rel=1e-12)


# -- the product's commands and the guard on these logs ----------------------------------------------------
@pytest.mark.parametrize("log", ["fully_async_resumed", "one_step_off", "fully_async_s1"])
def test_replay_gives_the_decisions_and_lrs_the_run_logged(log, stitched, capsys):
    path = stitched if log == "fully_async_resumed" else LOGS / f"{log}.jsonl"
    assert main(["replay", str(path), "--json", *option_args()]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = updates(read_metrics(path))
    assert out["steps"] == sorted(rows)
    # verl logs the LR after the scheduler's step: the LR of the next update, the replay's scale in force there
    scale = dict(zip(out["steps"], out["lr_scale"]))
    for step in out["steps"][:-1]:
        assert rows[step]["actor/lr"] == pytest.approx(LR0 * scale[step + 1], rel=1e-9), step
    surge = {int(row["actor/lrstab/surge_step"]) for row in rows.values()} - {-1}
    assert ([out["surge_step"]] if out["surge_step"] is not None else []) == sorted(surge)
    if log == "fully_async_resumed":
        assert out["surge_step"] is not None and min(out["lr_scale"]) < 0.5  # a surge, two decays in the run


def test_compare_reads_a_fully_async_and_a_one_step_off_log(stitched, tmp_path, capsys):
    import pandas as pd

    code = main(["compare", str(stitched), str(LOGS / "one_step_off.jsonl"), "--out", str(tmp_path / "cmp"),
                 *option_args()])
    capsys.readouterr()
    assert code == 0
    table = pd.read_csv(tmp_path / "cmp" / "summary.csv")
    assert table["last_step"].tolist() == [N_STEPS, 4]
    resumed = table.iloc[0]
    assert resumed["surge_step"] == resumed["logged_surge_step"]  # the replay decides as the run did


def test_the_guards_reader_and_trouble_finder_read_the_updates(stitched, tmp_path):
    from verl_lrstab.config import LengthSurgeConfig
    from verl_lrstab.guard.metrics import MetricsFile
    from verl_lrstab.guard.plan import GuardOptions, find_trouble

    path = tmp_path / "segment-1.jsonl"
    held = MetricsFile(path)  # created before verl writes, as the guard does
    try:
        shutil.copyfile(stitched, path)
        records = held.read()
    finally:
        held.close()
    assert sorted(updates(records)) == list(range(1, N_STEPS + 1))
    logged = {int(row["actor/lrstab/surge_step"]) for row in records.values() if "actor/lrstab/surge_step" in row}
    (surge,) = logged - {-1}
    trouble = find_trouble(records, GuardOptions(on_reward_crash=False, on_non_finite=False),
                           LengthSurgeConfig.from_dict(options()))
    assert trouble is not None and trouble.reason == "surge" and trouble.step == surge
    assert not math.isnan(records[surge]["response_length/mean"])
