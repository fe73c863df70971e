"""Mismatch figures in verl's bypass mode, from the trainer's own forward of the first mini-batch.

With ``algorithm.rollout_correction.bypass_mode=true`` verl uses the rollout engine's log-probs as
the PPO old log-probs and skips the trainer's recompute, so ``old_log_probs == rollout_log_probs``
and the usual comparison (:mod:`verl_lrstab.mismatch`) is 0 by construction. The trainer still
computes its own log-probs of the same tokens, for the loss: the forward of the first mini-batch
of each update runs before any optimizer step, with the weights the rollout sampled with.

:class:`FirstMiniBatchCapture` collects those: the loss function, wrapped by :meth:`wrap_loss`,
hands every micro-batch's log-probs to :meth:`observe` until the first ``n_sequences`` sequences
(the rank's first mini-batch) are seen; :meth:`reduce` all-reduces the sums over the DP group once
(every rank at the same point: the first optimizer step, see :meth:`optimizer_pre_hook`, or after
the update); :meth:`metrics` gives the ``mismatch/*`` figures. No extra forward pass: it reads
what the loss already gets. Pure torch; the verl-specific view of a micro-batch is passed in.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Optional

import torch

from verl_lrstab import mismatch
from verl_lrstab.collective import all_reduce_or_none

logger = logging.getLogger("verl_lrstab")

__all__ = ["BYPASS_KEY", "FirstMiniBatchCapture", "capture_first_mini_batch", "is_bypass"]

_N_TOKENS = mismatch.STAT_FIELDS.index("n_tokens")  # (the last field is max_abs)

#: Extra key logged (value 1.0) when the figures come from the first mini-batch's forward.
BYPASS_KEY = "mismatch/bypass_mode"

#: ``view(model_output, data) -> (log_probs, rollout_log_probs, response_mask, n_sequences)``:
#: the trainer's and the rollout's log-probs of one micro-batch in one layout, its mask and size.
View = Callable[..., tuple]


def is_bypass(figures) -> bool:
    """True when the usual figures show verl's bypass mode: trainer and rollout log-probs equal bit for bit.

    Args:
        figures: the global ``mismatch/*`` figures of ``old_log_probs`` vs ``rollout_log_probs``
            (:func:`verl_lrstab.mismatch.finalize` after the DP all-reduce), or the global stats
            tensor itself, or None.

    Two real engines never agree on every token to the last bit (fp32 vs fp32 with other batch
    shapes differs by ~1e-7); bypass mode (old_log_probs := rollout_log_probs) always does.
    Every rank holds the same global figures, so every rank takes the same branch.
    """
    if isinstance(figures, torch.Tensor):
        n_tokens, max_abs = figures[_N_TOKENS].item(), figures[-1].item()
        return math.isfinite(n_tokens) and n_tokens > 0 and max_abs == 0.0
    return bool(figures) and figures["mismatch/n_tokens"] > 0 and figures["mismatch/max_abs_diff"] == 0.0


@contextlib.contextmanager
def capture_first_mini_batch(owner, n_sequences: int, view: View, optimizer=None, group=None,
                             on_reduced: Optional[Callable[[Optional[dict]], None]] = None, loss_attr: str = "loss_fn"):
    """Within the block, ``owner.<loss_attr>`` (verl's ``TrainingWorker.loss_fn``) feeds a capture.

    Args:
        owner: the object whose loss function the engine reads (verl reads ``worker.loss_fn``
            for every mini-batch); restored on exit, also on an exception.
        n_sequences, view: as :class:`FirstMiniBatchCapture` / :meth:`~FirstMiniBatchCapture.wrap_loss`.
        optimizer: a torch optimizer: the figures are all-reduced at its first ``step()``
            (:meth:`~FirstMiniBatchCapture.optimizer_pre_hook`). Without one (or if no step
            happened: verl skips it for a non-finite grad norm on every rank alike) they are
            all-reduced on leaving the block, with a warning: after verl's LR scheduler stepped.
        group: the DP group.
        on_reduced: called once with :meth:`~FirstMiniBatchCapture.metrics` (or None) when the
            figures are reduced, at the step or on leaving the block.

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
        mismatch.warn_once("bypass_late")
        reduce_at_step(optimizer, (), {})


class FirstMiniBatchCapture:
    """Mismatch sums of the first ``n_sequences`` sequences the loss sees on this rank.

    Args:
        n_sequences: the rank's first mini-batch size (sequences); micro-batches are counted
            until it is reached, later ones are not looked at. >= 1.
        threshold: as :func:`verl_lrstab.mismatch.compute_stats`.

    A failure inside :meth:`observe` never reaches the loss: the rank then joins :meth:`reduce`
    as a rank that could not measure (:func:`verl_lrstab.collective.all_reduce_or_none`), so every
    rank ends with no figures (None) rather than a partial one.
    """

    def __init__(self, n_sequences: int, threshold: float = mismatch.DEFAULT_THRESHOLD):
        if not isinstance(n_sequences, int) or isinstance(n_sequences, bool) or n_sequences < 1:
            raise ValueError(f"n_sequences must be an integer >= 1, got {n_sequences!r}")
        self.n_sequences = n_sequences
        self.threshold = threshold
        self.seen = 0  # sequences observed
        self.stats: Optional[torch.Tensor] = None  # local sums (mismatch.STAT_FIELDS)
        self.failed: Optional[BaseException] = None
        self.global_stats: Optional[torch.Tensor] = None  # after reduce()
        self._figures: Optional[dict] = None  # mismatch/* of global_stats, after reduce()
        self.reduced = False

    @property
    def complete(self) -> bool:
        """The whole first mini-batch was observed (or the figures are already reduced)."""
        return self.reduced or self.seen >= self.n_sequences

    def observe(self, log_probs, rollout_log_probs, response_mask, n_sequences: int) -> bool:
        """Add one micro-batch, unless the first mini-batch is complete. Returns whether it was added.

        The tensors are as :func:`verl_lrstab.mismatch.compute_stats` takes them (``log_probs``
        may require grad: it is read detached). Never raises.
        """
        if self.complete:
            return False
        self.seen += int(n_sequences)
        if self.failed is not None:
            return True
        try:
            with torch.no_grad():
                stats = mismatch.compute_stats(log_probs.detach(), rollout_log_probs, response_mask, self.threshold)
            if stats is None:
                raise ValueError("the micro-batch has no rollout log-probs")
            self.stats = stats if self.stats is None else _combine(self.stats, stats)
        except Exception as exc:  # noqa: BLE001 - a metric must never fail the training step
            self.failed = exc
            logger.warning("verl_lrstab: could not compute the bypass-mode mismatch figures (%r); "
                           "none logged this step", exc)
        return True

    def reduce(self, group=None) -> Optional[torch.Tensor]:
        """All-reduce the sums over ``group`` (every rank calls it once; later calls are no-ops)."""
        if self.reduced:
            return self.global_stats
        n = len(mismatch.STAT_FIELDS)
        if self.failed is not None:
            local = None  # every rank then gets None (collective.all_reduce_or_none)
        elif self.stats is None:
            local = torch.zeros(n, dtype=torch.float64)
        else:
            local = self.stats.detach().to(torch.float64).cpu()
        self.global_stats = all_reduce_or_none(local, n, n_max=1, group=group)
        self.reduced = True
        self._figures = mismatch.finalize(self.global_stats)
        if self._figures is not None:
            self._figures[BYPASS_KEY] = 1.0
        return self.global_stats

    def metrics(self) -> Optional[dict]:
        """The global ``mismatch/*`` figures plus ``mismatch/bypass_mode: 1.0``; None if nothing was measured."""
        return None if self._figures is None else dict(self._figures)

    def reduce_and_report(self, group=None, on_reduced: Optional[Callable[[Optional[dict]], None]] = None) -> None:
        """:meth:`reduce`, then ``on_reduced(figures)`` (:meth:`metrics`) if given."""
        self.reduce(group)
        if on_reduced is not None:
            on_reduced(None if self._figures is None else dict(self._figures))

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
                self.observe(log_probs, rollout_log_probs, response_mask, n)
            return result

        loss_with_capture.__wrapped__ = loss_fn
        return loss_with_capture

    def optimizer_pre_hook(self, group=None, on_reduced: Optional[Callable[[Optional[dict]], None]] = None):
        """A ``torch.optim.Optimizer.register_step_pre_hook`` hook: reduce at the first optimizer step.

        Every DP rank steps its optimizer at the same point, after the first mini-batch's
        forward/backward and before the LR scheduler steps; ``on_reduced(figures)`` can hand
        the figures to the scheduler there. Later steps do nothing.
        """

        def hook(optimizer, args, kwargs):
            if not self.reduced:
                self.reduce_and_report(group, on_reduced)
            return None

        return hook


def _combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two ranks' or micro-batches' stats as one: SUM of the counts and sums, MAX of the max."""
    k = len(mismatch.STAT_FIELDS) - 1
    return torch.cat([a[:k] + b[:k], torch.maximum(a[k:], b[k:])])
