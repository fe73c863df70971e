"""The mismatch figures split by policy-version lag: the engine's own mismatch apart from staleness.

In an asynchronous trainer the rollout may sample with older weights than the trainer scores
with, so ``old_log_probs - rollout_log_probs`` mixes the engine's mismatch with policy
staleness (k3 ~5e-3 one version back against ~1e-13 fresh, float32 both sides). verl tags each
sample with the weight versions it was sampled with (``min_global_steps`` / ``max_global_steps``
in its extra fields); the trainer side knows which of those versions its current weights are.
Each sample falls in one group (:data:`GROUPS`):

- ``fresh``: sampled on one version (not partial), lag 0: the engine's own mismatch, the figure
  fed to the detector and logged as ``mismatch/*``;
- ``lag_1`` .. ``lag_3``, ``lag_4_or_more``: sampled on one version, that many versions behind;
- ``partial``: sampled across versions (``min != max``, a partial rollout resumed after a weight
  sync), stale whatever its newest version;
- ``unknown``: versions missing, or a version the trainer side did not map.

:func:`group_ids` classifies the samples; :func:`split_stats` gives one rank's sums per group in
one tensor (sums of every group, then the maxima, for :func:`verl_lrstab.collective.reduce_or_none`
with ``n_max=len(GROUPS)``); :func:`fresh_stats` the fresh group's :data:`~verl_lrstab.mismatch.STAT_FIELDS`
tensor; :func:`split_figures` the logged figures. Pure: no verl.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence, cast

import torch

from verl_lrstab import mismatch

logger = logging.getLogger("verl_lrstab")

MAX_LAG = 4  # lags from here on share one group: a trainer this stale is measuring staleness only
GROUPS = ("fresh", "lag_1", "lag_2", "lag_3", "lag_4_or_more", "partial", "unknown")
FRESH, PARTIAL, UNKNOWN = 0, GROUPS.index("partial"), GROUPS.index("unknown")
N_FIELDS = len(mismatch.STAT_FIELDS)
N_SUM = N_FIELDS - 1  # every field but the last (max_abs) is a sum
SIZE = len(GROUPS) * N_FIELDS
N_MAX = len(GROUPS)
#: The figures logged per stale group (``mismatch/stale/<group>/<name>``): enough to read the lag's cost.
STALE_KEYS = ("k1", "k3", "seq_k3", "max_abs_diff", "frac_over_thr", "n_tokens")
FRESH_SHARE_KEY = "mismatch/fresh_share"


def group_ids(min_versions: Sequence, max_versions: Sequence, lags: Mapping[int, int]) -> torch.Tensor:
    """Each sample's index in :data:`GROUPS`.

    Args:
        min_versions, max_versions: per sample, the first and last weight version it was sampled with
            (verl's ``min_global_steps`` / ``max_global_steps``); None where unknown.
        lags: version -> how many versions behind the trainer's current weights it is (0: the same weights),
            as the trainer side knows them. A version not in it makes the sample ``unknown``.
    """
    if len(min_versions) != len(max_versions):
        raise ValueError(f"{len(min_versions)} min versions for {len(max_versions)} max versions")
    ids = []
    for lo, hi in zip(min_versions, max_versions):
        if lo is None or hi is None:
            ids.append(UNKNOWN)
        elif int(lo) != int(hi):
            ids.append(PARTIAL)
        else:
            lag = lags.get(int(hi))
            ids.append(UNKNOWN if lag is None or lag < 0 else min(int(lag), MAX_LAG))
    return torch.tensor(ids, dtype=torch.int64)


def split_stats(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                groups: torch.Tensor, threshold: float = mismatch.DEFAULT_THRESHOLD) -> torch.Tensor:
    """One rank's mismatch sums per group: ``[sums of group 0, ..., sums of group G-1, max of group 0, ...]``.

    The tensors are as :func:`verl_lrstab.mismatch.compute_stats` takes them, padded ``(bs, T)`` or
    jagged (nested, one row a sample); ``groups`` is :func:`group_ids` of the same samples. Each group
    is :func:`~verl_lrstab.mismatch.compute_stats` over its samples' tokens only (a group without one
    gives zeros).
    """
    nested = response_mask.is_nested
    n_samples = response_mask.size(0)
    if groups.numel() != n_samples:
        raise ValueError(f"{groups.numel()} group ids for {n_samples} samples")
    if nested:
        offsets = cast(Any, response_mask).offsets()  # a nested tensor's (torch's stubs type a plain Tensor)
        old, roll, mask = old_log_probs.values(), rollout_log_probs.values(), response_mask.values()
        per_token = groups.to(mask.device).repeat_interleave(offsets.diff().to(mask.device))
    else:
        offsets = None
        old, roll, mask = old_log_probs, rollout_log_probs, response_mask
        per_token = groups.to(mask.device)[:, None].expand_as(mask)
    sums, maxes = [], []
    for g in range(len(GROUPS)):
        stats = mismatch.compute_stats(old, roll, (mask != 0) & (per_token == g), threshold, offsets)
        if stats is None:
            raise ValueError("no rollout log-probs to split")
        sums.append(stats[:N_SUM])
        maxes.append(stats[N_SUM:])
    return torch.cat(sums + maxes)


def group_stats(split: torch.Tensor, group: int) -> torch.Tensor:
    """The :data:`~verl_lrstab.mismatch.STAT_FIELDS` tensor of one group of a (reduced) split."""
    return torch.cat([split[group * N_SUM:(group + 1) * N_SUM], split[len(GROUPS) * N_SUM + group:][:1]])


def whole_stats(split: torch.Tensor) -> torch.Tensor:
    """The :data:`~verl_lrstab.mismatch.STAT_FIELDS` tensor of every sample together (the groups combined)."""
    total = group_stats(split, 0)
    for g in range(1, len(GROUPS)):
        total = mismatch._combine(total, group_stats(split, g))
    return total


def fresh_stats(split: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The fresh samples' stats, or None when no fresh sample has a response token (nothing to feed)."""
    if split is None:
        return None
    stats = group_stats(split, FRESH)
    return stats if mismatch.covers_tokens(stats) else None


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two updates' splits as one: the sums added, the maxima the larger."""
    cut = len(GROUPS) * N_SUM
    return torch.cat([a[:cut] + b[:cut], torch.maximum(a[cut:], b[cut:])])


def split_figures(split: Optional[torch.Tensor]) -> dict:
    """The logged figures of a (global) split.

    ``mismatch/*`` (:func:`verl_lrstab.mismatch.finalize`) over the fresh samples only: the engine's own
    mismatch, absent when the step has none; ``mismatch/stale/<group>/<name>`` (:data:`STALE_KEYS`) per
    stale group with a response token; ``mismatch/fresh_share``: fresh samples over the samples with a
    counted response token (``n_seqs`` of every group).
    """
    if split is None:
        return {}
    figures: dict = dict(mismatch.finalize(fresh_stats(split)) or {})
    n_seqs = mismatch.STAT_FIELDS.index("n_seqs")
    samples = [group_stats(split, g)[n_seqs].item() for g in range(len(GROUPS))]
    for g, name in enumerate(GROUPS):
        if g == FRESH:
            continue
        stale = mismatch.finalize(group_stats(split, g), prefix=f"mismatch/stale/{name}/")
        if stale:
            figures.update({k: v for k, v in stale.items() if k.rsplit("/", 1)[1] in STALE_KEYS})
    if sum(samples) > 0:
        figures[FRESH_SHARE_KEY] = samples[FRESH] / sum(samples)
    return figures


_warned: set = set()


def warn_once(reason: str, message: str) -> None:
    """Log ``message`` once per process for ``reason``."""
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(message)


def warn_no_fresh() -> None:
    warn_once("no_fresh", "verl_lrstab: this trainer step trained on no fresh sample (every sample was sampled with "
                          "older weights, or across a weight sync), so no mismatch KL is fed to the detector this "
                          "step; mismatch/stale/* are logged and mismatch/fresh_share is 0. (Said once.)")


def warn_no_versions(keys) -> None:
    warn_once("no_versions", "verl_lrstab: the actor batch carries no policy versions per sample (min_global_steps / "
                             "max_global_steps, or extra_fields holding them), so its mismatch figures are logged as "
                             f"mismatch/stale/unknown/* and none is fed to the detector (keys: {keys}). (Said once.)")
