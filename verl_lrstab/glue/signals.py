"""The figures the worker feeds the scheduler, measured as verl logs them, over the global batch.

:func:`measure_batch`: the length, score and mismatch statistics of one actor batch, in one
collective over the data-parallel group, before verl's update; :func:`measure_update_output`:
what verl's update logged (grad norm, KL loss, clip fraction, entropy), in one collective after
it; :func:`old_log_prob_entropy`: the entropy of verl's old-log-prob pass. One convention for a
rank that cannot measure (:func:`verl_lrstab.collective.reduce_or_none`: if one rank cannot, no
rank gets the figure, so every rank takes the same decision). Measuring only: what is kept
between the updates of a trainer step is :mod:`.steps`'.
"""

from __future__ import annotations

import logging
from typing import Iterable, NamedTuple, Optional

import torch

from verl_lrstab import mismatch
from verl_lrstab._numbers import finite_float
from verl_lrstab.collective import Part, all_reduce_or_none, reduce_or_none
from verl_lrstab.glue.wraps import Check, VerlShapeError

logger = logging.getLogger("verl_lrstab")


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
    raise KeyError("verl_lrstab: the actor batch has neither jagged 'responses' (V1) nor 'attention_mask' with "
                   "'response_mask' (V0), so the response length cannot be measured as verl logs it "
                   f"(response_mask alone would leave out tool tokens); keys: {list(data.keys())}")


def sequence_scores(data):
    """Per-sample scores, the reward summed over the response (verl's ``critic/score/*`` then leave
    out the aborted, empty responses: :func:`measure_batch` does too).

    V0 sends ``token_level_scores`` (padded, zeros past the response); V1 sends ``rm_scores``
    (jagged, one value per response token), whose synthetic padding samples are left out as
    for the length. None when the batch carries neither (the detector then runs on the length).
    """
    scores = data.get("token_level_scores", None)
    if scores is not None and not scores.is_nested:
        return scores.sum(-1)
    scores = data.get("rm_scores", None)
    if scores is None:
        return None
    if scores.is_nested:
        offsets = scores.offsets()
        cumsum = torch.cat([offsets.new_zeros(1, dtype=torch.float64), scores.values().double().cumsum(0)])
        totals = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
        responses = data.get("responses", None)
        if responses is not None and getattr(responses, "is_nested", False):
            keep = _v1_real_samples(responses.offsets().diff(), data.get("response_mask", None))
            if keep is not None and keep.numel() == totals.numel():
                totals = totals[keep]
        return totals
    return scores.sum(-1)


def _v1_real_samples(lengths, response_mask):
    """Boolean mask of the samples that are not V1's synthetic padding (None if it cannot tell)."""
    if response_mask is None or not response_mask.is_nested or response_mask.size(0) != lengths.numel():
        return None
    offsets = response_mask.offsets()
    cumsum = torch.cat([offsets.new_zeros(1), response_mask.values().to(offsets.dtype).cumsum(0)])
    masked = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
    return ~((lengths == 1) & (masked == 0))


def _drop_v1_padding(lengths, response_mask):
    """Leave out V1's synthetic padding samples, as verl's metrics do (they skip ``is_padding`` tags).

    The tags do not reach the worker; a padding sample is recognisable by its one response
    token with a zero response mask (``padding_utils.construct_minimal_padding_template``,
    checked by :func:`assumption_checks`), which no real sample has (its first response token
    is always generated, mask 1).
    """
    keep = _v1_real_samples(lengths, response_mask)
    return lengths if keep is None else lengths[keep]


def assumption_checks() -> Iterable[Check]:
    """Behaviour of verl the figures rely on, beyond the wrapped targets (run by check_verl.py and on first use)."""
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    sample = {"responses": torch.tensor([5, 6, 7]), "prompts": torch.tensor([1, 2]),
              "input_ids": torch.tensor([1, 2, 5, 6, 7]), "attention_mask": torch.ones(5, dtype=torch.int64),
              "position_ids": torch.arange(5), "response_mask": torch.ones(3, dtype=torch.int64)}
    try:
        pad, tag = construct_minimal_padding_template(sample, {}, eos_token_id=2)
        ok = (tag.get("is_padding") and pad["responses"].numel() == 1 and int(pad["response_mask"].sum()) == 0)
        detail = "" if ok else f"template responses {pad['responses'].tolist()}, mask {pad['response_mask'].tolist()}"
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, repr(exc)
    yield "V1 padding samples have one response token with mask 0 (construct_minimal_padding_template)", ok, detail


_assumptions_checked = False


def check_assumptions_once() -> None:
    """Raise :class:`VerlShapeError` if verl no longer behaves as the figures assume (once per process)."""
    global _assumptions_checked
    if _assumptions_checked:
        return
    failed = [f"{name} ({detail})" for name, ok, detail in assumption_checks() if not ok]
    if failed:
        raise VerlShapeError("verl_lrstab: verl no longer behaves as the length_surge figures assume: "
                             + "; ".join(failed))
    _assumptions_checked = True


class BatchStats(NamedTuple):
    """One actor batch's global figures (:func:`measure_batch`); None where some rank could not measure."""

    length: Optional[list]  # [sum, count] or [sum, count, at_cap] of the response lengths
    score: Optional[list]  # [sum, count] of the sequence scores
    mismatch: Optional[torch.Tensor]  # mismatch.STAT_FIELDS


def measure_batch(data, dp_group=None, cap: Optional[int] = None, pre_rejection_stats=None) -> BatchStats:
    """The length, score and mismatch figures of the global batch, reduced in one collective over ``dp_group``.

    Every rank of the group calls it, once per actor update, before verl's update. Each figure
    follows :func:`verl_lrstab.collective.reduce_or_none`: if one rank cannot measure it, no
    rank gets it, so every rank takes the same decision.

    Args:
        data: the worker's actor batch.
        cap: the rollout's response cap in tokens: the length gets a third figure, how many
            responses reached it (the clip ratio against the cap, which verl 0.9.1's own
            ``response_length/clip_ratio`` is not: it compares with the batch's padded width).
        pre_rejection_stats: the mismatch stats the driver measured over the whole batch before
            rejection sampling overwrote ``response_mask`` (already global): they win over the
            worker's own measurement, and do not travel.

    An empty batch gives zero counts (the step is skipped, not counted as unmeasurable); a
    batch without the keys the length comes from gives ``length`` None (the worker counts those);
    one without a score runs the detector on the length alone; one without rollout log-probs
    has no mismatch figures (a warning, once).
    """
    width = 2 if cap is None else 3
    parts = [Part(_local_length(data, cap), width), Part(_local_score(data), 2)]
    has_log_probs = "rollout_log_probs" in data.keys() and "old_log_probs" in data.keys()
    if pre_rejection_stats is None and has_log_probs:
        parts.append(Part(_local_mismatch(data), len(mismatch.STAT_FIELDS), n_max=1))
    length, score, *measured = reduce_or_none(parts, dp_group)
    if pre_rejection_stats is not None:
        stats = torch.tensor(list(pre_rejection_stats), dtype=torch.float64)
    else:
        stats = measured[0] if measured else None
        if stats is None:
            mismatch.warn_once("missing")
    return BatchStats(None if length is None else length.tolist(), None if score is None else score.tolist(), stats)


def _local_length(data, cap: Optional[int]) -> Optional[torch.Tensor]:
    try:
        lengths = response_lengths(data).cpu()  # the batch may sit on an accelerator; the figures travel from the CPU
        figures = [lengths.sum().double(), torch.tensor(float(lengths.numel()), dtype=torch.float64)]
        if cap is not None:
            figures.append((lengths >= cap).sum().double())
        return torch.stack(figures)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for one unmeasurable batch
        logger.warning("verl_lrstab: could not measure the response length (%s); the step is skipped", exc)
        return None


_score_missing_warned = False


def _local_score(data) -> Optional[torch.Tensor]:
    global _score_missing_warned
    try:
        scores = sequence_scores(data)
        if scores is None:
            raise KeyError(f"neither 'token_level_scores' nor 'rm_scores' in the actor batch (keys: {list(data.keys())})")
        lengths = response_lengths(data)
        if lengths.numel() != scores.numel():
            raise ValueError(f"{scores.numel()} scores for {lengths.numel()} responses")
        scores = scores.cpu()[lengths.cpu() > 0].double()  # verl's critic/score/* leave out aborted (empty) responses
        return torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        if not _score_missing_warned:
            _score_missing_warned = True
            logger.warning("verl_lrstab: no score for the surge detector (%s); it runs on the length alone", exc)
        return None


def _local_mismatch(data) -> Optional[torch.Tensor]:
    try:
        return mismatch.compute_stats(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a metric
        logger.warning("verl_lrstab: could not compute the mismatch figures (%s); none logged this step", exc)
        return None


# -- the co-signals of detector: cusum: what verl's own update logs --------------------------
#: The figures of an actor update that ``detector: cusum`` reads, by co-signal, as keyed in the
#: metrics ``TrainingWorker.train_mini_batch`` returns (the driver then prefixes ``actor/``).
#: ``entropy``: the update's own (``actor/entropy_loss``, computed when ``calculate_entropy`` or an entropy
#: coefficient asks for it, as in bypass mode); a recompute run's ``actor/entropy`` comes from the old-log-prob
#: pass instead (:func:`old_log_prob_entropy_stats`), and takes precedence.
UPDATE_FIGURES = {"grad_norm": "grad_norm", "kl_loss": "kl_loss", "pg_clipfrac": "actor/pg_clipfrac",
                  "entropy": "actor/entropy_loss"}


def old_log_prob_entropy_stats(output, data) -> torch.Tensor:
    """``[sum, count]`` of the per-token entropy verl's old-log-prob pass returns, over the response mask.

    verl's driver logs ``actor/entropy`` from these values (token-mean over the batch, under the default
    ``loss_agg_mode``) and drops them before the update; this reads them on the worker, from the same
    output and batch, with verl's own unpadding (V1's nested batch: ``response_from_nested``, as its driver
    does; V0's padded one: ``no_padding_2_padding``, as its PPO loss does). A rank
    without outputs (not a model-parallel source rank) or without an ``entropy`` output adds 0.
    """
    if output is None:
        return torch.zeros(2, dtype=torch.float64)
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    entropy = tu.get(output, "entropy")
    if entropy is None:
        return torch.zeros(2, dtype=torch.float64)
    mask = data["response_mask"]
    if mask.is_nested:  # V1's padding-free batch: verl's own response slice, as its driver takes it
        from verl.workers.utils.padding import response_from_nested

        per_token = response_from_nested(entropy, mask).values().double()
        mask = mask.values().to(per_token.device).double()
    else:  # V0: left/right-padded prompts and responses, unpadded by verl's PPO loss's own function
        per_token = no_padding_2_padding(entropy, data).double()
        mask = mask.to(per_token.device).double()[:, : per_token.shape[1]]
    finite = torch.isfinite(per_token)
    mask = mask * finite
    return torch.stack([(torch.where(finite, per_token, 0.0) * mask).sum(), mask.sum()]).cpu()


def old_log_prob_entropy(output, data) -> Optional[float]:
    """The global mean entropy of an old-log-prob pass (verl's ``actor/entropy``), or None (on every rank alike).

    Every rank of the default group calls it, each such pass (one collective).
    """
    try:
        local = old_log_prob_entropy_stats(output, data)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        logger.warning("verl_lrstab: could not read the old-log-prob pass's entropy (%s)", exc)
        local = None
    reduced = all_reduce_or_none(local, 2)
    return None if reduced is None or reduced[1].item() <= 0 else reduced[0].item() / reduced[1].item()


def _finite_values(value) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _finite_values(item)]
    try:
        value = value.item() if hasattr(value, "item") else value
    except (TypeError, ValueError, RuntimeError):  # a tensor of several values is no figure
        return []
    v = finite_float(value)
    return [] if v is None else [v]


def update_figure_stats(output) -> torch.Tensor:
    """``[sum, count]`` per :data:`UPDATE_FIGURES` entry of one update's metrics (verl's values: one
    per mini-batch, already gathered over the data-parallel group; the driver logs their mean).
    A rank that returns no output (not a model-parallel source rank) or a metric not logged adds 0."""
    metrics = {}
    if output is not None:
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(output, "metrics") or {}
    stats = []
    for key in UPDATE_FIGURES.values():
        values = _finite_values(metrics.get(key, []))
        stats += [sum(values), float(len(values))]
    return torch.tensor(stats, dtype=torch.float64)


def measure_update_output(output) -> Optional[torch.Tensor]:
    """``[sum, count]`` per :data:`UPDATE_FIGURES` entry of one update's metrics, over the default group, or None.

    Called on every rank after verl's update (one collective: every rank of the default group,
    each update): only the model-parallel source ranks hold verl's metrics, so they are summed
    over the default group, not the data-parallel one. They exist only after the update, after
    the scheduler stepped, so they cannot travel with :func:`measure_batch`'s collective.
    """
    try:
        local = update_figure_stats(output)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a co-signal
        logger.warning("verl_lrstab: could not read the update's grad norm / KL loss / clip fraction (%s)", exc)
        local = None
    return all_reduce_or_none(local, 2 * len(UPDATE_FIGURES))
