"""``lrstab replay | calibrate | compare`` on agentic logs: they read the model-token figure when a log has it,
and say which length they replayed.

The logs are written through verl's own ``Tracking`` (FileLogger). The lengths follow the paper trace whose
surge the detector sees at step 110 on the length alone (``test_runs.PAPER_SURGE``, pinned there).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_runs import PAPER_SURGE, paper_lengths

from verl_lrstab.cli import main

STEPS = 300
MODEL = "actor/lrstab/model_tokens"


def flat(step: int) -> float:
    return 300.0 + 3.0 * ((step * 7) % 3 - 1)


def write_log(path, monkeypatch, verl_length, model_tokens=None, turns: int = 4):
    """A run logged by verl's FileLogger: verl's ``response_length/mean`` and, where given, the model-token figure."""
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking(project_name="lrstab_test", experiment_name=path.stem, default_backend=["file"])
    for step in range(1, STEPS + 1):
        data = {"response_length/mean": verl_length(step), "num_turns/max": turns, "actor/lr": 1e-6}
        if model_tokens is not None:
            data[MODEL] = model_tokens(step)
        tracker.log(data, step=step)
    tracker.finish()
    return path


@pytest.fixture
def logs(tmp_path, monkeypatch):
    paper = paper_lengths(STEPS)
    return {
        # the tool's answers surge (verl's length: the paper trace), the model's own tokens stay flat
        "tools": write_log(tmp_path / "tools.jsonl", monkeypatch, lambda s: paper[s], flat),
        # the model's own tokens surge, the tool's answers stay at 500 tokens
        "model": write_log(tmp_path / "model.jsonl", monkeypatch, lambda s: paper[s] + 500.0, lambda s: paper[s]),
        # single turn: the model-token figure is verl's length (verl logs it as a float32 mean)
        "single": write_log(tmp_path / "single.jsonl", monkeypatch, lambda s: float(pd.Series(
            [paper[s] + 1 / 3], dtype="float32").iloc[0]), lambda s: paper[s] + 1 / 3, turns=2),
        # a stock multi-turn run: no model-token figure
        "stock": write_log(tmp_path / "stock.jsonl", monkeypatch, lambda s: paper[s]),
    }


def run_cli(*argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def replay_json(*argv, capsys):
    code, out, _ = run_cli("replay", *argv, "--json", capsys=capsys)
    assert code == 0
    return json.loads(out)


def test_replay_reads_the_model_tokens_of_an_agentic_log_and_says_so(logs, capsys):
    assert replay_json(logs["tools"], capsys=capsys)["surge_step"] is None  # the model's tokens: flat
    assert replay_json(logs["tools"], "--length-tokens", "all", capsys=capsys)["surge_step"] == PAPER_SURGE
    assert replay_json(logs["tools"], capsys=capsys) == replay_json(logs["tools"], "--metric", MODEL, capsys=capsys)
    assert replay_json(logs["model"], capsys=capsys)["surge_step"] == PAPER_SURGE
    code, out, _ = run_cli("replay", logs["tools"], capsys=capsys)
    assert code == 0
    assert f"metric: {MODEL}" in out
    assert "length: the model's own tokens per response (response_mask) [length_tokens: auto]" in out
    code, out, _ = run_cli("replay", logs["tools"], "--length-tokens", "all", capsys=capsys)
    assert "metric: response_length/mean" in out and "length: every response token" in out


def test_a_single_turn_log_replays_verls_length_as_before(logs, capsys):
    code, out, _ = run_cli("replay", logs["single"], capsys=capsys)
    assert code == 0 and "metric: response_length/mean" in out and "every response token" in out
    assert "tool output" not in out
    assert replay_json(logs["single"], capsys=capsys)["surge_step"] == PAPER_SURGE


def test_a_stock_multi_turn_log_is_replayed_on_verls_length_with_a_warning(logs, capsys):
    code, out, _ = run_cli("replay", logs["stock"], capsys=capsys)
    assert code == 0 and "metric: response_length/mean" in out
    assert "multi-turn responses (num_turns/max up to 4)" in out and "counts tool output too" in out
    code, _, err = run_cli("replay", logs["stock"], "--length-tokens", "model", capsys=capsys)
    assert code == 1 and f"metric {MODEL}" in err


def test_calibrate_and_compare_read_the_model_tokens(logs, tmp_path, capsys):
    code, out, _ = run_cli("calibrate", logs["model"], capsys=capsys)
    assert code == 0 and f"metric: {MODEL}" in out and "the model's own tokens" in out
    assert f"round(1.8 x {PAPER_SURGE})" in out
    code, _, _ = run_cli("compare", logs["tools"], logs["model"], logs["single"], "--label", "tools",
                         "--label", "model", "--label", "single", "--out", tmp_path / "cmp", capsys=capsys)
    assert code == 0
    table = pd.read_csv(tmp_path / "cmp" / "summary.csv").set_index("run")
    assert table.loc["tools", "length_metric"] == MODEL and pd.isna(table.loc["tools", "surge_step"])
    assert table.loc["model", "length_metric"] == MODEL and table.loc["model", "surge_step"] == PAPER_SURGE
    assert table.loc["single", "length_metric"] == "response_length/mean"
