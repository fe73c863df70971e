"""The wheel a verl user installs holds the product alone: no CPU backend, no research, no tests.

Builds the wheel with ``pip wheel . --no-deps`` (no build isolation: the venv's setuptools) and
lists its files against the product's module map (docs/layout.md). A module that is not the
product (a CPU platform, a rollout, word problems, assets, reproductions, a new top-level package)
fails here until it is placed beside the product or added to the map on purpose.
"""

from __future__ import annotations

import ast
import email
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The product, folder by folder: the scheduler core, detectors, mismatch figures, verl glue,
#: guard, admit, CLI and plots (docs/layout.md).
PRODUCT_PACKAGES = {"verl_lrstab", "verl_lrstab/glue", "verl_lrstab/guard", "verl_lrstab/admit", "verl_lrstab/cli"}
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
    data = [n for n in modules if not n.endswith(".py")]
    assert data == ["verl_lrstab/py.typed"], data  # the typing marker is the one data file
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


# -- the metadata: the product's own extras, nothing that replaces a user's verl, one version ---------------
def metadata(wheel, wheel_files):
    (name,) = [n for n in wheel_files if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(zipfile.ZipFile(wheel).read(name))


def _dist(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_metadata_requires_nothing_that_would_replace_a_users_verl(wheel, wheel_files):
    meta = metadata(wheel, wheel_files)
    requires = meta.get_all("Requires-Dist") or []
    base = {_dist(r) for r in requires if "extra ==" not in r}
    assert not base & {"verl", "torch", "transformers", "vllm", "sglang", "megatron-core", "transferqueue", "ray"}, base
    assert not [r for r in requires if "==" in r.split(";")[0]], "an exact pin in the metadata"
    assert meta.get_all("Provides-Extra") == ["plot"], "only the product's own extras"
    import verl_lrstab

    assert meta["Version"] == verl_lrstab.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["Author"] and meta["Keywords"]
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in meta.get_all("Classifier"))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_files)
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "0.1.0" in (ROOT / "CHANGELOG.md").read_text()


#: The import name of each distribution the product imports, where the two differ.
IMPORT_NAMES = {"pyyaml": "yaml", "hydra-core": "hydra"}
#: Imported only in the code verl's processes load (verl brings them), never by `lrstab replay/calibrate/compare`.
WITH_VERL = {"verl", "torch", "megatron", "ray", "tensordict", "transformers"}
#: Imported on use, with a message naming the package to install (tested in tests/test_runs.py and test_cli.py).
ON_USE = {"tensorboard", "matplotlib"}


def _third_party_imports() -> dict:
    """``module -> [file, ...]`` of every import of the product that is neither the standard library nor itself."""
    found: dict = {}
    for path in sorted((ROOT / "verl_lrstab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "verl_lrstab":
                    found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_module_the_product_imports_is_declared_or_verls_or_imported_on_use(wheel, wheel_files):
    declared = {IMPORT_NAMES.get(_dist(r), _dist(r)) for r in metadata(wheel, wheel_files).get_all("Requires-Dist")}
    imports = _third_party_imports()
    assert {"pandas", "yaml", "tqdm", "omegaconf", "torch", "verl"} <= set(imports), sorted(imports)
    unknown = {m: files for m, files in imports.items() if m not in declared | WITH_VERL | ON_USE}
    assert not unknown, f"imported, not declared: {unknown}"
    # the lrstab command without verl: its modules import nothing of verl's world
    code = ("import sys, verl_lrstab.cli, verl_lrstab.runs, verl_lrstab.log_replay; "
            f"print(sorted(m for m in {sorted(WITH_VERL)!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_python_m_verl_lrstab_is_the_lrstab_command():
    runs = [subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
            for module in ("verl_lrstab", "verl_lrstab.cli")]
    assert runs[0].returncode == runs[1].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and "check-verl" in runs[0].stdout


def test_lrstab_version_and_python_m_verl_lrstab_version_print_the_packages_version(capsys):
    import verl_lrstab
    from verl_lrstab.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"verl-lrstab {verl_lrstab.__version__}\n"
    proc = subprocess.run([sys.executable, "-m", "verl_lrstab", "--version"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout == f"verl-lrstab {verl_lrstab.__version__}\n", proc.stderr


#: The repository address docs/layout.md ("Publishing") gives; the metadata's three Project-URLs share it.
PUBLISHED = re.search(r"`Repository`\s+(https://\S+?),", (ROOT / "docs" / "layout.md").read_text()).group(1)


def test_the_metadata_names_the_repository_its_documentation_and_issues(wheel, wheel_files):
    urls = dict(u.split(", ", 1) for u in metadata(wheel, wheel_files).get_all("Project-URL") or [])
    assert set(urls) == {"Repository", "Documentation", "Issues"}, urls
    assert urls["Repository"] == PUBLISHED and urls["Documentation"] == f"{PUBLISHED}/tree/main/docs"
    assert urls["Issues"] == f"{PUBLISHED}/issues"


@pytest.mark.skipif(importlib.util.find_spec("build") is None or shutil.which("twine", path=str(Path(sys.executable).parent))
                    is None, reason="needs build and twine (make install puts them in .venv)")
def test_python_m_build_gives_an_sdist_and_a_wheel_that_twine_check_passes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    built = sorted(p.name for p in tmp_path.iterdir())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["version"]
    assert version == {"attr": "verl_lrstab.__version__"}
    import verl_lrstab

    assert built == [f"verl_lrstab-{verl_lrstab.__version__}-py3-none-any.whl", f"verl_lrstab-{verl_lrstab.__version__}.tar.gz"]
    import tarfile

    with tarfile.open(tmp_path / built[1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    # the README names the manual and the configs by path: the source distribution carries them
    assert {"LICENSE", "CHANGELOG.md", "docs/integration.md", "configs/experiments/starter_gsm8k_length_surge.yaml"} \
        <= names
    # no test at all (docs/layout.md, "Publishing": they need the whole checkout), nor a compiled file
    assert not [n for n in names if n.split("/")[0] == "tests" or n.endswith(".pyc")], sorted(names)
    assert {"verl_lrstab/cli/check_verl.py", "verl_lrstab/glue/registry.py", "pyproject.toml"} <= names
    twine = shutil.which("twine", path=str(Path(sys.executable).parent))
    check = subprocess.run([twine, "check", "--strict", *map(str, tmp_path.iterdir())], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0 and check.stdout.count("PASSED") == 2, check.stdout + check.stderr
