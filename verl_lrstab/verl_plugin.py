"""The only module that touches verl's internals (verl 0.9.x, FSDP engine).

verl has no registry for LR schedulers, so three of its functions are wrapped, each
the moment its module is first imported (``patches/README.md`` lists them with the
reason and the check that they still apply):

1. ``verl.workers.config.FSDPOptimizerConfig`` -> :class:`LengthSurgeOptimizerConfig`,
   which accepts ``lr_scheduler_type: length_surge`` and its ``length_surge`` options.
2. ``FSDPEngine._build_lr_scheduler``: builds :class:`LengthSurgeLR` for that name and
   calls verl's own code for every other name.
3. ``TrainingWorker.train_mini_batch``: before the update, computes the step's mean
   response length over the whole global batch (all-reduced over the data-parallel
   group, so every rank feeds its scheduler the same value); after it, adds the
   ``lrstab/*`` figures to the metrics verl logs under ``actor/``.

Nothing changes for a run that does not name ``length_surge``: the wrappers call verl's
original code unless the engine holds a :class:`LengthSurgeLR`.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
from typing import Callable

from verl_lrstab._hooks import when_imported
from verl_lrstab.config import SCHEDULER_NAME

logger = logging.getLogger("verl_lrstab")

_lock = threading.Lock()
_installed = False


# -- installation ------------------------------------------------------------------------------
def install() -> None:
    """Wrap verl's functions now if their modules are loaded, else when they are imported."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    when_imported("verl.workers.config", _patch_config)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _patch_engine)
    when_imported("verl.workers.engine_workers", _patch_worker)


# -- 1. the config class -------------------------------------------------------------------------
def _patch_config(module) -> None:
    from verl_lrstab.verl_config import LengthSurgeOptimizerConfig

    for mod in (module, sys.modules.get("verl.workers.config.optimizer")):
        if mod is not None and getattr(mod, "FSDPOptimizerConfig", None) is not LengthSurgeOptimizerConfig:
            mod.FSDPOptimizerConfig = LengthSurgeOptimizerConfig


# -- 2. the engine builds our scheduler ------------------------------------------------------------
def _patch_engine(module) -> None:
    def wrap(original):
        def _build_lr_scheduler(self, optimizer):
            optim_config = self.optimizer_config
            if optim_config.lr_scheduler_type != SCHEDULER_NAME:
                return original(self, optimizer)
            return build_length_surge_scheduler(optimizer, optim_config, verbose=self.rank == 0)

        return _build_lr_scheduler

    _wrap_method(module.FSDPEngine, "_build_lr_scheduler", wrap)


def build_length_surge_scheduler(optimizer, optim_config, verbose: bool = False):
    """Build :class:`LengthSurgeLR` from verl's optimizer config, resolving warmup as verl does."""
    from verl_lrstab.scheduler import LengthSurgeLR

    warmup = optim_config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim_config.lr_warmup_steps_ratio * optim_config.total_training_steps)
    scheduler = LengthSurgeLR(optimizer, getattr(optim_config, "length_surge", None), warmup_steps=max(0, warmup))
    if verbose:
        print(f"verl_lrstab: length_surge scheduler, warmup {warmup} steps, options {scheduler.config.to_dict()}")
    return scheduler


# -- 3. the worker feeds the scheduler and reports its figures -------------------------------------
def _patch_worker(module) -> None:
    def wrap(original):
        def train_mini_batch(self, data):
            scheduler = _length_surge_scheduler(self)
            if scheduler is None:
                return original(self, data)
            group = self.engine.get_data_parallel_group()
            scheduler.pending_response_length = global_mean_response_length(data, group)
            mismatch = global_mismatch_metrics(data, group)
            if mismatch is not None:
                scheduler.pending_mismatch_kl = mismatch.get(f"mismatch/{scheduler.config.mismatch_metric}")
            output = original(self, data)
            return _with_metrics(output, {**scheduler.metrics(), **(mismatch or {})})

        return train_mini_batch

    _wrap_method(module.TrainingWorker, "train_mini_batch", wrap)


def _wrap_method(cls, name: str, make_wrapper: Callable) -> None:
    """Replace ``cls.name`` by ``make_wrapper(original)`` once (keeps verl's decorator attributes)."""
    original = getattr(cls, name)
    if getattr(original, "_lrstab_wrapped", False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper._lrstab_wrapped = True
    setattr(cls, name, wrapper)


def _length_surge_scheduler(worker):
    from verl_lrstab.scheduler import LengthSurgeLR

    scheduler = getattr(getattr(worker, "engine", None), "lr_scheduler", None)
    return scheduler if isinstance(scheduler, LengthSurgeLR) else None


def response_lengths(data):
    """Per-sample response token counts, as verl's ``response_length/*`` metrics count them.

    V1 sends ``responses`` as a jagged tensor (verl logs ``responses.offsets().diff()`` over the
    samples that are not synthetic padding); V0 sends left/right-padded ``attention_mask`` (verl
    logs ``attention_mask[:, -R:].sum(-1)`` with R the padded response width).
    """
    responses = data.get("responses", None) if hasattr(data, "get") else None
    if responses is not None and getattr(responses, "is_nested", False):
        return _drop_v1_padding(responses.offsets().diff(), data.get("response_mask", None))
    attention_mask, response_mask = data.get("attention_mask", None), data.get("response_mask", None)
    if attention_mask is not None and response_mask is not None and not attention_mask.is_nested:
        width = response_mask.shape[-1]
        return attention_mask[:, -width:].sum(-1)
    if response_mask is not None:
        if response_mask.is_nested:
            return response_mask.offsets().diff()
        return response_mask.sum(-1)
    raise KeyError("verl_lrstab: the actor batch has neither 'responses', 'attention_mask' nor 'response_mask'; "
                   f"cannot measure the response length (keys: {list(data.keys())})")


def _drop_v1_padding(lengths, response_mask):
    """Leave out V1's synthetic padding samples, as verl's metrics do (they skip ``is_padding`` tags).

    The tags do not reach the worker; a padding sample is recognisable by its one response
    token with a zero response mask (``padding_utils.construct_minimal_padding_template``),
    which no real sample has (its first response token is always generated, mask 1).
    """
    if response_mask is None or not response_mask.is_nested or response_mask.size(0) != lengths.numel():
        return lengths
    import torch

    offsets = response_mask.offsets()
    cumsum = torch.cat([offsets.new_zeros(1), response_mask.values().to(offsets.dtype).cumsum(0)])
    masked = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
    return lengths[~((lengths == 1) & (masked == 0))]


def global_mean_response_length(data, dp_group=None) -> float:
    """Mean response length over the global batch: local sums all-reduced over ``dp_group``."""
    import torch
    import torch.distributed as dist

    try:
        lengths = response_lengths(data)
        local = torch.stack([lengths.sum().double(), torch.tensor(float(lengths.numel()), dtype=torch.float64)])
    except Exception as exc:  # never fail a training step for a metric
        logger.warning("verl_lrstab: could not measure the response length (%s); the step is skipped", exc)
        local = torch.tensor([math.nan, 0.0], dtype=torch.float64)
    if _distributed(dp_group):
        reduced = local.to(_collective_device(dp_group))
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=dp_group)
        local = reduced.cpu()
    total, count = local.tolist()
    return total / count if count > 0 else math.nan


def global_mismatch_metrics(data, dp_group=None):
    """``mismatch/*`` over the global batch, or None when the batch has no rollout log-probs.

    Every rank holds the same keys, so every rank takes the same branch and the all-reduce
    is matched; a rank that cannot compute joins it with zeros.
    """
    import torch

    from verl_lrstab import mismatch

    if "rollout_log_probs" not in data.keys() or "old_log_probs" not in data.keys():
        mismatch.warn_once("missing")
        return None
    try:
        stats = mismatch.compute_stats(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
    except Exception as exc:  # never fail a training step for a metric
        logger.warning("verl_lrstab: could not compute the mismatch figures (%s); none logged this step", exc)
        stats = None
    valid = stats is not None
    if not valid:
        mismatch.warn_once("missing")
        stats = torch.zeros(len(mismatch.STAT_FIELDS), dtype=torch.float64)
    if _distributed(dp_group):
        stats = mismatch.all_reduce_stats(stats.to(_collective_device(dp_group)), group=dp_group).cpu()
    result = mismatch.finalize(stats) if valid else None
    if result is not None and result["mismatch/max_abs_diff"] == 0.0:
        # Bit-identical on every token: verl's bypass mode (old_log_probs := rollout_log_probs)
        # gives this by construction, so say so once; the figures are still what was measured.
        mismatch.warn_once("identical")
    return result


def _distributed(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _collective_device(group):
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "nccl" in backend or "hccl" in backend:
        from verl.utils.device import get_device_name

        return torch.device(get_device_name(), torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


def _with_metrics(output, extra: dict):
    """Return verl's ``train_mini_batch`` output with ``extra`` added to its metrics."""
    if output is None:  # ranks that do not report
        return output
    from verl.utils import tensordict_utils as tu

    metrics = dict(tu.get(output, "metrics"))
    for key, value in extra.items():
        metrics[key] = [value]
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics}).cpu()
