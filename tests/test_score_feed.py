"""The score co-signal of ``detector: cusum``: what the worker glue feeds equals verl's ``critic/score/mean``."""

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab.glue.batch_figures import BatchStats, measure_batch, sequence_scores
from verl_lrstab.glue.steps import StepState
from test_glue import RESPONSE_LENS, padded_batch

SCORES = [1.0, 0.0, 0.5, 1.0]  # one per sample, on its last response token (as verl's reward managers put it)


def _scored(padded):
    token_level = torch.zeros_like(padded["old_log_probs"])
    for i, (n, score) in enumerate(zip(RESPONSE_LENS, SCORES)):
        token_level[i, max(n - 1, 0)] = score
    padded = dict(padded, prompts=padded["input_ids"][:, :6], token_level_scores=token_level, token_level_rewards=token_level.clone(),
                  advantages=torch.zeros_like(token_level), returns=torch.zeros_like(token_level))
    return padded


def test_v0_score_equals_verls_critic_score_mean():
    padded = _scored(padded_batch())
    proto = DataProto.from_dict(tensors=padded)
    verl_mean = compute_data_metrics(proto, use_critic=False)["critic/score/mean"]
    worker_batch = left_right_2_no_padding(DataProto.from_dict(tensors=padded).to_tensordict())
    total, count = measure_batch(worker_batch).score
    assert count == 3  # the aborted (empty) response is left out, as verl leaves it out
    assert total / count == pytest.approx(float(verl_mean)) == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_v1_jagged_rm_scores_sum_per_sample_and_leave_out_padding_samples():
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    padded = _scored(padded_batch())
    rows = range(len(RESPONSE_LENS))
    jag = lambda key, extra=(): torch.nested.as_nested_tensor(  # noqa: E731
        [padded[key][i, :RESPONSE_LENS[i]] for i in rows] + list(extra), layout=torch.jagged)
    sample = {"responses": padded["responses"][0, :RESPONSE_LENS[0]], "prompts": padded["input_ids"][0, :6],
              "input_ids": padded["input_ids"][0], "attention_mask": padded["attention_mask"][0],
              "position_ids": padded["position_ids"][0], "response_mask": padded["response_mask"][0, :RESPONSE_LENS[0]],
              "rm_scores": padded["token_level_scores"][0, :RESPONSE_LENS[0]]}
    pad, _ = construct_minimal_padding_template(sample, {}, eos_token_id=2)
    pad_score = torch.full_like(pad["responses"], 7, dtype=torch.float32)  # would show if counted
    data = tu.get_tensordict({"responses": jag("responses", [pad["responses"]]),
                              "response_mask": jag("response_mask", [pad["response_mask"]]),
                              "rm_scores": jag("token_level_scores", [pad_score])})
    # the aborted (empty) response has no token to hold a score, and verl's critic/score/* leave it out
    assert sequence_scores(data).tolist() == pytest.approx([s if n > 0 else 0.0 for s, n in zip(SCORES, RESPONSE_LENS)])
    expected = [s for s, n in zip(SCORES, RESPONSE_LENS) if n > 0]
    total, count = measure_batch(data).score
    assert (total, count) == (pytest.approx(sum(expected)), len(expected))


def test_batch_without_scores_gives_none_and_the_step_runs_on_the_length(caplog):
    data = left_right_2_no_padding(DataProto.from_dict(tensors=padded_batch()).to_tensordict())
    stats = measure_batch(data).score
    assert stats is None
    state = StepState()
    state.add_batch(BatchStats([10.0, 2.0], stats, None))
    assert state.figures("k3", False)[0].score is None


def test_the_step_state_averages_the_score_over_a_trainer_steps_updates():
    state = StepState()
    score = lambda: state.figures("k3", False)[0].score  # noqa: E731
    add = lambda s: state.add_batch(BatchStats([10.0, 4.0], s, None))  # noqa: E731
    add([3.0, 4.0])
    add([1.0, 4.0])
    assert score() == pytest.approx(0.5)
    add(None)  # one update without a score: no score for the step
    assert score() is None
    state.reset_batch()
    assert score() is None
    add([2.0, 4.0])  # the next trainer step has its score again
    assert score() == pytest.approx(0.5)
