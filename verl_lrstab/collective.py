"""One collective for several figures: sums, maxima and a could-not-measure flag, reduced alike on every rank.

The one convention for a rank that cannot measure: it passes ``None`` for a part; an invalid
flag travels with the part, so if any rank could not measure it, every rank gets None for it
and takes the same decision. Every rank of ``group`` must call :func:`reduce_or_none` at the
same point. The parts travel packed in one ``all_gather`` (SUM and MAX cannot share an
``all_reduce``) and are reduced locally, in rank order: the same float64 figures on every rank.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch


class Part(NamedTuple):
    """One figure vector of a collective: ``size`` float64 entries, the last ``n_max`` reduced with MAX
    (the others with SUM); ``local`` is this rank's vector, or None when the rank could not measure."""

    local: Optional[torch.Tensor]
    size: int
    n_max: int = 0


def collective_device(group=None) -> torch.device:
    """The device a ``group`` collective reduces on: the accelerator for nccl/hccl, else the CPU (gloo)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # this rank's device, not device 0
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def reduce_or_none(parts: Sequence[Part], group=None) -> list[Optional[torch.Tensor]]:
    """The global value of each part (float64, on the CPU), or None for a part some rank could not measure.

    Args:
        parts: the figure vectors, in the same order on every rank.
        group: the process group (the data-parallel one for batch figures); None is the default group.
    """
    packed = torch.cat([_pack(part) for part in parts]) if parts else torch.zeros(0, dtype=torch.float64)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():  # world size 1 too: one code path at every scale
        device = collective_device(group)
        gathered = [torch.empty_like(packed, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, packed.to(device), group=group)
        ranks = torch.stack([g.cpu() for g in gathered])
    else:
        ranks = packed[None]
    out: list[Optional[torch.Tensor]] = []
    start = 0
    for part in parts:
        n_sum = part.size - part.n_max
        block = ranks[:, start:start + part.size + 1]
        start += part.size + 1
        if block[:, n_sum].sum().item() > 0:
            out.append(None)
            continue
        out.append(torch.cat([block[:, :n_sum].sum(0), block[:, n_sum + 1:].max(0).values]))
    return out


def all_reduce_or_none(local: Optional[torch.Tensor], size: int, n_max: int = 0, group=None) -> Optional[torch.Tensor]:
    """:func:`reduce_or_none` of one part: ``size`` entries, the last ``n_max`` reduced with MAX."""
    return reduce_or_none([Part(local, size, n_max)], group)[0]


def _pack(part: Part) -> torch.Tensor:
    """``[sums..., invalid flag, maxes...]`` of one rank."""
    values = torch.zeros(part.size, dtype=torch.float64) if part.local is None else part.local.detach().double().cpu()
    if values.numel() != part.size:
        raise ValueError(f"a figure vector of {values.numel()} entries where {part.size} were expected")
    n_sum = part.size - part.n_max
    flag = torch.tensor([0.0 if part.local is not None else 1.0], dtype=torch.float64)
    return torch.cat([values[:n_sum], flag, values[n_sum:]])
