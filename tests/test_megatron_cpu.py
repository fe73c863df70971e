"""scripts/gpu_check_megatron.py's checks on CPU: megatron-core's real GPTModel, DDP,
DistributedOptimizer (bf16) and dist-checkpointing under our scheduler, with the test-only CUDA
stand-ins of ``tests/megatron_cpu.py`` (gloo for nccl). No verl: also runs on the 0.19 line."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")

HELPER = Path(__file__).resolve().parent / "megatron_cpu.py"


@pytest.mark.timeout(300)
def test_gpu_check_passes_on_cpu_with_stand_ins():
    proc = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, timeout=280,
                          cwd=HELPER.parent.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == 2 and all(line.startswith("ok ") for line in lines), lines
    assert "surge 7, period 13, LR 1e-03 -> 5e-04, 2 param groups, weight decay [0.0, 0.1]" in lines[0]
    assert "saved after update 12, resumed: LR trajectory and weights identical" in lines[1]
