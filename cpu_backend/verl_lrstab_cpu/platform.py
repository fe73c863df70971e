"""An opt-in CPU platform for verl 0.9.x (test and demo backend, not for production).

verl 0.9.1 ships nvidia/huawei/amd platforms only and falls back to nvidia when
it detects nothing. This platform is registered as ``"cpu"`` in verl's
``PlatformRegistry`` and is used only when ``VERL_PLATFORM=cpu`` is set: its
``is_platform_available`` always says no, so auto-detection never picks it.

What it changes, only in a process where it is the active platform:
  * device ``cpu``, collective backend ``gloo``;
  * ``torch.cuda``-style calls (memory stats, cache, RNG, streams) go to a
    no-op shim (:data:`cpu_device_module`) that falls back to ``torch.cpu``;
  * ``torch.distributed.init_process_group`` de-duplicates verl's backend string
    (verl builds ``cpu:gloo,<device>:<backend>`` = ``cpu:gloo,cpu:gloo``, which
    torch rejects with "Duplicate device type cpu");
  * the engine registry is told to hand out the engine registered for
    ``cuda``/``nvidia`` (``VERL_ENGINE_DEVICE``/``VERL_ENGINE_VENDOR`` unless
    already set): verl's FSDP engine routes every device call through the
    platform, so the same engine class (FSDP2) runs on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any, Optional

import torch
import torch.distributed

from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "cpu"


def _noop(*args, **kwargs):
    """Accept anything, do nothing (CPU has no allocator cache, streams or device RNG)."""
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _mem_get_info(*args, **kwargs) -> tuple[int, int]:
    """(free, total) bytes of host memory, the CPU analogue of ``torch.cuda.mem_get_info``."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:  # psutil comes with ray; keep a safe answer anyway
        return 0, 0


class _CPUDeviceModule(types.ModuleType):
    """``torch.cuda`` stand-in: explicit no-ops first, then ``torch.cpu`` (else AttributeError)."""

    _OVERRIDES: dict[str, Any] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "set_device": _noop,
        "synchronize": _noop,
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "reset_peak_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "mem_get_info": _mem_get_info,
        "get_device_name": lambda *a, **k: "cpu",
        # The host RNG is torch's global generator; verl seeds it separately.
        "manual_seed": _noop,
        "manual_seed_all": _noop,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    }

    def __getattr__(self, name: str) -> Any:
        if name in self._OVERRIDES:
            return self._OVERRIDES[name]
        return getattr(torch.cpu, name)


cpu_device_module = _CPUDeviceModule("verl_lrstab_cpu_device")


def dedup_backend(backend: Optional[str]) -> Optional[str]:
    """Drop repeated ``device:backend`` entries from a torch backend string.

    Args:
        backend: e.g. ``"cpu:gloo,cpu:gloo"`` (what verl builds on this platform).

    Returns:
        The string with each device kept once, in order (``"cpu:gloo"``); other values unchanged.
    """
    if not isinstance(backend, str) or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        part = part.strip()
        device = part.split(":", 1)[0] if ":" in part else part
        if device in seen and seen[device] != part:
            raise ValueError(f"conflicting backends for device {device!r} in {backend!r}")
        seen.setdefault(device, part)
    return ",".join(seen.values())


def _install_backend_dedup() -> None:
    """Wrap ``torch.distributed.init_process_group`` once so verl's backend string is accepted."""
    original = torch.distributed.init_process_group
    if getattr(original, "_lrstab_dedup", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedup_backend(kwargs["backend"])
        elif args:
            args = (dedup_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._lrstab_dedup = True
    torch.distributed.init_process_group = init_process_group


def activate() -> None:
    """Process-wide set-up for the CPU platform (idempotent); runs when it is selected.

    * de-duplicates verl's backend string in ``torch.distributed.init_process_group``;
    * the FSDP engine is registered for cuda/npu only: ask verl's engine registry for the
      cuda one (it runs on CPU through this platform). ``setdefault``: a user's choice wins.
    """
    _install_backend_dedup()
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts (gloo, no accelerator). Selected by ``VERL_PLATFORM=cpu`` only."""

    def __init__(self) -> None:
        # verl's auto-detection instantiates every registered platform to probe it: act only
        # when this platform is the one selected.
        if os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME:
            activate()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a CPU fallback must not silently replace a GPU run.
        return False

    def current_device(self) -> str:
        # verl uses this id as a device (``t.to(get_device_id())``): "cpu" is what works,
        # and it is what ``torch.cpu.current_device()`` returns.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        return None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # The run declares fake Ray "GPU"s (one slot per worker); Ray sets this variable,
        # and a CPU build of torch ignores it.
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
