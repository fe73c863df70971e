"""Trainer side: which weight versions a batch's samples were drawn with, and how far each is behind.

verl tags every sample with the versions it was sampled with (``min_global_steps`` /
``max_global_steps``: the ``global_steps`` the rollout's weights were synced under). What a
version means depends on when the trainer syncs, so the map version -> lag is made here, where
the trainer is, and travels with the step tag (:data:`~.steps.VERSION_LAGS_KEY`); the worker
splits the mismatch figures by it (:mod:`verl_lrstab.version_split`). A lag counts weight changes
of the actor between the sync and the update: 0 is the trainer's own weights.

- V1 ``colocate_async`` / ``separate_async``: the weights are synced under ``global_steps`` after
  the step's updates (``on_step_end``; at start under the loaded step), so at step G the trainer's
  weights are version G - 1 (verl's own ``training/off_policy/trajectory_staleness`` is
  ``(G - 1) - max_global_steps``). A ``separate_async`` step's later updates run on weights the step
  already changed: every version is one more behind.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

logger = logging.getLogger("verl_lrstab")


def flat(lags: dict) -> list:
    """``{version: lag}`` as the tag travels: ``[version, lag, ...]`` (plain ints)."""
    return [int(x) for item in sorted(lags.items()) for x in item]


def versions_in(pairs: Iterable) -> set:
    """The versions named by ``(min, max)`` pairs, None left out."""
    return {int(v) for pair in pairs for v in pair if v is not None}


def v1_tags_versions(batch) -> set:
    """The versions of a V1 ``KVBatchMeta``'s samples (its ``tags``)."""
    return versions_in((t.get("min_global_steps"), t.get("max_global_steps")) for t in batch.tags)


def v1_lags(trainer, batch, index: int) -> dict:
    """V1 async modes: version ``v`` is ``(global_steps - 1) - v`` behind, one more on a step's later updates."""
    current = int(trainer.global_steps) - 1
    extra = 1 if index > 0 else 0
    return {v: current - v + extra for v in v1_tags_versions(batch)}


def lags_or_none(compute, *args) -> Optional[list]:
    """``flat(compute(*args))``, or None with a WARNING: the figures are then logged unsplit and never fed,
    as before the split; verl's update is untouched."""
    try:
        return flat(compute(*args))
    except Exception as exc:  # noqa: BLE001 - a metric's input must never fail verl's update
        logger.warning("verl_lrstab: could not read the batch's policy versions (%r); its mismatch figures are "
                       "logged unsplit and none is fed to the detector this step", exc)
        return None
