"""``lrstab replay | calibrate | compare`` on runs logged by verl's own loggers, CSV, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
import yaml

# Shared with test_runs: a run written through verl's Tracking whose surge the detector sees at 110.
from test_runs import PAPER_SURGE, paper_lengths, val_score, write_verl_run

from verl_lrstab.cli import main
from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.log_replay import replay

LRSTAB = shutil.which("lrstab", path=os.path.dirname(sys.executable)) or shutil.which("lrstab")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """(JSONL, TensorBoard dir) of an 800-step run written by verl's FileLogger and TensorBoard adapter."""
    mp = pytest.MonkeyPatch()
    try:
        yield write_verl_run(tmp_path_factory.mktemp("run"), mp)
    finally:
        mp.undo()


def run_cli(*argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def paper_schedule(step: int) -> float:
    # The paper's rule with P = 198: lr0 * max(0.1, 0.5 ** floor(t / P)).
    return max(0.1, 0.5 ** (step // 198))


@pytest.mark.skipif(LRSTAB is None, reason="the lrstab console script is not installed (pip install -e .)")
def test_paper_example_through_the_installed_console_script(verl_run):
    jsonl, _ = verl_run
    proc = subprocess.run([LRSTAB, "replay", str(jsonl), "--json", "--origin", "start"], capture_output=True,
                          text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert set(out) == {"surge_step", "decay_period", "steps", "lr_scale"}
    assert out["surge_step"] == PAPER_SURGE == 110 and out["decay_period"] == 198
    assert out["steps"] == list(range(1, 801))
    scale = dict(zip(out["steps"], out["lr_scale"]))
    assert scale[1] == scale[197] == 1.0
    assert scale[198] == scale[395] == 0.5
    assert scale[396] == scale[593] == 0.25
    # the write-ups' example (docs/method.md) says "0.1 (the floor) from 594", but its own formula gives
    # max(0.1, 0.5 ** 3) = 0.125 there; the floor comes at 792 (4 x 198).
    assert scale[594] == 0.125 and scale[792] == scale[800] == 0.1
    assert all(scale[s] == paper_schedule(s) for s in out["steps"])


@pytest.mark.parametrize("kind", ["tensorboard", "csv"])
def test_replay_reads_every_format_alike(verl_run, tmp_path, capsys, kind):
    jsonl, tb_dir = verl_run
    if kind == "tensorboard":
        pytest.importorskip("torch.utils.tensorboard")
        run = tb_dir
    else:
        run = tmp_path / "wandb_export.csv"
        run.write_text("# a wandb export\n_step,response_length/mean\n"
                       + "".join(f"{s},{v}\n" for s, v in paper_lengths().items()))
    code, out, _ = run_cli("replay", run, "--json", capsys=capsys)
    assert code == 0
    _, ref, _ = run_cli("replay", jsonl, "--json", capsys=capsys)
    assert json.loads(out) == json.loads(ref)


def test_replay_human_output_and_plot(verl_run, tmp_path, capsys):
    png = tmp_path / "replay.png"
    code, out, _ = run_cli("replay", verl_run[0], "--plot", png, "--origin", "start", capsys=capsys)
    assert code == 0
    assert "surge: step 110" in out and "decay period: 198" in out
    assert "0.5 from 198; 0.25 from 396; 0.125 from 594; 0.1 from 792" in out
    code, out, _ = run_cli("replay", verl_run[0], capsys=capsys)  # the default: halve right after the surge
    assert "0.5 from 111; 0.25 from 309; 0.125 from 507; 0.1 from 705" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_replay_says_when_the_first_halving_falls_after_the_run_and_which_rule_fired(capsys):
    # class A seed 0: the surge is seen near 131 (the run ends at 164); the line names the way that fired
    from verl_lrstab.cusum import WAYS

    trace = Path(__file__).resolve().parents[1] / "scripts" / "research" / "traces" / "classes" / "A_s0.csv"
    code, out, _ = run_cli("replay", trace, "--origin", "start", capsys=capsys)
    assert code == 0
    surge = next(line for line in out.splitlines() if line.startswith("surge: step"))
    assert "; fired by: " in surge and surge.split("; fired by: ")[1].split(" (")[0] in WAYS, surge
    assert "LR scale: 1 from step 1\n" in out
    period = int(next(line for line in out.splitlines() if line.startswith("decay period:")).split()[2])
    assert f"the first halving is due at step {period}, after the run's last step 164" in out
    code, out, _ = run_cli("replay", trace, capsys=capsys)  # the default (origin surge) cuts at once
    step = int(surge.split("surge: step ")[1].split()[0].rstrip(","))
    assert "first halving is due" not in out and f"0.5 from {step + 1}" in out


def test_scheduler_options_come_from_the_config_fields(verl_run, capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = capsys.readouterr().out
    for f in fields(LengthSurgeConfig):
        # the options lrstab guard sets on each relaunch are accepted but not offered to a user
        listed = f"--{f.name.replace('_', '-')}" in help_text
        assert listed != (f.name in ("decay_from_step", "guard_rollbacks", "dismiss_trigger_step")), f.name
    assert "verl's own ``actor/grad_norm``" not in help_text and "actor/grad_norm" in help_text  # --detector's help

    code, out, _ = run_cli("replay", verl_run[0], "--json", "--origin", "surge", capsys=capsys)
    scale = dict(zip(*(json.loads(out)[k] for k in ("steps", "lr_scale"))))
    assert code == 0 and scale[110] == 1.0 and scale[111] == 0.5 and scale[309] == 0.25

    for options in (["--cusum-min-rise", "5"], ["--detector", "ratio", "--ratio-threshold", "5"]):
        code, out, _ = run_cli("replay", verl_run[0], "--json", *options, capsys=capsys)
        res = json.loads(out)
        assert code == 0 and res["surge_step"] is None and res["decay_period"] is None
        assert set(res["lr_scale"]) == {1.0}
    code, out, _ = run_cli("replay", verl_run[0], "--json", "--detector", "ratio", capsys=capsys)
    assert json.loads(out)["surge_step"] == 112  # the ratio rule on the same run (test_runs pins both)

    # the two-run workflow: a fixed period gives the paper's schedule whatever the run does
    code, out, _ = run_cli("replay", verl_run[0], "--json", "--decay-period", "198", "--cusum-min-rise", "5",
                           capsys=capsys)
    res = json.loads(out)
    assert res["decay_period"] == 198 and res["lr_scale"][197] == 0.5  # step 198


def test_the_top_level_help_names_the_launching_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert "logged runs" in description and "guard" in description and "rollouts" in description, description


@pytest.mark.parametrize("command", ["replay", "calibrate", "compare"])
def test_each_cosignal_flag_says_what_it_falls_back_to(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for flag, consumed, fallback in (("--kl-metric", "actor/lrstab/mismatch_kl", "mismatch/k3"),
                                     ("--score-metric", "actor/lrstab/score", "critic/score/mean"),
                                     ("--clip-metric", "actor/lrstab/clip_ratio", "response_length/clip_ratio")):
        help_of_flag = text.split(f"{flag} ")[-1].split(" --")[0]
        assert consumed in help_of_flag and fallback in help_of_flag and "none" in help_of_flag, (flag, help_of_flag)


def test_invalid_option_value_is_one_line_naming_the_option(verl_run, capsys):
    code, out, err = run_cli("replay", verl_run[0], "--gamma", "2", capsys=capsys)
    assert code == 1 and out == ""
    assert err.strip() == "lrstab: error: --gamma=2 is invalid: allowed values are a number in (0, 1)"
    code, _, err = run_cli("replay", verl_run[0], "--origin", "middle", capsys=capsys)
    assert code == 1 and "--origin='middle'" in err and "'start', 'surge'" in err


def test_calibrate_prints_period_and_yaml_verl_accepts(verl_run, capsys):
    code, out, _ = run_cli("calibrate", verl_run[0], capsys=capsys)
    assert code == 0
    assert "recommended decay_period: 198 = round(1.8 x 110)" in out
    block = out.split("# paste into the arm's YAML (under the config root):\n")[1].split("\n\n")[0]
    assert yaml.safe_load(block) == {"actor_rollout_ref": {"actor": {"optim": {
        "lr_scheduler_type": "length_surge", "length_surge": {"decay_period": 198}}}}}
    overrides = out.strip().splitlines()[-1].split()
    assert overrides == ["actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge",
                         "+actor_rollout_ref.actor.optim.length_surge.decay_period=198"]

    # The printed overrides work on verl's stock ppo_trainer (with the plugin installed).
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    assert optim.lr_scheduler_type == "length_surge" and optim.length_surge.decay_period == 198


def test_calibrate_without_surge_exits_3(tmp_path, capsys):
    run = tmp_path / "flat.csv"
    run.write_text("step,response_length/mean\n" + "".join(f"{s},1000\n" for s in range(1, 200)))
    code, out, err = run_cli("calibrate", run, capsys=capsys)
    assert code == 3 and "surge: none" in out and "no surge found" in err
    code, _, err = run_cli("calibrate", run, "--decay-period", "10", capsys=capsys)
    assert code == 1 and "do not pass --decay-period" in err


def test_compare_figures_and_summary(verl_run, tmp_path, capsys):
    jsonl, tb_dir = verl_run
    shared = ROOT.parent / "shared" / "traces" / "fleet_negotiation_9b_length_runaway.csv"
    runs = [jsonl, tb_dir] + ([shared] if shared.exists() else [])
    out_dir = tmp_path / "cmp"
    code, out, err = run_cli("compare", *runs, "--out", out_dir, "--label", "jsonl", "--label", "tb",
                             "--max-response-length", 8192, capsys=capsys)
    assert code == 0, err
    for fig in ("length", "val", "mismatch", "grad_norm", "entropy", "lr"):
        assert (out_dir / f"{fig}.png").read_bytes()[:4] == b"\x89PNG"
    table = pd.read_csv(out_dir / "summary.csv").set_index("run")
    for label in ("jsonl", "tb"):
        row = table.loc[label]
        assert row.peak_val == pytest.approx(val_score(250)) and row.peak_val_step == 250
        # documented rule: first validation step after the peak from which the score stays < 0.5 x peak
        assert row.collapse_step == 310 and row.collapse_rule == "val < 0.5 x peak"
        assert row.surge_step == 110 and row.decay_period == 198 and row.last_step == 800
    assert (out_dir / "summary.md").read_text().startswith("| run | last_step | peak_val")
    assert out.startswith("| run |")  # the markdown table on stdout
    if shared.exists():  # a run without validation: still summarized, no invented values
        row = table.loc["fleet_negotiation_9b_length_runaway"]
        # its runaway (from step 16; the collapse at 64) is caught on its 9 rows before the collapse
        assert pd.isna(row.peak_val) and pd.isna(row.collapse_step) and 16 <= row.surge_step < 64


def test_compare_length_cap_rule_and_metric_override(tmp_path, capsys):
    run = tmp_path / "runaway.csv"
    lengths = {s: 1000 if s < 50 else 7900 for s in range(1, 101)}
    run.write_text("step,my_len\n" + "".join(f"{s},{v}\n" for s, v in lengths.items()))
    code, _, err = run_cli("compare", run, "--out", tmp_path / "c", "--metric", "length=my_len",
                             "--max-response-length", 8192, capsys=capsys)
    assert code == 0
    row = pd.read_csv(tmp_path / "c" / "summary.csv").iloc[0]
    assert row.collapse_step == 50 and row.collapse_rule == "length >= 0.9 x cap"
    assert "figure val skipped" in err
    code, _, err = run_cli("compare", run, "--metric", "loss=x", "--out", tmp_path / "c", capsys=capsys)
    assert code == 1 and "FIGURE one of" in err


@pytest.mark.parametrize("content,name,message", [
    (None, "missing.jsonl", "no such file or directory"),
    ("", "empty.jsonl", "the file is empty"),
    ('{"step": 1, "data": {"response_length/mean": "long"}}\n', "text.jsonl", "non-numeric values"),
    ('{"step": 1, "data": {"actor/lr": 1e-6}}\n', "nolength.jsonl", "not found in"),
])
def test_error_paths_one_line_nonzero_no_traceback(tmp_path, capsys, content, name, message):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    # compare draws what a run has, so only an unreadable run stops it
    for cmd in ("replay", "calibrate") + (("compare",) if name != "nolength.jsonl" else ()):
        code, out, err = run_cli(cmd, p, *(["--out", tmp_path / "o"] if cmd == "compare" else []), capsys=capsys)
        assert code == 1 and out == ""
        assert err.count("\n") == 1 and err.startswith("lrstab: error:") and message in err


def test_missing_metric_lists_available(verl_run, capsys):
    code, _, err = run_cli("replay", verl_run[0], "--metric", "response_length/median", capsys=capsys)
    assert code == 1
    assert "metric response_length/median not found" in err and "available: actor/entropy, actor/grad_norm" in err


@pytest.mark.skipif(LRSTAB is None, reason="the lrstab console script is not installed")
def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([LRSTAB, "replay", str(tmp_path / "none.jsonl")], capture_output=True, text=True,
                          check=False, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"lrstab: error: {tmp_path / 'none.jsonl'}: no such file or directory"


def test_compare_reports_what_a_length_surge_run_logged(tmp_path, capsys):
    # A run that ran the scheduler with its own options: the summary and marks come from its
    # actor/lrstab/* and actor/lr, not from a replay with the default options.
    run = tmp_path / "trained.csv"
    rows = []
    for s in range(1, 41):
        surge = 12 if s >= 12 else -1
        lr = 5e-4 * (0.5 ** ((s - 6) // 6) if s >= 12 else 1.0)
        rows.append(f"{s},{5 + s},{surge},{lr}\n")
    run.write_text("step,response_length/mean,actor/lrstab/surge_step,actor/lr\n" + "".join(rows))
    code, out, err = run_cli("compare", run, "--out", tmp_path / "cmp", capsys=capsys)
    assert code == 0, err
    row = pd.read_csv(tmp_path / "cmp" / "summary.csv").set_index("run").loc["trained"]
    assert row.logged_surge_step == 12  # what the run did (the replay with the defaults says otherwise)
    assert row.surge_step == replay(list(range(1, 41)), [5.0 + s for s in range(1, 41)]).surge_step != 12


# -- every option exercised and refused by name; co-signals and the lead ------------------------
BAD_VALUES = {
    "period_factor": "0", "gamma": "1.5", "min_lr_ratio": "0", "origin": "middle", "decay_period": "0",
    "trigger": "loss", "detector": "zscore", "skip_first_steps": "-1", "fast_window": "0", "horizon": "x",
    "baseline_window": "2.5", "ratio_threshold": "1", "patience": "0", "max_surges": "0", "cusum_span": "0",
    "cusum_lag": "-2", "cusum_drift": "0", "cusum_threshold": "-1", "cusum_min_rise": "0.9",
    "cusum_noise_floor": "0", "cusum_rebound_margin": "1", "cusum_rebound_memory": "0", "cusum_confirm_steps": "x",
    "cusum_score_z": "nan", "cusum_kl_rise": "1", "cusum_clip_rise": "-0.1", "cusum_runaway_rise": "1",
    "cusum_spike_rise": "1", "mismatch_budget": "-1",
    "mismatch_budget_factor": "0", "mismatch_calibration_steps": "0", "mismatch_metric": "k1",
    "monitor_only": "maybe", "decay_from_step": "-1", "guard_rollbacks": "-1", "length_tokens": "tools",
    "dismiss_trigger_step": "0",
}


def test_every_scheduler_option_has_a_bad_value_case():
    assert set(BAD_VALUES) == {f.name for f in fields(LengthSurgeConfig)}


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
@pytest.mark.parametrize("command", ["replay", "calibrate", "compare"])
def test_bad_option_value_is_refused_naming_the_option(verl_run, tmp_path, capsys, key, command):
    option = "--" + key.replace("_", "-")
    extra = ["--out", tmp_path / "o"] if command == "compare" else []
    code, out, err = run_cli(command, verl_run[0], option, BAD_VALUES[key], *extra, capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith(f"lrstab: error: {option}=") and "allowed values are" in err, err


@pytest.mark.parametrize("argv,message", [
    (["--warmup-steps", "-1"], "--warmup-steps=-1 is invalid: allowed values are an integer >= 0"),
    (["--warmup-steps", "x"], "--warmup-steps='x' is invalid: allowed values are an integer >= 0"),
    (["--trigger", "mismatch", "--kl-metric", "rollout_corr/nope"], "metric rollout_corr/nope not found"),
    (["--score-metric", "critic/nope"], "metric critic/nope not found"),
    (["--clip-metric", "nope"], "metric nope not found"),
])
def test_bad_cli_only_values_are_refused_by_name(verl_run, capsys, argv, message):
    code, out, err = run_cli("replay", verl_run[0], *argv, capsys=capsys)
    assert code == 1 and out == "" and message in err


@pytest.mark.parametrize("argv,message", [
    (["--collapse-fraction", "0"], "--collapse-fraction=0.0 is invalid: allowed values are a number in (0, 1]"),
    (["--cap-fraction", "1.5"], "--cap-fraction=1.5 is invalid"),
    (["--crash-fraction", "-1"], "--crash-fraction=-1.0 is invalid"),
    (["--crash-fraction", "1"], "--crash-fraction=1.0 is invalid: allowed values are a number in (0, 1)"),
    (["--collapse-fraction", "nan"], "--collapse-fraction=nan is invalid"),
    (["--max-response-length", "0"], "--max-response-length=0 is invalid: allowed values are an integer >= 1"),
])
def test_bad_compare_values_are_refused_by_name(verl_run, tmp_path, capsys, argv, message):
    code, _, err = run_cli("compare", verl_run[0], "--out", tmp_path / "o", *argv, capsys=capsys)
    assert code == 1 and message in err


def _replay_json(run, *argv, capsys):
    code, out, err = run_cli("replay", run, "--json", *argv, capsys=capsys)
    assert code == 0, err
    return json.loads(out)


def test_trigger_and_kl_metric(verl_run, capsys):
    # The run logs mismatch/k3 = 1e-4 (1 + step / 100): over a 3e-4 budget from step 201.
    res = _replay_json(verl_run[0], "--trigger", "mismatch", "--kl-metric", "mismatch/k3", "--mismatch-budget",
                       "3e-4", capsys=capsys)
    assert res["surge_step"] == 110 and res["decay_period"] == 364  # started at 202 (patience 3): round(1.8 x 202)
    res = _replay_json(verl_run[0], "--trigger", "mismatch", capsys=capsys)  # calibrated budget, KL found
    assert res["decay_period"] == 655  # 364 x 1.8: the calibrated budget 4 x 1.155e-4 is passed at 364
    res = _replay_json(verl_run[0], "--trigger", "either", "--mismatch-budget", "3e-4", capsys=capsys)
    assert res["decay_period"] == 198  # the length surge at 110 comes first


def test_monitor_only_and_warmup_steps(verl_run, capsys):
    res = _replay_json(verl_run[0], "--monitor-only", "true", capsys=capsys)
    assert res["surge_step"] == 110 and res["decay_period"] is None and set(res["lr_scale"]) == {1.0}
    res = _replay_json(verl_run[0], "--warmup-steps", "4", capsys=capsys)
    assert res["lr_scale"][:6] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0] and res["lr_scale"][197] == 0.5


CLASS_A = ROOT / "scripts" / "research" / "traces" / "classes" / "A_s0.csv"  # scripts/research/phenomena.py, seed 0


@pytest.fixture(scope="module")
def class_a_run(tmp_path_factory):
    """Class A (seed 0) logged by verl's FileLogger and TensorBoard adapter, with its co-signal columns."""
    from verl.utils.tracking import Tracking

    from verl_lrstab.runs import load_run

    df = load_run(CLASS_A)
    d = tmp_path_factory.mktemp("class_a")
    mp = pytest.MonkeyPatch()
    mp.setenv("VERL_FILE_LOGGER_PATH", str(d / "a.jsonl"))
    mp.setenv("TENSORBOARD_DIR", str(d / "tb"))
    try:
        tracker = Tracking(project_name="lrstab_test", experiment_name="a", default_backend=["file", "tensorboard"])
        for step, row in df.iterrows():
            tracker.log({k: float(v) for k, v in row.items()}, step=int(step))
        tracker.finish()
    finally:
        mp.undo()
    return d / "a.jsonl", d / "tb"


def test_cosignals_read_from_jsonl_tensorboard_and_csv(class_a_run, capsys):
    jsonl, tb = class_a_run
    surges = set()
    for run in (jsonl, tb, CLASS_A):
        surge = _replay_json(run, capsys=capsys)["surge_step"]
        none = ("--score-metric", "none", "--kl-metric", "none", "--clip-metric", "none")
        assert _replay_json(run, *none, capsys=capsys)["surge_step"] == 135  # the length only
        assert surge is not None and 125 <= surge < 135  # the witnesses read: before the length alone
        surges.add(surge)
    assert len(surges) == 1  # the three formats decide alike
    code, out, _ = run_cli("replay", CLASS_A, capsys=capsys)
    assert "co-signals: actor/mismatch/k3, critic/score/mean, response_length/clip_ratio" in out
    assert f"surge: step {surges.pop()}" in out


def test_a_length_surge_run_replays_what_its_trainer_consumed(tmp_path, capsys):
    # A run of the scheduler logs actor/lrstab/*: replay feeds its actor/lrstab/score (what the trainer
    # saw), never critic/score/mean, which that trainer may not have received.
    lengths = [1000.0] * 60 + [1800.0] * 60
    rising = [0.4 + (0.01 * (s - 58) if s >= 58 else 0.0) + 0.002 * (s % 3) for s in range(1, 121)]
    rows = "".join(f"{s},{v},{sc},-1\n" for s, (v, sc) in enumerate(zip(lengths, rising), 1))
    fed = tmp_path / "fed.csv"
    fed.write_text("step,response_length/mean,actor/lrstab/score,actor/lrstab/surge_step\n" + rows)
    not_fed = tmp_path / "not_fed.csv"
    not_fed.write_text("step,response_length/mean,critic/score/mean,actor/lrstab/surge_step\n" + rows)
    plain = tmp_path / "plain.csv"
    plain.write_text("step,response_length/mean,critic/score/mean\n"
                     + "".join(f"{s},{v},{sc}\n" for s, (v, sc) in enumerate(zip(lengths, rising), 1)))
    assert _replay_json(fed, capsys=capsys)["surge_step"] is None  # rising score: learning, held
    assert _replay_json(not_fed, capsys=capsys)["surge_step"] == 63  # the trainer saw the length only
    assert _replay_json(plain, capsys=capsys)["surge_step"] is None  # any verl run: critic/score/mean
    assert _replay_json(plain, "--score-metric", "none", capsys=capsys)["surge_step"] == 63


def test_compare_reports_the_crash_and_the_lead(class_a_run, tmp_path, capsys):
    jsonl, _ = class_a_run
    code, out, err = run_cli("compare", jsonl, CLASS_A, "--label", "jsonl", "--label", "csv", "--out", tmp_path / "c",
                             capsys=capsys)
    assert code == 0, err
    table = pd.read_csv(tmp_path / "c" / "summary.csv").set_index("run")
    surge = _replay_json(CLASS_A, capsys=capsys)["surge_step"]
    for label in ("jsonl", "csv"):
        row = table.loc[label]
        # crash rule: 5-point rolling median of the score < 0.6 x its earlier peak (accuracy ~0.85 -> ~0.5)
        assert row.surge_step == surge and row.crash_step == 142 and row.lead == 142 - surge > 0
    assert (tmp_path / "c" / "score.png").exists()
    code, _, _ = run_cli("compare", CLASS_A, "--crash-fraction", "0.3", "--out", tmp_path / "d", capsys=capsys)
    row = pd.read_csv(tmp_path / "d" / "summary.csv").iloc[0]
    assert code == 0 and row.crash_step > 142 and row.lead == row.crash_step - surge


def test_replay_reads_the_clip_ratio_the_trainer_consumed():
    # a length_surge run logs actor/lrstab/clip_ratio (share at the cap) next to verl's
    # response_length/clip_ratio (share at the batch's longest response): replay feeds the former
    from verl_lrstab.cli import cosignal_names
    from verl_lrstab.config import LengthSurgeConfig

    df = pd.DataFrame({"response_length/mean": [10.0, 11.0], "response_length/clip_ratio": [0.06, 0.03],
                       "actor/lrstab/clip_ratio": [0.0, 0.0]}, index=[1, 2])
    assert cosignal_names(df, LengthSurgeConfig())["clip"] == "actor/lrstab/clip_ratio"
    assert cosignal_names(df.drop(columns=["actor/lrstab/clip_ratio"]), LengthSurgeConfig())["clip"] == \
        "response_length/clip_ratio"


def test_compare_labels_runs_by_what_tells_them_apart():
    from verl_lrstab.cli.compare import _labels

    assert _labels(["runs/a/metrics.jsonl", "runs/b/metrics.jsonl"], []) == ["a/metrics", "b/metrics"]
    assert _labels(["x/s1/metrics.jsonl", "y/s1/metrics.jsonl"], []) == ["x/s1/metrics", "y/s1/metrics"]
    assert _labels(["const.jsonl", "ls.jsonl"], []) == ["const", "ls"]
    assert _labels(["a/metrics.jsonl", "b/metrics.jsonl"], ["constant LR"]) == ["constant LR", "metrics"]
    assert _labels(["m.jsonl", "m.jsonl"], []) == ["m", "m#2"]  # the same file twice


def test_compare_says_why_the_validation_columns_are_empty(tmp_path, capsys):
    trace = Path(__file__).resolve().parents[1] / "scripts" / "research" / "traces" / "classes" / "A_s0.csv"
    code, out, err = run_cli("compare", trace, "--out", tmp_path / "cmp", capsys=capsys)
    assert code == 0
    assert "A_s0: no validation metric logged" in err and "--metric val=NAME" in err


def test_importing_the_plots_leaves_the_matplotlib_backend_alone(tmp_path):
    # a notebook's or a GUI's backend must survive `import verl_lrstab.plots`; the PNGs are written anyway
    import subprocess
    import sys

    code = ("import matplotlib; matplotlib.use('svg'); import pandas as pd; from verl_lrstab import plots; "
            "import sys; print(matplotlib.get_backend()); "
            "plots.plot_curves([plots.Curve('a', pd.Series([1.0, 2.0], index=[1, 2]))], 't', 'y', sys.argv[1]); "
            "print('pyplot' if 'matplotlib.pyplot' in sys.modules else 'no pyplot')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.png")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["svg", "no", "pyplot"]
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bad input that used to cost the result, or gave a wrong one ------------------------------------
@pytest.mark.parametrize("name,message", [
    ("out.txt", "--plot='{p}' is invalid: allowed values are a file name ending in one of .png, .pdf"),
    ("out", "--plot='{p}' is invalid: allowed values are a file name ending in one of .png"),
    ("no_such_folder/out.png", "--plot='{p}' is invalid: the folder"),
    ("a_folder.png", "--plot='{p}' is invalid: it is a folder"),
])
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_replay(verl_run, tmp_path, capsys, name,
                                                                         message):
    (tmp_path / "a_folder.png").mkdir()
    path = tmp_path / name
    code, out, err = run_cli("replay", verl_run[0], "--plot", path, capsys=capsys)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and message.format(p=path) in err
    assert not Path(f"{path}.png").exists()  # matplotlib would have added a suffix


@pytest.mark.parametrize("argv,message", [
    # training refuses these (LengthSurgeConfig.check_training): a replay of them would show a schedule no run has
    (["--decay-period", "100", "--origin", "surge"], "--origin='surge' is invalid beside a fixed decay_period=100"),
    (["--decay-period", "100", "--monitor-only", "true"], "is invalid in training"),
    (["--trigger", "mismatch", "--kl-metric", "none"], "--kl-metric none is invalid with --trigger mismatch"),
    (["--metric", ""], "--metric='' is invalid"),
])
def test_replay_refuses_what_the_scheduler_would_not_run(verl_run, capsys, argv, message):
    for command in ("replay", "compare") if argv[0] == "--decay-period" else ("replay",):
        code, out, err = run_cli(command, verl_run[0], *argv, capsys=capsys)
        assert code == 1 and out == "" and message in err, (command, err)


def test_calibrate_refuses_monitor_only(verl_run, capsys):
    code, out, err = run_cli("calibrate", verl_run[0], "--monitor-only", "true", capsys=capsys)
    assert code == 1 and out == "" and "--monitor-only=True is invalid for calibrate" in err


def test_a_length_column_without_a_value_is_named_as_such(tmp_path, capsys):
    run = tmp_path / "nan.csv"
    run.write_text("step,response_length/mean,critic/score/mean\n" + "".join(f"{s},nan,0.5\n" for s in range(1, 50)))
    code, out, err = run_cli("replay", run, capsys=capsys)
    assert code == 1 and out == ""
    assert "metric response_length/mean in" in err and "has no value: every row of it is NaN or empty" in err
    code, out, err = run_cli("compare", run, "--out", tmp_path / "o", capsys=capsys)
    assert code == 0 and "nan: not replayed, its surge_step and decay_period stay empty" in err


def test_compare_says_when_a_named_length_metric_is_not_logged(verl_run, tmp_path, capsys):
    code, _, err = run_cli("compare", verl_run[0], "--out", tmp_path / "o", "--metric", "length=nope",
                           capsys=capsys)
    assert code == 0
    assert "not replayed, its surge_step and decay_period stay empty: it logs no nope" in err
    assert "figure length skipped: no run logs nope" in err


@pytest.mark.parametrize("labels,message", [(["a", "b"], "--label given 2 time(s) for 1 run(s)"),
                                            ([""], "--label='' is invalid")])
def test_compare_refuses_labels_it_cannot_use(verl_run, tmp_path, capsys, labels, message):
    argv = [a for lab in labels for a in ("--label", lab)]
    code, _, err = run_cli("compare", verl_run[0], "--out", tmp_path / "o", *argv, capsys=capsys)
    assert code == 1 and message in err


@pytest.mark.skipif(LRSTAB is None, reason="the lrstab console script is not installed")
def test_a_run_killed_mid_line_replays_without_its_last_line(verl_run, tmp_path, capsys):
    whole = Path(verl_run[0]).read_text()
    cut = tmp_path / "killed.jsonl"
    cut.write_text(whole + '{"step": 801, "data": {"response_len')  # verl's file logger stopped mid-line
    expected = _replay_json(verl_run[0], capsys=capsys)
    # the console script: what the user sees on stderr
    proc = subprocess.run([LRSTAB, "replay", str(cut), "--json"], capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout) == expected
    assert f"{cut}:{whole.count(chr(10)) + 1}: the last line is incomplete" in proc.stderr
    bad = tmp_path / "bad.jsonl"  # a damaged line inside the log is still an error
    bad.write_text('{"step": 1, "data": {"response_length/mean": 3.0}}\nnot json\n' + whole)
    code, _, err = run_cli("replay", bad, capsys=capsys)
    assert code == 1 and f"{bad}:2: not a verl file-logger line" in err


def test_a_step_logged_twice_with_other_values_is_said(tmp_path, capsys, caplog):
    rows = "".join(f"{s},{100 + s}\n" for s in range(1, 61))
    run = tmp_path / "appended.csv"
    run.write_text("step,response_length/mean\n" + rows + "".join(f"{s},{300 + s}\n" for s in range(40, 45)))
    code, out, err = run_cli("replay", run, capsys=capsys)
    assert code == 0 and "(60 values, steps 1..60)" in out
    assert f"{run}: 5 step(s) logged on several rows with different values (first: step 40)" in caplog.text
    caplog.clear()
    same = tmp_path / "same.csv"  # the same values again (an export's overlap) is no news
    same.write_text("step,response_length/mean\n" + rows + rows[:30])
    code, _, err = run_cli("replay", same, capsys=capsys)
    assert code == 0 and "several rows" not in caplog.text


@pytest.mark.skipif(LRSTAB is None, reason="the lrstab console script is not installed")
def test_a_closed_stdout_is_no_error(verl_run):
    # `lrstab replay RUN | head -1`: the reader goes away before lrstab writes
    proc = subprocess.Popen([LRSTAB, "replay", str(verl_run[0])], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


@pytest.mark.parametrize("argv,usage", [(["replay", "RUN", "--out", "d"], "usage: lrstab replay"),
                                        (["calibrate", "RUN", "--json"], "usage: lrstab calibrate"),
                                        (["check-verl", "x"], "usage: lrstab check-verl")])
def test_an_unknown_argument_is_named_with_its_subcommands_usage(capsys, argv, usage):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(usage)
    extra = argv[1:] if argv[0] == "check-verl" else argv[2:]
    assert f"lrstab {argv[0]}: error: unrecognized arguments: {' '.join(extra)}" in err


@pytest.mark.parametrize("command", [["guard", "--run-dir", "{tmp}/g"],
                                     ["admit", "--candidate", "a=x=1", "--out", "{tmp}/a"]])
def test_a_command_that_is_not_verls_entry_point_is_refused_before_it_runs(tmp_path, capsys, command):
    argv = [a.format(tmp=tmp_path) for a in command] + ["--", "python", "train.py"]
    code, _, err = run_cli(*argv, capsys=capsys)
    assert code == 2 and f"lrstab {command[0]}: error: the command after `--` must run verl's entry point" in err
    assert "got 'python train.py'" in err and not (tmp_path / "a").exists()
