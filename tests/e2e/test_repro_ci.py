"""The reproduction's CI form (``make repro-ci`` = ``scripts/repro/all.py --ci``) end to end.

A 600-step warm start, then ``const`` and ``ls_surge`` for 12 steps each in verl's real
``main_ppo``, then the report. It checks the pipeline, not the science: the table and the
figures of ``make repro`` come from the same code (scripts/repro/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl_lrstab.cpu.launch import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_repro_ci_writes_the_table_and_figures(tmp_path):
    out = tmp_path / "repro-ci"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "repro" / "all.py"), "--ci", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    warm = json.loads((out / "assets" / "warmstart.json").read_text())
    assert (warm["args"]["steps"], warm["args"]["min_digits"], warm["args"]["max_digits"]) == (600, 3, 4)
    rows = {r["run"]: r for r in json.loads((out / "report" / "summary.json").read_text())}
    assert sorted(rows) == ["const-s1", "ls_surge-s1"]
    for row in rows.values():
        assert row["last_step"] == 12
        assert 0.0 <= row["peak_val"] <= 1.0 and 0.0 <= row["final_val"] <= 1.0
        assert row["k3_first10"] > 1e-6  # bf16 generation + weight noise: a measured, non-zero mismatch
        assert row["len_first10"] > 0
    table = (out / "report" / "summary.md").read_text()
    assert "| const | 1 |" in table and "| ls_surge | 1 |" in table
    for name in ("overview", "length", "val", "mismatch", "lr"):
        assert (out / "report" / f"{name}.png").stat().st_size > 10_000
    # a second call reuses the warm start and the finished runs: only the report is redone
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "run.py" not in again.stdout and "warmstart.py" not in again.stdout
