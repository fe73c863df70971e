"""``lrstab admit`` through its CLI: failed candidates, the report after every candidate and on Ctrl-C,
a failed reference, ``--timeout``, and the drift rule against the per-step noise of a real run.

Candidates run the stand-in verl child (tests/standin/main_ppo.py) through the real CLI; each
candidate's k3 by step is given as an environment token (``env:STANDIN_K3=...``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_lrstab.admit.verdict import is_drifting, judge, Budget
from verl_lrstab.runs import load_run

STANDIN = Path(__file__).resolve().parent / "standin" / "python"
REAL = Path(__file__).resolve().parent.parent / "scripts" / "research" / "repro" / "real_results"
BASE = [str(STANDIN), "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def admit(tmp_path, *args, popen=False):
    cmd = [sys.executable, "-m", "verl_lrstab.cli", "admit", "--out", str(tmp_path / "out"), *args, "--", *BASE]
    env = {**os.environ, "STANDIN_PYTHON": sys.executable, "STANDIN_COUNTER": str(tmp_path / "launches.txt")}
    if popen:
        # Ctrl-C reaches admit as a terminal's would: a shell that ran `make test &` (nohup, a CI runner
        # without job control) leaves SIGINT ignored in every descendant, and Python keeps it ignored
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def report(tmp_path):
    return json.loads((tmp_path / "out" / "admit.json").read_text())


def by_name(data):
    return {c["name"]: c for c in data["candidates"]}


def test_a_failed_candidate_is_failed_with_its_error_and_a_failed_reference_falls_back(tmp_path):
    res = admit(tmp_path, "--candidate", "ref=env:STANDIN_FAIL=CUDA_out_of_memory",
                "--candidate", "bf16=env:STANDIN_K3=3e-5,2.5e-5,3.5e-5,3e-5", "--reference", "ref")
    assert res.returncode == 0, res.stderr
    data = report(tmp_path)
    c = by_name(data)
    assert c["ref"]["verdict"] == "failed" and "CUDA_out_of_memory" in c["ref"]["reasons"][0]
    assert data["budget"]["source"] == "default" and data["budget"]["value"] == pytest.approx(5e-4)
    assert any("'ref'" in w and "default budget" in w for w in data["warnings"])
    assert "warning:" in res.stderr and c["bf16"]["verdict"] == "admit"


@pytest.mark.parametrize("option, value", [("--budget-factor", "0"), ("--budget-factor", "nan"),
                                           ("--budget-factor", "-4"), ("--timeout", "0"), ("--timeout", "nan")])
def test_a_bad_number_is_refused_before_any_candidate_runs(tmp_path, option, value):
    res = admit(tmp_path, "--candidate", "ref=env:STANDIN_K3=1e-5", "--candidate", "bf16=env:STANDIN_K3=3e-5",
                "--reference", "ref", option, value)
    assert res.returncode == 2 and f"{option}=" in res.stderr and "allowed values are a number" in res.stderr
    assert not (tmp_path / "launches.txt").exists()  # no candidate launched


def test_the_timeout_stops_a_candidate_and_reports_it_failed(tmp_path):
    res = admit(tmp_path, "--timeout", "12", "--candidate", "slow=env:STANDIN_HANG=1 env:STANDIN_K3=1e-5",
                "--candidate", "ok=env:STANDIN_K3=1e-5")
    assert res.returncode == 0, res.stderr
    c = by_name(report(tmp_path))
    assert c["slow"]["verdict"] == "failed" and "--timeout 12 s" in c["slow"]["error"]
    assert c["slow"]["wall_s"] < 40 and c["ok"]["verdict"] == "admit"


def test_the_report_is_written_after_every_candidate_and_on_ctrl_c(tmp_path):
    proc = admit(tmp_path, "--candidate", "first=env:STANDIN_K3=2e-5", "--candidate",
                 "second=env:STANDIN_HANG=1 env:STANDIN_K3=1e-5", "--candidate", "third=env:STANDIN_K3=1e-5", popen=True)
    out = tmp_path / "out" / "admit.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and by_name(json.loads(out.read_text())).get("first")):
        time.sleep(0.3)
    data = json.loads(out.read_text())  # written after the first candidate, before the second ended
    assert [c["name"] for c in data["candidates"]] == ["first"] and data["complete"] is False
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    try:
        stdout, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in (tmp_path / "out").glob("*.log")}
        pytest.fail(f"admit did not stop within 120 s of Ctrl-C; its stderr: {exc.stderr!r}; candidate logs: {logs}")
    assert proc.returncode == 130
    data = report(tmp_path)
    assert by_name(data)["first"]["verdict"] == "admit"
    assert data["not_run"] == ["second", "third"]  # the second was running when Ctrl-C came
    assert data["complete"] is False and stdout.strip().endswith("admit.json")


def real_k3():
    df = load_run(REAL / "bp_const-t1-lr3e-05-p2-s1" / "metrics.jsonl.gz")
    return df["actor/mismatch/k3"].dropna().tolist()


@pytest.mark.parametrize("steps", [4, 6, 8, 12])
@pytest.mark.parametrize("start", [0, 40, 100])
def test_the_drift_rule_does_not_flag_a_reordered_real_runs_k3(steps, start):
    # the per-step k3 of the real model (Qwen, a real run) in a random order: a stationary sampler
    window = real_k3()[start:start + steps]
    assert len(window) == steps and max(window) / min(window) > 2  # the real per-step noise is large
    flagged = 0
    for seed in range(20):
        order = window[:]
        random.Random(seed).shuffle(order)
        flagged += is_drifting(order)
    assert flagged <= 1, flagged


def test_the_drift_rule_flags_the_real_noise_on_a_growing_k3():
    window = real_k3()[40:52]
    grown = [v * 1.5 ** i for i, v in enumerate(sorted(window, key=lambda _: random.Random(1).random()))]
    assert is_drifting(grown)  # x 1.5 a step over 12 steps: far above the noise
    r = judge("drifting", [{"actor/mismatch/k3": v} for v in grown], Budget(1.0))
    assert r.verdict == "reject" and "grows at LR 0" in r.reasons[0]
