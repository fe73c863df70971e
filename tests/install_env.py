"""A fresh environment holding a verl the package does not pin, for the install tests (stdlib only).

:func:`make_env` builds, under a temporary folder:

- a venv of this interpreter's base Python, with its own pip;
- a view of this environment's site-packages (torch, transformers, Ray, verl's requirements),
  one symbolic link per entry, without verl, without verl-lrstab and without the ``.pth`` files
  that load editable installs, put on the venv's path by one ``.pth`` file: the packages a
  user's verl environment already has, seen by pip as installed;
- verl's code installed into the venv under another version (default ``0.10.0.dev0``: a build
  of verl's main branch): this environment's verl package copied, its version file and its
  metadata's version changed, its requirements kept (pip checks them as for any install).

Then the product's wheel is installed into it from a local folder, without an index: pip may
use only what is installed, so a requirement that would replace anything fails the install.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

FAKE_VERL_VERSION = "0.10.0.dev0"


@dataclass
class Env:
    root: Path
    python: Path
    site: Path
    bin: Path

    def run(self, *args, check: bool = True, timeout: float = 600, env: dict | None = None, cwd=None):
        """Run a command of the venv with a clean path (the checkout is not importable), output captured."""
        full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        full_env.update(env or {})
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=full_env,
                              cwd=cwd or self.root)
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def versions(self, *names: str) -> dict:
        """The versions pip reports installed in the venv, by distribution name."""
        out = self.run(self.python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check").stdout
        listed = {row["name"].lower().replace("_", "-"): row["version"] for row in json.loads(out)}
        return {name: listed.get(name) for name in names}

    def verl_file(self, relative: str) -> Path:
        return self.site / "verl" / relative


def _this_site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _is_left_out(name: str) -> bool:
    low = name.lower()
    return (low.startswith(("verl", "__editable__")) or low.endswith(".pth") or low == "__pycache__"
            or low.startswith(("pip", "_distutils_hack", "distutils-precedence")))


def make_env(root: Path, verl_version: str = FAKE_VERL_VERSION) -> Env:
    root = Path(root)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(root / "venv")], check=True, timeout=300, capture_output=True)
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    view = root / "view"
    view.mkdir()
    for entry in _this_site().iterdir():
        if not _is_left_out(entry.name):
            (view / entry.name).symlink_to(entry)
    (site / "verl_environment.pth").write_text(f"{view}\n")

    # verl's code at another version: the package, and metadata pip reads as an installed distribution
    source = Path(md.distribution("verl").locate_file("verl"))
    shutil.copytree(source, site / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "verl" / "version" / "version").write_text(verl_version + "\n")
    metadata = md.distribution("verl").read_text("METADATA")
    metadata = "\n".join(f"Version: {verl_version}" if line.startswith("Version:") else line
                         for line in metadata.splitlines()) + "\n"
    info = site / f"verl-{verl_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(metadata)
    (info / "INSTALLER").write_text("pip\n")
    (info / "top_level.txt").write_text("verl\n")
    files = [p.relative_to(site) for p in (site / "verl").rglob("*") if p.is_file()]
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in files) + "".join(
        f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "top_level.txt", "RECORD")))
    return Env(root=root, python=python, site=site, bin=root / "venv" / "bin")


def build_wheel(repo: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = Path(out).glob("verl_lrstab-*.whl")
    return built
