"""The wheel a verl user installs holds the product alone: no CPU backend, no research, no tests.

Builds the wheel with ``pip wheel . --no-deps`` (no build isolation: the venv's setuptools) and
lists its files against the product's module map (docs/layout.md). A module that is not the
product (a CPU platform, a rollout, word problems, assets, reproductions, a new top-level package)
fails here until it is placed beside the product or added to the map on purpose.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The product, folder by folder: the scheduler core, detectors, mismatch figures, verl glue,
#: guard, admit, CLI and plots (docs/layout.md).
PRODUCT_PACKAGES = {"verl_lrstab", "verl_lrstab/glue", "verl_lrstab/guard", "verl_lrstab/cli"}
#: Words that name what stands beside the product; none may appear in a shipped module's path.
NOT_PRODUCT = ("cpu", "platform", "rollout", "word_problem", "asset", "repro", "phenomena", "synthetic",
               "real_model", "sampler", "vllm", "test", "bench", "demo")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("verl_lrstab-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_the_wheel_ships_the_product_packages_only(wheel_files):
    modules = [name for name in wheel_files if ".dist-info/" not in name]
    assert modules, "the wheel holds no module"
    folders = {str(Path(name).parent) for name in modules}
    assert folders <= PRODUCT_PACKAGES, f"not product folders in the wheel: {sorted(folders - PRODUCT_PACKAGES)}"
    assert all(name.endswith(".py") for name in modules), [n for n in modules if not n.endswith(".py")]
    shipped = [name for name in modules if any(word in name.lower() for word in NOT_PRODUCT)]
    assert not shipped, f"non-product modules in the wheel: {shipped}"


def test_the_wheel_holds_every_product_module(wheel_files):
    """The map is not empty by accident: every module of the product folders in the checkout ships."""
    expected = {str(p.relative_to(ROOT)) for folder in PRODUCT_PACKAGES for p in (ROOT / folder).glob("*.py")}
    assert expected <= set(wheel_files), sorted(expected - set(wheel_files))


def test_the_wheel_registers_the_plugin_and_the_command(wheel, wheel_files):
    (entry_points,) = [name for name in wheel_files if name.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[verl.plugins]" in text and "verl_lrstab._entry" in text, text
    assert "lrstab = verl_lrstab.cli:main" in text, text
    assert "verl_lrstab_cpu" not in text, text


def test_the_cpu_backend_is_its_own_distribution_beside_the_product():
    """make install puts the CPU backend on the path in editable mode; it is not under verl_lrstab/."""
    assert not (ROOT / "verl_lrstab" / "cpu").exists()
    assert (ROOT / "cpu_backend" / "pyproject.toml").is_file()
    import importlib.util

    spec = importlib.util.find_spec("verl_lrstab_cpu")  # found, not imported: importing it registers the platform
    assert spec is not None, "the CPU backend is not installed: run `make install`"
    assert Path(spec.origin).resolve().is_relative_to(ROOT / "cpu_backend")
