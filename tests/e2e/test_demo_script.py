"""`make demo`'s driver keeps its contract: progress per step, a PNG, the metrics JSONL as the last line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verl_lrstab.cpu.launch import REPO_ROOT, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_prints_the_metrics_path_last(tmp_path, assets_dir):
    out = tmp_path / "demo"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--steps", "14", "--trainer", "v0",
           "--out", str(out), "--assets", str(assets_dir), "--timeout", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    metrics_path = Path(lines[-1])
    assert metrics_path.is_absolute() and metrics_path == (out / "metrics.jsonl").resolve()
    metrics = read_metrics(metrics_path)
    assert sorted(metrics) == list(range(1, 15))
    assert sum("step " in line and "/14" in line for line in lines) == 14  # one progress line per step
    assert (out / "length_and_lr.png").stat().st_size > 10_000
