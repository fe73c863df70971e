"""Multi-turn (agentic) batches: the detector reads the model's own tokens, on the batches verl builds.

The responses are built as verl's agent loop builds them (``AgentLoopOutput``: the model's turns and
the tool's answers concatenated, ``response_mask`` 1 on the model's tokens) and reach the glue in the
two layouts verl's trainers send to ``update_actor``: V1's jagged TensorDict (``AgentLoopOutput.as_dict``
collated by verl's ``list_of_dict_to_tensordict``, plus V1's synthetic padding samples) and V0's padded
DataProto (``left_right_2_no_padding`` of ``DataProto.to_tensordict``). The expected counts come from
the turn lists the responses were built from, never from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.metric_utils import _compute_response_info
from verl.trainer.ppo.padding_utils import construct_minimal_padding_template
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.glue.batch_figures import measure_batch, model_token_counts, response_lengths
from verl_lrstab.glue.steps import MODEL_TOKENS_KEY, GlueError, StepPosition, StepState, begin_update
from verl_lrstab.scheduler import LengthSurgeLR

PROMPT_WIDTH, RESPONSE_CAP = 6, 40

# Each response as turns: ("model", n) tokens the model sampled, ("tool", n) tokens of a tool's answer.
MULTI_TURN = [
    [("model", 5), ("tool", 12), ("model", 3)],
    [("model", 4)],  # answered without a tool
    [("model", 2), ("tool", 7), ("model", 6), ("tool", 7), ("model", 1)],
    [("model", 9), ("tool", 20), ("model", 11)],  # 40 tokens: at the cap
]
SINGLE_TURN = [[("model", n)] for n in (7, 3, 12, 40, 1)]


def model_tokens(turns) -> int:
    return sum(n for who, n in turns if who == "model")


def all_tokens(turns) -> int:
    return sum(n for _, n in turns)


def agent_output(turns, index: int, score: float = 1.0) -> AgentLoopOutput:
    """One trajectory as verl's agent loop returns it (its ``response_mask``: 1 model, 0 tool)."""
    gen = torch.Generator().manual_seed(index)
    mask = [1 if who == "model" else 0 for who, n in turns for _ in range(n)]
    return AgentLoopOutput(
        prompt_ids=torch.randint(3, 50, (2 + index % 3,), generator=gen).tolist(),
        response_ids=torch.randint(3, 50, (len(mask),), generator=gen).tolist(),
        response_mask=mask,
        response_logprobs=(-torch.rand(len(mask), generator=gen)).tolist(),
        reward_score=score,
        num_turns=1 + 2 * sum(who == "tool" for who, _ in turns),
        metrics=AgentLoopMetrics(),
    )


def v1_batch(responses, padding_samples: int = 1):
    """What V1's worker gets: the agent loop's outputs (``as_dict``, as ``agent_loop_tq`` stores them), collated
    by verl's ``list_of_dict_to_tensordict``, with V1's synthetic padding samples appended."""
    fields = []
    for i, turns in enumerate(responses):
        field = agent_output(turns, i).as_dict()
        field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
        field["attention_mask"] = torch.ones_like(field["input_ids"])
        field["position_ids"] = torch.arange(field["input_ids"].numel())
        field["old_log_probs"] = field["rollout_log_probs"] + 0.01  # the trainer's (not bypass mode's copy)
        fields.append({k: field[k] for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                             "position_ids", "rm_scores", "rollout_log_probs", "old_log_probs")})
    for _ in range(padding_samples):
        pad, tag = construct_minimal_padding_template(fields[0], {}, eos_token_id=2)
        assert tag["is_padding"]
        pad["rm_scores"] = torch.zeros(1)
        pad["rollout_log_probs"] = pad["old_log_probs"] = torch.zeros(1)
        fields.append({k: pad[k] for k in fields[0]})
    return tu.list_of_dict_to_tensordict(fields)


def v0_dataproto(responses) -> DataProto:
    """V0's padded batch as verl's agent loop post-processing builds it: prompts left-padded to the prompt
    width, responses right-padded to the cap, ``response_mask`` = the turn mask x the response attention."""
    rows = len(responses)
    tensors = {k: torch.zeros(rows, w, dtype=torch.int64) for k, w in (
        ("prompts", PROMPT_WIDTH), ("responses", RESPONSE_CAP), ("response_mask", RESPONSE_CAP))}
    attention = torch.zeros(rows, PROMPT_WIDTH + RESPONSE_CAP, dtype=torch.int64)
    scores = torch.zeros(rows, RESPONSE_CAP)
    log_probs = torch.zeros(rows, RESPONSE_CAP)
    for i, turns in enumerate(responses):
        out = agent_output(turns, i)
        p, r = len(out.prompt_ids), len(out.response_ids)
        tensors["prompts"][i, PROMPT_WIDTH - p:] = torch.tensor(out.prompt_ids)
        tensors["responses"][i, :r] = torch.tensor(out.response_ids)
        tensors["response_mask"][i, :r] = torch.tensor(out.response_mask)
        attention[i, PROMPT_WIDTH - p:PROMPT_WIDTH + r] = 1
        scores[i, r - 1] = out.reward_score
        log_probs[i, :r] = torch.tensor(out.response_logprobs)
    tensors.update(input_ids=torch.cat([tensors["prompts"], tensors["responses"]], 1), attention_mask=attention,
                   position_ids=(attention.cumsum(-1) - 1).clamp(min=0), token_level_scores=scores,
                   old_log_probs=log_probs + 0.01, rollout_log_probs=log_probs)
    return DataProto.from_dict(tensors=tensors)


def v0_batch(responses):
    """What V0's worker gets (``RayPPOTrainer._update_actor``: DataProto -> TensorDict -> no-padding layout)."""
    return left_right_2_no_padding(v0_dataproto(responses).to_tensordict())


LAYOUTS = {"v0": v0_batch, "v1": v1_batch}


# -- the figure: the model's own tokens, exact in both layouts -----------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_model_tokens_are_counted_from_response_mask_in_both_layouts(layout):
    data = LAYOUTS[layout](MULTI_TURN)
    assert model_token_counts(data).tolist() == [model_tokens(t) for t in MULTI_TURN]
    assert response_lengths(data).tolist() == [all_tokens(t) for t in MULTI_TURN]
    stats = measure_batch(data, cap=RESPONSE_CAP)
    assert stats.model_tokens == sum(model_tokens(t) for t in MULTI_TURN)
    assert stats.length == [sum(all_tokens(t) for t in MULTI_TURN), len(MULTI_TURN), 1.0]


def test_verls_response_length_mean_counts_the_tool_tokens_and_ours_does_not():
    verl_mean = _compute_response_info(v0_dataproto(MULTI_TURN))["response_length"].mean().item()
    assert verl_mean == pytest.approx(sum(all_tokens(t) for t in MULTI_TURN) / len(MULTI_TURN))
    state = StepState()
    state.add_batch(measure_batch(v0_batch(MULTI_TURN), cap=RESPONSE_CAP))
    fed, _ = state.figures("k3", False, "auto")
    expected = sum(model_tokens(t) for t in MULTI_TURN) / len(MULTI_TURN)
    assert fed.response_length == expected < verl_mean
    assert state.model_token_figures() == {MODEL_TOKENS_KEY: expected}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("option,reads_model", [("auto", True), ("model", True), ("all", False)])
def test_the_option_selects_the_length_on_a_multi_turn_step(layout, option, reads_model):
    state = StepState()
    state.add_batch(measure_batch(LAYOUTS[layout](MULTI_TURN), cap=RESPONSE_CAP))
    fed, _ = state.figures("k3", False, option)
    per = model_tokens if reads_model else all_tokens
    assert fed.response_length == sum(per(t) for t in MULTI_TURN) / len(MULTI_TURN)
    assert state.reads_model_tokens(option) is reads_model
    # the clip share counts the responses whose full length (the rollout's budget) reached the cap
    assert fed.clip_ratio == sum(all_tokens(t) >= RESPONSE_CAP for t in MULTI_TURN) / len(MULTI_TURN)
    # the score keeps its meaning: the trajectory's reward (one per response), whichever tokens carry it
    assert fed.score == pytest.approx(1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_single_turn_step_reads_verls_length_under_every_option(layout):
    data = LAYOUTS[layout](SINGLE_TURN)
    verl_mean = _compute_response_info(v0_dataproto(SINGLE_TURN))["response_length"].mean().item()
    fed = {}
    for option in ("auto", "model", "all"):
        state = StepState()
        state.add_batch(measure_batch(data, cap=RESPONSE_CAP))
        fed[option] = state.figures("k3", False, option)[0]
        assert state.reads_model_tokens(option) is (option == "model")
    assert fed["auto"] == fed["model"] == fed["all"]  # bit for bit, every figure
    assert fed["auto"].response_length == pytest.approx(verl_mean, rel=1e-7)


def test_options_are_checked_naming_the_key_and_the_allowed_values():
    assert LengthSurgeConfig().length_tokens == "auto"
    with pytest.raises(ValueError, match=r"length_surge\.length_tokens='tools' is invalid: allowed values are one "
                                         r"of \['auto', 'model', 'all'\]"):
        LengthSurgeConfig.from_dict({"length_tokens": "tools"})


# -- single-turn runs decide exactly as before: the figures and the decisions ------------------------------------
def surging_single_turn_run(steps: int = 30, surge_at: int = 15):
    """Per step, a batch of single-turn responses whose mean length triples from ``surge_at`` on."""
    gen = torch.Generator().manual_seed(3)
    for step in range(1, steps + 1):
        base = 8 if step < surge_at else 8 + min(16, 2 * (step - surge_at + 1))
        lengths = (base + torch.randint(-2, 3, (8,), generator=gen)).clamp(1, RESPONSE_CAP).tolist()
        yield [[("model", n)] for n in lengths]


def drive(batches, options: dict, layout: str = "v0"):
    """The glue's per-step path (measure, sum, feed, step) on real batches; the fed lengths and the LRs."""
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                              {"skip_first_steps": 2, "cusum_span": 6, "cusum_lag": 1, "period_factor": 0.5,
                               **options})
    fed, lrs = [], []
    for responses in batches:
        state = begin_update(scheduler, _position())
        state.add_batch(measure_batch(LAYOUTS[layout](responses), cap=RESPONSE_CAP))
        figures = state.feed_figures(scheduler, _position())
        scheduler.observe_update(figures)
        scheduler.step()
        fed.append(figures.response_length)
        lrs.append(scheduler.get_last_lr()[0])
    return fed, lrs, scheduler.schedule.surge_step


def _position():
    return StepPosition(0, 1, False, RESPONSE_CAP)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_turn_runs_decide_exactly_as_verls_length_does(layout):
    batches = list(surging_single_turn_run())
    auto = drive(batches, {}, layout)
    verl_length = drive(batches, {"length_tokens": "all"}, layout)
    assert auto == verl_length  # the fed figures, the LRs and the surge step, bit for bit
    fed, lrs, surge = auto
    assert surge is not None and lrs[-1] < lrs[0]  # the surge is there to decide on
    # and the figure is verl's own response_length/mean of each batch
    for responses, value in zip(batches, fed):
        verl_mean = _compute_response_info(v0_dataproto(responses))["response_length"].mean().item()
        assert value == pytest.approx(verl_mean, rel=1e-6)


def test_growing_tool_answers_move_verls_length_not_the_model_tokens():
    """The scenario of the e2e run (a): the tool's answers grow 4x, the model's turns stay the same."""
    batches = []
    for step in range(1, 31):
        tool = 6 if step < 12 else min(24, 6 + 2 * (step - 11))
        batches.append([[("model", 3 + i % 3), ("tool", tool), ("model", 2)] for i in range(8)])
    fed, lrs, surge = drive(batches, {})
    assert surge is None and lrs == [1.0] * len(lrs)
    assert set(fed) == {sum(3 + i % 3 for i in range(8)) / 8 + 2}  # the model's turns, the same every step
    _, lrs_all, surge_all = drive(batches, {"length_tokens": "all"})
    assert surge_all is not None and lrs_all[-1] < 1.0  # read with the tool's tokens, the same run would decay


# -- rejection sampling zeroes response_mask: not taken for tool output -------------------------------------------
def test_rejection_sampling_is_not_read_as_tool_output(length_surge_trainer):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper

    from verl_lrstab.glue import driver
    from verl_lrstab.glue.wraps import original

    driver._pop_pre_rs_stats()
    batch = v0_dataproto(SINGLE_TURN)
    gen = torch.Generator().manual_seed(1)
    batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"] + 0.05 * torch.randn(
        batch.batch["old_log_probs"].shape, generator=gen)
    config = RolloutCorrectionConfig(rollout_is=None, rollout_rs="token_k3", rollout_rs_threshold=1e-3)
    wrapped = driver.make_rollout_correction(original(rollout_corr_helper.compute_rollout_correction_and_add_to_batch))
    before = batch.batch["response_mask"].sum().item()
    batch, _ = wrapped(batch, config)
    assert batch.batch["response_mask"].sum().item() < before, "rejection sampling must drop tokens here"
    stats = measure_batch(left_right_2_no_padding(batch.to_tensordict()), cap=RESPONSE_CAP,
                          pre_rejection_stats=driver._pop_pre_rs_stats())
    assert stats.model_tokens == before == sum(all_tokens(t) for t in SINGLE_TURN)
    state = StepState()
    state.add_batch(stats)
    assert not state.reads_model_tokens("auto")


# -- what is logged and said --------------------------------------------------------------------------------------
def test_the_model_token_figure_is_logged_and_the_length_read_is_named(capsys):
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), {})
    for responses in (SINGLE_TURN, MULTI_TURN, MULTI_TURN, SINGLE_TURN):
        state = begin_update(scheduler, _position())
        state.add_batch(measure_batch(v1_batch(responses), cap=RESPONSE_CAP))
        state.feed_figures(scheduler, _position())
        assert state.logged[MODEL_TOKENS_KEY] == sum(model_tokens(t) for t in responses) / len(responses)
        scheduler.step()
    lines = [line for line in capsys.readouterr().out.splitlines() if "surge detector reads" in line]
    # said at the first step and when tool tokens first came; a later step without any reads the same number
    assert len(lines) == 2, lines
    assert "verl's response_length/mean" in lines[0] and "length_tokens: auto" in lines[0]
    assert "model's own tokens" in lines[1] and "did not sample" in lines[1]


@pytest.mark.parametrize("option", ["model", "auto"])
def test_model_tokens_that_cannot_be_counted(option):
    """``model``: the step is unmeasured (3 in a row fail the run, never a constant LR); ``auto``: verl's length."""
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                              {"length_tokens": option})
    stats = measure_batch(v0_batch(MULTI_TURN), cap=RESPONSE_CAP)._replace(model_tokens=None)  # some rank could not
    for step in range(1, 4):
        state = begin_update(scheduler, _position())
        state.add_batch(stats)
        if option == "model" and step == 3:
            with pytest.raises(GlueError, match="could not be measured on 3 consecutive"):
                state.feed_figures(scheduler, _position())
            return
        fed = state.feed_figures(scheduler, _position())
        expected = math.nan if option == "model" else sum(all_tokens(t) for t in MULTI_TURN) / len(MULTI_TURN)
        assert fed.response_length == pytest.approx(expected, nan_ok=True)
        assert MODEL_TOKENS_KEY not in state.logged
        scheduler.observe_update(fed)
        scheduler.step()


# -- across data-parallel ranks: one collective, the global figure -----------------------------------------------
def _rank(rank, world_size, init_file, out_file, layout):
    import torch.distributed as dist

    from test_collectives import COLLECTIVES_PER_MINI_BATCH, _count_collectives, _verls_update, _Worker
    from verl_lrstab.glue import worker
    from verl_lrstab.glue.steps import STEP_POSITION_KEY

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = _count_collectives(dist)
    w = _Worker()
    data = LAYOUTS[layout](MULTI_TURN[:2] if rank == 0 else MULTI_TURN[2:])
    tu.assign_non_tensor_data(data, STEP_POSITION_KEY, [0, 1, 0, RESPONSE_CAP])
    output = worker._train_mini_batch(_verls_update, w, data)
    metrics = {} if output is None else {k: v for k, v in tu.get(output, "metrics").items()}
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump({"calls": len(calls), "expected_calls": COLLECTIVES_PER_MINI_BATCH,
                   "fed": w.engine.lr_scheduler.schedule.response_length,
                   "model_tokens": metrics.get(MODEL_TOKENS_KEY)}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_data_parallel_ranks_feed_the_global_model_token_mean(tmp_path, layout):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out"), layout), nprocs=2, join=True)
    expected = sum(model_tokens(t) for t in MULTI_TURN) / len(MULTI_TURN)
    outs = [json.loads(Path(f"{tmp_path / 'out'}.{r}").read_text()) for r in range(2)]
    for out in outs:
        assert out["calls"] == out["expected_calls"]  # no collective added for the model's tokens
        assert out["fed"] == expected
    assert outs[0]["model_tokens"] == [expected]  # rank 0 reports verl's metrics
