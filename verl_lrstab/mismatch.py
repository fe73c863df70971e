"""Training-inference mismatch figures from the rollout engine's and the trainer's log-probs.

Per response token (inside the response mask), with
``d = log pi_trainer(y_t) - log pi_rollout(y_t)`` (``old_log_probs - rollout_log_probs``):

==============================  ============================================================
``mismatch/k1``                 token mean of ``-d``: KL(rollout || trainer), may be < 0
``mismatch/k3``                 token mean of ``exp(d) - 1 - d`` (>= 0, low variance)
``mismatch/seq_k1``             mean over sequences of the per-sequence sum of ``-d``
``mismatch/seq_k3``             mean over sequences of the per-sequence sum of k3
``mismatch/max_abs_diff``       max ``|d|``
``mismatch/frac_over_thr``      fraction of tokens with ``|d| > threshold`` (default log 2)
``mismatch/frac_over_<e>``      fraction of tokens with ``|d| > e``, e = 1e-6, 1e-5, ..., 0.1, 1:
                                the tail of the per-token ``|d|`` distribution (a survival
                                function, one point a decade; ``lrstab admit`` plots it)
``mismatch/n_tokens``           response tokens the figures cover (global)
``mismatch/n_nonfinite``        response tokens whose ``d`` is NaN/inf, left out of the above
==============================  ============================================================

Designed for data parallelism: :func:`compute_stats` turns one rank's batch into one small
float64 tensor of sums and counts (plus the max), :func:`all_reduce_or_none` reduces it over the
DP group (SUM, and MAX for the max, in one collective: :mod:`verl_lrstab.collective`; every rank
calls it, a rank that cannot measure with None),
:func:`finalize` turns it into the dict above. All
means are token- (or sequence-) weighted over the whole global batch.

Layouts: padded ``(bs, T)`` tensors (verl's V0 trainer, and the driver in V1), verl's jagged
nested tensors (the V1 worker batch), or flat 1-D values with ``offsets``.

In verl's bypass mode ``old_log_probs`` is ``rollout_log_probs`` (exact zeros here); the
trainer's own log-probs of the first mini-batch, from the loss's forward before any optimizer
step, take their place (:func:`capture_first_mini_batch`, :class:`FirstMiniBatchCapture`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Optional

import torch

from verl_lrstab.collective import all_reduce_or_none, collective_device
from verl_lrstab.dataclass_reader import is_integer, is_number

logger = logging.getLogger("verl_lrstab")

#: Default for ``threshold``: ``|d| > log 2`` means the two engines' probabilities of the
#: token differ by more than 2x, i.e. the token-level importance ratio leaves [0.5, 2], the
#: band verl's default ``rollout_is_threshold=2.0`` (TIS cap) and the IcePop ``0.5_...``
#: lower bound act on. The fraction is the share of tokens such corrections would touch.
DEFAULT_THRESHOLD = math.log(2.0)

#: Layout of the stats tensor. The first ``_N_SUM`` entries are reduced with SUM, the last
#: one (``max_abs``) with MAX. ``sum_seq_k1`` / ``sum_seq_k3`` need no entry of their own: the
#: sum over sequences of per-sequence sums is the token sum, so seq figures are sums / n_seqs.
#: ``|d|`` edges of the tail shares: one a decade from 1e-6 (fp32 vs fp32 rounding) to 1 (a token
#: 2.7x likelier in one engine); the labels are the metric keys' suffixes.
TAIL_EDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
TAIL_LABELS = ("1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "0.1", "1")
STAT_FIELDS = ("sum_k1", "sum_k3", "n_tokens", "n_seqs", "n_over_threshold", "n_nonfinite",
               *(f"n_over_{label}" for label in TAIL_LABELS), "max_abs")
_N_SUM = len(STAT_FIELDS) - 1

__all__ = [
    "BYPASS_KEY",
    "DEFAULT_THRESHOLD",
    "FirstMiniBatchCapture",
    "STAT_FIELDS",
    "TAIL_EDGES",
    "TAIL_LABELS",
    "compute_stats",
    "covers_tokens",
    "all_reduce_or_none",
    "capture_first_mini_batch",
    "collective_device",
    "finalize",
    "mismatch_metrics",
    "warn_once",
]

#: One-time warnings for the glue (see :func:`warn_once`).
WARNINGS = {
    "missing": (
        "verl_lrstab: the batch has no rollout log-probs (`rollout_log_probs`), so no mismatch/* "
        "figures are logged. Set actor_rollout_ref.rollout.calculate_log_probs=true to log them."
    ),
    "bypass": (
        "verl_lrstab: old_log_probs equal rollout_log_probs bit for bit on every response token: "
        "algorithm.rollout_correction.bypass_mode=true (the trainer reuses the rollout's log-probs), where "
        "their difference is 0 by construction, not a measurement. mismatch/* now compares the trainer's own log-probs from the forward of the first mini-batch "
        "(before the optimizer step) with rollout_log_probs; mismatch/n_tokens counts that mini-batch's "
        "tokens and mismatch/bypass_mode is 1."
    ),
    "bypass_failed": (
        "verl_lrstab: bypass mode: the trainer's log-probs of the first mini-batch could not be read, so "
        "no mismatch/* figures are logged this step (old_log_probs vs rollout_log_probs is 0 by construction)."
    ),
    "bypass_late": (
        "verl_lrstab: bypass mode: the first optimizer step of the update was not seen (skipped for a "
        "non-finite gradient norm, or an optimizer without step hooks), so this step's mismatch/* figures "
        "are logged but the mismatch trigger skips them."
    ),
}
_warned: set = set()


def compute_stats(
    old_log_probs: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    threshold: float = DEFAULT_THRESHOLD,
    offsets: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """One rank's sums and counts, as a float64 tensor laid out as :data:`STAT_FIELDS`.

    Args:
        old_log_probs: the trainer's log-probs of the sampled tokens (verl ``old_log_probs``):
            padded ``(bs, T)``, a jagged nested tensor, or flat 1-D values with ``offsets``.
        rollout_log_probs: the rollout engine's log-probs (verl ``rollout_log_probs``), same
            layout and shape. None or an empty tensor (while ``old_log_probs`` is not) means the
            rollout returned none: the result is None, so nothing is logged. Equal values (verl's
            bypass mode, even the same tensor) give exact zeros, which the glue recognises
            (:func:`verl_lrstab.glue.batch_figures.shows_bypass_mode`).
        response_mask: non-zero on the response tokens to count, same layout and shape. Values
            at other positions (padding) are ignored even when NaN/inf.
        threshold: ``|d|`` above which a token counts in ``n_over_threshold``; >= 0.
            Default :data:`DEFAULT_THRESHOLD` (log 2).
        offsets: for flat 1-D inputs only, the ``(n_seqs + 1,)`` sequence boundaries (as
            ``nested.offsets()``); without it a 1-D input is one sequence.

    Returns:
        A ``(len(STAT_FIELDS),)`` float64 tensor on the inputs' device, or None.
        A batch with no response token gives zeros (not None), so every DP rank still joins
        the collective in :func:`all_reduce_or_none`.

    One elementwise pass: beyond the inputs it allocates two float tensors of the input size
    (``d`` and ``|d|``, the latter reused for k3), the int64 decade index of ``|d|`` (the tail
    shares: one ``bucketize`` and a ``bincount``) and a few bool tensors; no float64 upcast
    (bf16/fp16 inputs are computed in float32). k3 uses ``expm1(d) - d``, accurate in float32
    for the small ``d`` (1e-4..1e-2) typical of bf16 vs fp32, where ``exp(d) - 1 - d`` cancels.
    """
    if rollout_log_probs is None or old_log_probs is None:
        return None
    if not (is_number(threshold) and threshold >= 0):
        raise ValueError(f"mismatch threshold must be a number >= 0, got {threshold!r}")
    old, roll, mask, offsets = _as_values(old_log_probs, rollout_log_probs, response_mask, offsets)
    if roll.numel() == 0 and old.numel() != 0:
        return None
    device = old.device
    roll, mask = roll.to(device), mask.to(device)  # no-ops when already there (the usual case)
    mask = mask if mask.dtype == torch.bool else mask != 0

    dtype = torch.promote_types(old.dtype, roll.dtype)
    if not dtype.is_floating_point or dtype.itemsize < 4:
        dtype = torch.float32
    d = torch.sub(old.to(dtype), roll.to(dtype))  # .to is a no-op for float32 inputs
    valid = torch.isfinite(d)
    valid &= mask
    d.masked_fill_(~valid, 0.0)  # masked/non-finite -> 0: where, not mask-multiply (NaN * 0 = NaN)
    n_mask = mask.sum()
    n_tokens = valid.sum()

    a = d.abs()
    max_abs = a.max() if a.numel() else a.new_zeros(())  # masked are 0, the identity of max(|d|)
    n_over = torch.count_nonzero(a > threshold)
    n_over_edges = _tail_counts(a)
    sum_k1 = 0.0 - d.sum()  # not -d.sum(): equal log-probs give k1 = 0.0, not -0.0
    k3 = torch.expm1(d, out=a).sub_(d)  # reuses |d|'s buffer; exactly 0 where d == 0
    sum_k3 = k3.sum()

    n_seqs = _count_sequences(valid, offsets)
    parts = (sum_k1, sum_k3, n_tokens, n_seqs, n_over, n_mask - n_tokens)
    return torch.cat([torch.stack([p.to(torch.float64) for p in parts]), n_over_edges.to(torch.float64),
                      max_abs.to(torch.float64).reshape(1)])


def finalize(stats: Optional[torch.Tensor], prefix: str = "mismatch/") -> Optional[dict]:
    """Turn (global) stats into the ``mismatch/*`` figures.

    Args:
        stats: the tensor from :func:`compute_stats` (after :func:`all_reduce_or_none` for DP).
        prefix: key prefix. Default ``"mismatch/"``.

    Returns:
        ``{prefix + name: float}``, or None when ``stats`` is None, covers no response token,
        or holds NaN counts: nothing to log, no fake zeros. (A rank that could not measure
        makes the all-reduce give None on every rank: :func:`all_reduce_or_none`.) Keys: k1, k3,
        seq_k1, seq_k3, max_abs_diff, frac_over_thr, frac_over_<e> (:data:`TAIL_LABELS`), n_tokens,
        n_nonfinite.
    """
    if stats is None or not covers_tokens(stats):
        return None
    s = dict(zip(STAT_FIELDS, stats.tolist()))
    n_tokens, n_seqs = s["n_tokens"], s["n_seqs"]
    return {
        prefix + "k1": s["sum_k1"] / n_tokens,
        prefix + "k3": s["sum_k3"] / n_tokens,
        prefix + "seq_k1": s["sum_k1"] / n_seqs,
        prefix + "seq_k3": s["sum_k3"] / n_seqs,
        prefix + "max_abs_diff": s["max_abs"],
        prefix + "frac_over_thr": s["n_over_threshold"] / n_tokens,
        **{f"{prefix}frac_over_{label}": s[f"n_over_{label}"] / n_tokens for label in TAIL_LABELS},
        prefix + "n_tokens": n_tokens,
        prefix + "n_nonfinite": s["n_nonfinite"],
    }


def mismatch_metrics(
    old_log_probs: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    threshold: float = DEFAULT_THRESHOLD,
    offsets: Optional[torch.Tensor] = None,
) -> Optional[dict]:
    """Single-process convenience: ``finalize(compute_stats(...))``. Args as :func:`compute_stats`."""
    return finalize(compute_stats(old_log_probs, rollout_log_probs, response_mask, threshold, offsets))


def warn_once(reason: str) -> None:
    """Log the warning for ``reason`` (a key of :data:`WARNINGS`) once per process."""
    if reason not in WARNINGS:
        raise ValueError(f"unknown warning reason {reason!r}; allowed: {sorted(WARNINGS)}")
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(WARNINGS[reason])


# -- bypass mode: the trainer's log-probs from the loss's own forward ----------------------------
#: Extra key logged (value 1.0) when the figures come from the first mini-batch's forward.
BYPASS_KEY = "mismatch/bypass_mode"

#: ``view(model_output, data) -> (log_probs, rollout_log_probs, response_mask, n_sequences)``:
#: the trainer's and the rollout's log-probs of one micro-batch in one layout, its mask and size.
View = Callable[..., tuple]


@contextlib.contextmanager
def capture_first_mini_batch(owner, n_sequences: int, view: View, optimizer=None, group=None,
                             on_reduced: Optional[Callable[[Optional[torch.Tensor]], None]] = None,
                             loss_attr: str = "loss_fn"):
    """Within the block, ``owner.<loss_attr>`` (verl's ``TrainingWorker.loss_fn``) feeds a capture.

    In bypass mode the trainer still computes its own log-probs of the sampled tokens, for the loss:
    an update's first mini-batch runs its forward before any optimizer step, with the weights the
    rollout sampled with. No extra forward pass: the capture reads what the loss gets.

    Args:
        owner: the object whose loss function the engine reads (verl reads ``worker.loss_fn``
            for every mini-batch); restored on exit, also on an exception.
        n_sequences, view: as :class:`FirstMiniBatchCapture` / :meth:`~FirstMiniBatchCapture.wrap_loss`.
        optimizer: a torch optimizer: the stats are all-reduced at its first ``step()``
            (:meth:`~FirstMiniBatchCapture.optimizer_pre_hook`). Without one (or if no step
            happened: verl skips it for a non-finite grad norm on every rank alike) they are
            all-reduced on leaving the block, with a warning: after verl's LR scheduler stepped.
        group: the DP group.
        on_reduced: called once with the global stats (:meth:`~FirstMiniBatchCapture.reduce`) when
            they are reduced, at the step or on leaving the block.

    Yields:
        The :class:`FirstMiniBatchCapture`; its :meth:`~FirstMiniBatchCapture.metrics` after the block.
    """
    capture = FirstMiniBatchCapture(n_sequences)
    loss_fn = getattr(owner, loss_attr)
    handle = None
    reduce_at_step = capture.optimizer_pre_hook(group, on_reduced)
    setattr(owner, loss_attr, capture.wrap_loss(loss_fn, view))
    try:
        if hasattr(optimizer, "register_step_pre_hook"):
            handle = optimizer.register_step_pre_hook(reduce_at_step)
        yield capture
    finally:
        setattr(owner, loss_attr, loss_fn)
        if handle is not None:
            handle.remove()
    if not capture.reduced:  # no optimizer step was seen: reduce now, late (the scheduler already stepped)
        warn_once("bypass_late")
        reduce_at_step(optimizer, (), {})


class FirstMiniBatchCapture:
    """Mismatch sums of the first ``n_sequences`` sequences the loss sees on this rank.

    The loss function, wrapped by :meth:`wrap_loss`, hands every micro-batch's log-probs to
    :meth:`add_micro_batch` until the rank's first mini-batch is seen; :meth:`reduce` all-reduces the sums
    over the DP group once (every rank at the same point: the first optimizer step, see
    :meth:`optimizer_pre_hook`, or after the update); :meth:`metrics` gives the ``mismatch/*`` figures.

    Args:
        n_sequences: the rank's first mini-batch size (sequences); micro-batches are counted
            until it is reached, later ones are not looked at. >= 1.
        threshold: as :func:`compute_stats`.

    A failure inside :meth:`add_micro_batch` never reaches the loss: the rank then joins :meth:`reduce`
    as a rank that could not measure (:func:`verl_lrstab.collective.all_reduce_or_none`), so every
    rank ends with no figures (None) rather than a partial one.
    """

    def __init__(self, n_sequences: int, threshold: float = DEFAULT_THRESHOLD):
        if not is_integer(n_sequences) or n_sequences < 1:
            raise ValueError(f"n_sequences must be an integer >= 1, got {n_sequences!r}")
        self.n_sequences = n_sequences
        self.threshold = threshold
        self.seen = 0  # sequences observed
        self.stats: Optional[torch.Tensor] = None  # local sums (STAT_FIELDS)
        self.failed: Optional[BaseException] = None
        self.global_stats: Optional[torch.Tensor] = None  # after reduce()
        self.reduced = False

    @property
    def complete(self) -> bool:
        """The whole first mini-batch was observed (or the stats are already reduced)."""
        return self.reduced or self.seen >= self.n_sequences

    def add_micro_batch(self, log_probs, rollout_log_probs, response_mask, n_sequences: int) -> bool:
        """Add one micro-batch, unless the first mini-batch is complete. Returns whether it was added.

        The tensors are as :func:`compute_stats` takes them (``log_probs`` may require grad: it is
        read detached). Never raises.
        """
        if self.complete:
            return False
        self.seen += int(n_sequences)
        if self.failed is not None:
            return True
        try:
            with torch.no_grad():
                stats = compute_stats(log_probs.detach(), rollout_log_probs, response_mask, self.threshold)
            if stats is None:
                raise ValueError("the micro-batch has no rollout log-probs")
            self.stats = stats if self.stats is None else _combine(self.stats, stats)
        except Exception as exc:  # noqa: BLE001 - a metric must never fail the training step
            self.failed = exc
            logger.warning("verl_lrstab: could not compute the bypass-mode mismatch figures (%r); "
                           "none logged this step", exc)
        return True

    def reduce(self, group=None) -> Optional[torch.Tensor]:
        """All-reduce the sums over ``group`` (every rank calls it once; later calls are no-ops).

        Returns the global stats, or None: some rank could not measure, or the first mini-batch
        held no response token (no figures rather than zeros, as :func:`finalize`).
        """
        if self.reduced:
            return self.global_stats
        n = len(STAT_FIELDS)
        if self.failed is not None:
            local = None  # every rank then gets None (collective.all_reduce_or_none)
        elif self.stats is None:
            local = torch.zeros(n, dtype=torch.float64)
        else:
            local = self.stats.detach().to(torch.float64).cpu()
        reduced = all_reduce_or_none(local, n, n_max=1, group=group)
        self.global_stats = reduced if covers_tokens(reduced) else None
        self.reduced = True
        return self.global_stats

    def metrics(self) -> Optional[dict]:
        """The global ``mismatch/*`` figures plus ``mismatch/bypass_mode: 1.0``; None if nothing was measured."""
        figures = finalize(self.global_stats)
        return None if figures is None else {**figures, BYPASS_KEY: 1.0}

    # -- the two places it plugs into ------------------------------------------------------------
    def wrap_loss(self, loss_fn: Callable, view: View) -> Callable:
        """``loss_fn`` that also observes each micro-batch; verl's loss and its result are untouched.

        Calls without ``model_output`` (verl also passes the loss function as a logits
        processor) go straight through.
        """

        def loss_with_capture(*args, **kwargs):
            result = loss_fn(*args, **kwargs)
            if not self.complete and self.failed is None and "model_output" in kwargs and "data" in kwargs:
                try:
                    log_probs, rollout_log_probs, response_mask, n = view(kwargs["model_output"], kwargs["data"])
                except Exception as exc:  # noqa: BLE001 - a metric must never fail the training step
                    self.failed = exc
                    logger.warning("verl_lrstab: could not read the micro-batch for the bypass-mode figures (%r)", exc)
                    return result
                self.add_micro_batch(log_probs, rollout_log_probs, response_mask, n)
            return result

        setattr(loss_with_capture, "__wrapped__", loss_fn)  # inspect.unwrap and verl see the loss it wraps
        return loss_with_capture

    def optimizer_pre_hook(self, group=None, on_reduced: Optional[Callable[[Optional[torch.Tensor]], None]] = None):
        """A ``torch.optim.Optimizer.register_step_pre_hook`` hook: reduce at the first optimizer step.

        Every DP rank steps its optimizer at the same point, after the first mini-batch's
        forward/backward and before the LR scheduler steps; ``on_reduced(global stats)`` can hand
        the figure to the scheduler there. Later steps do nothing.
        """

        def hook(optimizer, args, kwargs):
            if not self.reduced:
                stats = self.reduce(group)
                if on_reduced is not None:
                    on_reduced(stats)
            return None

        return hook


# -- helpers --------------------------------------------------------------------------------
def _as_values(old, roll, mask, offsets):
    """Reduce the three inputs to same-shape dense tensors (+ offsets for jagged/flat ones)."""
    nested = [t.is_nested for t in (old, roll, mask)]
    if any(nested):
        if not all(nested):
            raise ValueError(
                "old_log_probs, rollout_log_probs and response_mask must all be nested or all be "
                f"dense tensors, got is_nested={nested}"
            )
        if offsets is not None:
            raise ValueError("offsets must not be given with nested tensors (they carry their own)")
        offs = [t.offsets() for t in (old, roll, mask)]
        if not (torch.equal(offs[0], offs[1].to(offs[0].device)) and torch.equal(offs[0], offs[2].to(offs[0].device))):
            raise ValueError("old_log_probs, rollout_log_probs and response_mask have different sequence lengths")
        return old.values(), roll.values(), mask.values(), offs[0]
    if roll.numel() == 0 and old.numel() != 0:
        return old, roll, mask, offsets
    if not (old.shape == roll.shape == mask.shape):
        raise ValueError(
            "old_log_probs, rollout_log_probs and response_mask must have the same shape, got "
            f"{tuple(old.shape)}, {tuple(roll.shape)}, {tuple(mask.shape)}"
        )
    if offsets is not None and old.dim() != 1:
        raise ValueError(f"offsets is for flat 1-D inputs, got {old.dim()}-D tensors")
    if old.dim() not in (1, 2):
        raise ValueError(f"expected (bs, T) or flat 1-D tensors, got shape {tuple(old.shape)}")
    return old, roll, mask, offsets


def _tail_counts(abs_d: torch.Tensor) -> torch.Tensor:
    """Tokens with ``|d| > e`` for each e of :data:`TAIL_EDGES` (masked tokens are 0: in none)."""
    edges = torch.tensor(TAIL_EDGES, dtype=abs_d.dtype, device=abs_d.device)
    decade = torch.bucketize(abs_d.reshape(-1), edges)  # i: edges[i-1] < |d| <= edges[i]
    per_decade = torch.bincount(decade, minlength=len(TAIL_EDGES) + 1)
    # |d| > edges[k]  <=>  decade >= k + 1: the counts above each edge, largest edge last
    return per_decade.flip(0).cumsum(0).flip(0)[1:]


def _count_sequences(valid: torch.Tensor, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """Sequences with at least one counted token."""
    if valid.dim() == 2:
        return valid.any(dim=-1).sum()
    if offsets is None:
        return valid.any().to(torch.int64)
    # Per-segment counts from an int32 prefix sum (exact; ~3x faster than segment_reduce on CPU).
    csum = torch.zeros(valid.numel() + 1, dtype=torch.int32, device=valid.device)
    torch.cumsum(valid, 0, dtype=torch.int32, out=csum[1:])
    offsets = offsets.to(device=valid.device, dtype=torch.int64)
    return (csum[offsets[1:]] > csum[offsets[:-1]]).sum()


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two ranks' or micro-batches' stats as one: SUM of the counts and sums, MAX of the max."""
    return torch.cat([a[:_N_SUM] + b[:_N_SUM], torch.maximum(a[_N_SUM:], b[_N_SUM:])])


def covers_tokens(stats: Optional[torch.Tensor]) -> bool:
    """Stats that give figures: some response token, a finite count."""
    if stats is None:
        return False
    n_tokens = stats[STAT_FIELDS.index("n_tokens")].item()
    return n_tokens > 0 and math.isfinite(n_tokens)
