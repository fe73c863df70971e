"""The detector's entropy co-signal in training: the per-token entropy verl's old-log-prob pass already returns
(its driver logs ``actor/entropy`` from it, then drops it before the update) reaches the detector; no extra pass.

The batch is built as verl's driver builds it (left-padded prompts, right-padded responses, a response mask),
converted with verl's own ``left_right_2_no_padding``; the engine's entropy output is a jagged tensor over each
sequence's tokens, the response's values one position earlier (the model predicts token t at t - 1). The
expected means are computed by hand from the response values and the mask.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.detectors import UpdateFigures

PROMPT_W, RESP_W = 4, 5
PROMPT_LENS = [3, 4, 2]
RESP_LENS = [5, 2, 4]
# each sequence's response entropies (its first RESP_LENS[i] count; the rest is padding)
RESPONSE_ENTROPY = [[1.0, 2.0, 3.0, 4.0, 5.0], [0.5, 1.5, 9.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0, 9.0]]
# the response mask also drops a token inside sequence 2's response (position 3, value 6.0)
MASK = [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
EXPECTED = (1 + 2 + 3 + 4 + 5 + 0.5 + 1.5 + 2 + 2 + 2) / 10


def driver_batch():
    """verl's driver-side batch after ``left_right_2_no_padding`` (as ``_compute_old_log_prob`` sends it)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    n = len(PROMPT_LENS)
    attention = torch.zeros(n, PROMPT_W + RESP_W, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESP_LENS)):
        attention[i, PROMPT_W - p:PROMPT_W] = 1
        attention[i, PROMPT_W:PROMPT_W + r] = 1
    input_ids = torch.arange(n * (PROMPT_W + RESP_W)).reshape(n, -1) % 50 + 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict({"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
                       "prompts": input_ids[:, :PROMPT_W], "responses": input_ids[:, PROMPT_W:],
                       "response_mask": torch.tensor(MASK, dtype=torch.long)}, batch_size=[n])
    return left_right_2_no_padding(data)


def engine_entropy(poison: float = 1000.0):
    """The old-log-prob pass's ``entropy`` output: one value per token of each sequence (prompt + response);
    the response's token j at position prompt_len - 1 + j; everything else a value that would show."""
    seqs = []
    for p, r, values in zip(PROMPT_LENS, RESP_LENS, RESPONSE_ENTROPY):
        seq = torch.full((p + r,), poison)
        seq[p - 1:p - 1 + r] = torch.tensor(values[:r])
        seqs.append(seq)
    return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)


def verl_output(entropy):
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(tensor_dict={"entropy": entropy, "log_probs": entropy.clone()}, non_tensor_dict={})


def test_the_stats_are_verls_masked_token_mean_of_the_response_entropy():
    from verl_lrstab.glue import update_metrics

    total, count = update_metrics.old_log_prob_entropy_stats(verl_output(engine_entropy()), driver_batch()).tolist()
    assert count == sum(map(sum, MASK))
    assert total / count == pytest.approx(EXPECTED, rel=1e-12)


def v1_batch():
    """V1's padding-free batch (TransferQueue fields): the response mask nested, one entry per response token."""
    from tensordict import TensorDict

    masks = [torch.tensor(m[:r], dtype=torch.long) for m, r in zip(MASK, RESP_LENS)]
    n = len(PROMPT_LENS)
    return TensorDict({"response_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged)}, batch_size=[n])


def test_v1s_nested_batch_gives_the_same_mean():
    from verl_lrstab.glue import update_metrics

    total, count = update_metrics.old_log_prob_entropy_stats(verl_output(engine_entropy()), v1_batch()).tolist()
    assert count == sum(map(sum, MASK)) and total / count == pytest.approx(EXPECTED, rel=1e-12)


def test_verls_own_driver_figure_agrees():
    """The same value verl's driver logs as actor/entropy (its agg_loss, token-mean) from the same output."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_lrstab.glue import update_metrics

    data = driver_batch()
    entropy = engine_entropy()
    verls = agg_loss(loss_mat=no_padding_2_padding(entropy, data).float(),
                     loss_mask=data["response_mask"].float(), loss_agg_mode="token-mean").item()
    total, count = update_metrics.old_log_prob_entropy_stats(verl_output(entropy), data).tolist()
    assert total / count == pytest.approx(verls, rel=1e-6)


def test_a_rank_without_outputs_or_without_entropy_adds_nothing():
    from verl.utils import tensordict_utils as tu

    from verl_lrstab.glue import update_metrics

    assert update_metrics.old_log_prob_entropy_stats(None, driver_batch()).tolist() == [0.0, 0.0]
    no_entropy = tu.get_tensordict(tensor_dict={"log_probs": engine_entropy()}, non_tensor_dict={})
    assert update_metrics.old_log_prob_entropy_stats(no_entropy, driver_batch()).tolist() == [0.0, 0.0]


def test_a_nan_token_is_left_out_not_spread():
    from verl_lrstab.glue import update_metrics

    seqs = list(engine_entropy().unbind())
    seqs[0] = seqs[0].clone()
    seqs[0][PROMPT_LENS[0] - 1] = float("nan")  # the first response token of sequence 0 (value 1.0)
    entropy = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    total, count = update_metrics.old_log_prob_entropy_stats(verl_output(entropy), driver_batch()).tolist()
    assert count == sum(map(sum, MASK)) - 1
    assert total / count == pytest.approx((EXPECTED * 10 - 1.0) / 9)


# -- the wrap: verl's pass runs unchanged; the old-log-prob pass's entropy reaches the detector ------------
def _scheduler():
    from verl_lrstab.scheduler import LengthSurgeLR

    return LengthSurgeLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), LengthSurgeConfig())


class Engine:
    def __init__(self, lr_scheduler):
        self.lr_scheduler = lr_scheduler


class Worker:
    """verl's TrainingWorker as far as the wrap reads it: ``infer_batch(data)`` returning the engine's output."""

    def __init__(self, lr_scheduler, output):
        self.engine, self.output, self.calls = Engine(lr_scheduler), output, 0

    def infer_batch(self, data):
        self.calls += 1
        return self.output


def _wrapped_worker(lr_scheduler, output):
    from verl_lrstab.glue import worker

    w = Worker(lr_scheduler, output)
    w.infer_batch = worker.make_infer_batch(Worker.infer_batch).__get__(w)
    return w


def _pass(calculate_entropy: bool, compute_loss: bool = False):
    from verl.utils import tensordict_utils as tu

    data = driver_batch()
    tu.assign_non_tensor(data, calculate_entropy=calculate_entropy, compute_loss=compute_loss)
    return data


def test_the_old_log_prob_pass_feeds_the_detector_at_the_steps_last_update():
    from verl.utils import tensordict_utils as tu

    from verl_lrstab.glue.update_metrics import finish_update
    from verl_lrstab.glue.steps import state_of

    sched = _scheduler()
    output = verl_output(engine_entropy())
    w = _wrapped_worker(sched, output)
    assert w.infer_batch(_pass(calculate_entropy=True)) is output and w.calls == 1  # verl's output, untouched
    assert state_of(sched).cosignals.entropy == pytest.approx(EXPECTED)
    sched.observe_update(UpdateFigures(response_length=300.0))
    sched.step()
    # the update's own entropy (bypass / calculate_entropy) gives way to the old-log-prob pass's, verl's actor/entropy
    update = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"actor/entropy_loss": [7.0]}})
    out = finish_update(sched, state_of(sched).cosignals, update, True, {})
    assert sched.schedule.detector.rows.co["entropy"] == [[1, pytest.approx(EXPECTED)]]
    assert tu.get(out, "metrics")["lrstab/entropy"] == [pytest.approx(EXPECTED)]
    assert state_of(sched).cosignals.entropy is None  # used once: a later step without the pass feeds no stale value


def test_without_an_old_log_prob_pass_the_updates_own_entropy_is_fed():
    from verl.utils import tensordict_utils as tu

    from verl_lrstab.glue.update_metrics import finish_update
    from verl_lrstab.glue.steps import state_of

    sched = _scheduler()
    sched.observe_update(UpdateFigures(response_length=300.0))
    sched.step()
    update = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"actor/entropy_loss": [0.8, 1.0]}})
    finish_update(sched, state_of(sched).cosignals, update, True, {})
    assert sched.schedule.detector.rows.co["entropy"] == [[1, pytest.approx(0.9)]]


@pytest.mark.parametrize("calculate_entropy, compute_loss", [(False, False), (True, True)])
def test_other_forward_passes_feed_nothing(calculate_entropy, compute_loss):
    # the reference pass (calculate_entropy=False, the actor's engine with its adapter off) and a loss pass
    from verl_lrstab.glue.steps import state_of

    sched = _scheduler()
    w = _wrapped_worker(sched, verl_output(engine_entropy()))
    w.infer_batch(_pass(calculate_entropy, compute_loss))
    assert state_of(sched).cosignals.entropy is None


def test_a_run_without_length_surge_goes_straight_to_verl():
    from torch.optim.lr_scheduler import LambdaLR

    stock = LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda s: 1.0)
    poisoned = object()  # anything our code would read from would fail
    w = _wrapped_worker(stock, poisoned)
    assert w.infer_batch(poisoned) is poisoned and w.calls == 1


def test_a_broken_output_never_fails_the_pass(caplog):
    from verl.utils import tensordict_utils as tu

    from verl_lrstab.glue.steps import state_of

    sched = _scheduler()
    bad = tu.get_tensordict(tensor_dict={"entropy": torch.ones(3, 2)}, non_tensor_dict={})  # not verl's layout
    w = _wrapped_worker(sched, bad)
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    assert w.infer_batch(_pass(calculate_entropy=True)) is bad
    assert state_of(sched).cosignals.entropy is None and "could not read the old-log-prob pass's entropy" in caplog.text
