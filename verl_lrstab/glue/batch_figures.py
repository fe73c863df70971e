"""The batch's figures the worker feeds the scheduler, measured as verl logs them, over the global batch.

:func:`measure_batch`: the length (every response token, and the model's own tokens: docs/agentic.md),
score and mismatch statistics of one actor batch, and whether they show verl's bypass mode, in one
collective over the data-parallel group, before verl's update. One convention for a rank that cannot measure
(:func:`verl_lrstab.collective.reduce_or_none`: if one rank cannot, no rank gets the figure, so
every rank takes the same decision). Measuring only: what is kept between the updates of a
trainer step is :mod:`.steps`'; what verl's update itself gives, after it, :mod:`.update_metrics`'.
"""

from __future__ import annotations

import logging
from typing import Iterable, NamedTuple, Optional

import torch

from verl_lrstab import mismatch, version_split
from verl_lrstab.collective import Part, reduce_or_none
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


def model_token_counts(data):
    """Per-sample counts of the model's own response tokens, over the samples :func:`response_lengths` counts.

    verl marks them with ``response_mask``: 1 on the tokens the model sampled, 0 on the tokens
    it did not (a multi-turn agent loop's tool output and chat-template glue between turns;
    rejection sampling also sets 0 on the tokens it rejects). V1: the jagged mask, V1's
    synthetic padding samples left out; V0: the padded mask within the response's
    ``attention_mask``. A single-turn response is all the model's: the counts equal the lengths.
    """
    mask = data.get("response_mask", None) if hasattr(data, "get") else None
    if mask is None:
        raise KeyError(f"no 'response_mask' in the actor batch (keys: {list(data.keys())})")
    responses = data.get("responses", None)
    if responses is not None and getattr(responses, "is_nested", False):
        if not mask.is_nested or mask.size(0) != responses.size(0):
            raise ValueError("the jagged 'response_mask' does not match the jagged 'responses'")
        offsets = mask.offsets()
        cumsum = torch.cat([offsets.new_zeros(1), (mask.values() != 0).to(offsets.dtype).cumsum(0)])
        counts = cumsum[offsets[1:]] - cumsum[offsets[:-1]]
        keep = _v1_real_samples(responses.offsets().diff(), mask)
        return counts if keep is None else counts[keep]
    attention_mask = data.get("attention_mask", None)
    if attention_mask is None or attention_mask.is_nested or mask.is_nested:
        raise KeyError("the actor batch has neither jagged 'responses' (V1) nor padded 'attention_mask' (V0)")
    width = mask.shape[-1]
    return ((mask != 0) & (attention_mask[:, -width:] != 0)).sum(-1)


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
    bypass: bool = False  # the mismatch shows verl's bypass mode (old_log_probs := rollout_log_probs)
    model_tokens: Optional[float] = None  # the model's own tokens (response_mask) of the responses ``length`` counts
    split: Optional[torch.Tensor] = None  # the mismatch sums by version lag (version_split), async trainers only


def measure_batch(data, dp_group=None, cap: Optional[int] = None, pre_rejection_stats=None,
                  version_lags: Optional[dict] = None) -> BatchStats:
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
        version_lags: an async trainer's map of weight version -> lag (the driver's tag, the same on
            every rank): the mismatch sums are measured per lag group (:mod:`verl_lrstab.version_split`)
            from the samples' versions (:func:`sample_versions`), ``mismatch`` is their sum.

    ``model_tokens``: the sum of :func:`model_token_counts` (with ``pre_rejection_stats``: of the mask
    before rejection, :func:`_model_tokens_before_rejection`), the responses counted by ``length``.

    An empty batch gives zero counts (the step is skipped, not counted as unmeasurable); a
    batch without the keys the length comes from gives ``length`` None (the worker counts those);
    one without a score runs the detector on the length alone; one without rollout log-probs
    has no mismatch figures (a warning, once). ``bypass``: :func:`shows_bypass_mode` of the mismatch.
    """
    width = 2 if cap is None else 3
    parts = [Part(_local_length(data, cap), width), Part(_local_score(data), 2), Part(_local_model_tokens(data), 1)]
    has_log_probs = "rollout_log_probs" in data.keys() and "old_log_probs" in data.keys()
    splitting = version_lags is not None and pre_rejection_stats is None and has_log_probs
    if splitting and version_lags is not None:  # (the None test narrows its type)
        parts.append(Part(_local_split(data, version_lags), version_split.SIZE, n_max=version_split.N_MAX))
    elif pre_rejection_stats is None and has_log_probs:
        parts.append(Part(_local_mismatch(data), len(mismatch.STAT_FIELDS), n_max=1))
    length, score, model, *measured = reduce_or_none(parts, dp_group)
    stats: Optional[torch.Tensor]
    split = measured[0] if splitting else None
    if splitting:
        stats = None if split is None else version_split.whole_stats(split)
    elif pre_rejection_stats is not None:
        stats = torch.tensor(list(pre_rejection_stats), dtype=torch.float64)
        model = _model_tokens_before_rejection(stats) if model is not None else None
    else:
        stats = measured[0] if measured else None
        if stats is None:
            mismatch.warn_once("missing")
    return BatchStats(None if length is None else length.tolist(), None if score is None else score.tolist(), stats,
                      shows_bypass_mode(stats), None if model is None else model.item(), split)


def _model_tokens_before_rejection(stats: torch.Tensor) -> torch.Tensor:
    """The model's own tokens of the batch before rejection sampling zeroed ``response_mask`` on the rejected ones.

    The driver's pre-rejection mismatch sums count every token of that mask: the finite ones
    (``n_tokens``) and the non-finite ones (``n_nonfinite``); read from there, a rejection is not
    taken for tool output and a single-turn run reads the length it reads without rejection.
    """
    fields = dict(zip(mismatch.STAT_FIELDS, stats.tolist()))
    return torch.tensor([fields["n_tokens"] + fields["n_nonfinite"]], dtype=torch.float64)


def shows_bypass_mode(stats: Optional[torch.Tensor]) -> bool:
    """True when global mismatch stats show verl's bypass mode: trainer and rollout log-probs equal bit for bit.

    With ``algorithm.rollout_correction.bypass_mode=true`` verl uses the rollout's log-probs as the
    old log-probs, so their difference is 0 by construction, not a measurement; the figures then
    come from the first mini-batch's forward (:func:`.steps.run_update`). Two real engines never
    agree on every token to the last bit (fp32 vs fp32 with other batch shapes differs by ~1e-7);
    bypass mode always does. Every rank holds the same global stats, so every rank takes the same branch.
    """
    return stats is not None and mismatch.covers_tokens(stats) and stats[-1].item() == 0.0  # the last: max_abs


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


def _local_model_tokens(data) -> Optional[torch.Tensor]:
    try:
        return model_token_counts(data).cpu().sum().double().reshape(1)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for one unmeasurable batch
        logger.warning("verl_lrstab: could not count the model's own response tokens (%s)", exc)
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


def sample_versions(data) -> Optional[tuple[list, list]]:
    """Per sample, the first and last weight version it was sampled with (verl's ``min_global_steps`` /
    ``max_global_steps``): non-tensor fields of the batch (V0-layout trainers: the agent loop's
    ``non_tensor_batch``), or inside its ``extra_fields`` (V1). None when the batch carries neither."""
    keys = data.keys()
    if "min_global_steps" in keys and "max_global_steps" in keys:
        return _as_list(data.get("min_global_steps")), _as_list(data.get("max_global_steps"))
    if "extra_fields" in keys:
        fields = [f if isinstance(f, dict) else {} for f in _as_list(data.get("extra_fields"))]
        return [f.get("min_global_steps") for f in fields], [f.get("max_global_steps") for f in fields]
    return None


def _as_list(value) -> list:
    value = value.tolist() if hasattr(value, "tolist") else list(value)
    return [v.item() if hasattr(v, "item") else v for v in value]


def _local_split(data, lags: dict) -> Optional[torch.Tensor]:
    try:
        versions = sample_versions(data)
        n = int(data["response_mask"].size(0))
        if versions is None:  # every sample unknown: logged apart, none fed
            version_split.warn_no_versions(list(data.keys()))
            versions = ([None] * n, [None] * n)
        groups = version_split.group_ids(*versions, lags)
        return version_split.split_stats(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"],
                                         groups)
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a metric
        logger.warning("verl_lrstab: could not split the mismatch figures by version lag (%s); none logged this "
                       "step", exc)
        return None


def _local_mismatch(data) -> Optional[torch.Tensor]:
    try:
        return mismatch.compute_stats(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
    except Exception as exc:  # noqa: BLE001 - never fail a training step for a metric
        logger.warning("verl_lrstab: could not compute the mismatch figures (%s); none logged this step", exc)
        return None
