"""A CPU checkpoint engine for verl 0.9.x: the trained weights from the actor to separate rollout workers over gloo.

verl syncs weights between separate pools (the one-step-off and fully-async trainers, V1
``separate_async``) through a checkpoint engine (``checkpoint_engine.backend``); the ones it ships
(nccl, hccl, nixl, mooncake, kimi) need an accelerator, and ``naive`` only works inside the actor's
own process. This one registers as ``gloo`` in verl's own ``CheckpointEngineRegistry``: actor rank 0
and every rollout worker meet in a process group of their own (a ``TCPStore`` served by actor rank
0, a standalone ``ProcessGroupGloo``: the workers' default group is not touched), the header
(names, dtypes, shapes) travels through the store, each tensor by one broadcast from rank 0. The
other actor ranks only walk verl's weight generator (FSDP2 gathers each full tensor collectively).
A test and demo engine, not a fast one: one broadcast a tensor, no buckets.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from typing import Any, Generator, Optional

import torch

BACKEND = "gloo"
TIMEOUT = datetime.timedelta(seconds=600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _host_ip() -> str:
    import ray

    if ray.is_initialized():  # inside verl's Ray workers: the address the rollout's nodes reach
        return ray.util.get_node_ip_address()
    return "127.0.0.1"  # outside Ray (a unit test): this machine


class GlooCheckpointEngine:
    """verl's ``CheckpointEngine`` interface (registered on :func:`register`, when verl's base class exists)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **_unused) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.group = None
        self.store = None
        self.syncs = 0

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 serves the store; its address is the topology's metadata."""
        if not self.is_master:
            return {}
        return {"addr": _host_ip(), "port": _free_port()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0]
        if not master:
            raise RuntimeError("gloo checkpoint engine: actor rank 0 must be the master (no address in its metadata)")
        world_size = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world_size] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world_size)), "world_size": [world_size] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        self.store = torch.distributed.TCPStore(master["addr"], int(master["port"]), world_size, rank == 0,
                                                timeout=TIMEOUT)
        self.group = torch.distributed.ProcessGroupGloo(self.store, rank, world_size, TIMEOUT)

    def finalize(self) -> None:
        """The group and the store live for one sync (verl builds the topology again for the next)."""
        self.group = None
        self.store = None
        self.rank = self.world_size = None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: Optional[int] = None):
        if self.rank is None or self.rank < 0:
            for _ in weights:  # the generator is collective over the actor group: every rank walks it
                pass
            return {}
        named = [(name, t.detach().to("cpu").contiguous()) for name, t in weights]
        header = [(name, t.dtype, tuple(t.shape)) for name, t in named]
        self.store.set("header", pickle.dumps(header))
        for _, t in named:
            self.group.broadcast(t, 0).wait()
        self.syncs += 1
        return {}

    def receive_weights(self, global_steps: Optional[int] = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        header = pickle.loads(self.store.get("header"))
        for name, dtype, shape in header:
            t = torch.empty(shape, dtype=dtype)
            self.group.broadcast(t, 0).wait()
            yield name, t
        self.syncs += 1


def register() -> None:
    """Register :class:`GlooCheckpointEngine` as ``gloo`` in verl's ``CheckpointEngineRegistry`` (idempotent)."""
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    if BACKEND in CheckpointEngineRegistry._registry:
        return
    cls = type("GlooCheckpointEngine", (GlooCheckpointEngine, CheckpointEngine), {"__module__": __name__})
    CheckpointEngineRegistry.register(BACKEND)(cls)
