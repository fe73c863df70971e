"""One way in: a torch training loop (``LengthSurgeLR.step``), a Megatron one (``LengthSurgeParamScheduler.step``)
and a verl run (the worker glue, per actor update) fed the same figures take the same decisions.

The figures are a surge trace of the phenomena bench (class T: a drift, a two-step excursion, then the
length keeps rising while the score falls; verl's entropy, grad norm, KL loss and PPO clip fraction logged
each step) turned into real batches of 64 responses: per step the length is the mean of integer response
lengths, the score the share of right answers (a reward of 1 on a right response's last token), the clip
share the responses at the cap. The glue measures them from verl's own batch (``DataProto`` to the worker's
no-padding layout, the rollout's response cap in the driver's step tag) and reads verl's update metrics;
the training loops are handed the same numbers, counted from the responses as a user's loop counts them.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import pytest
import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab.cusum import CusumDetector
from verl_lrstab.glue import worker
from verl_lrstab.glue.steps import STEP_POSITION_KEY
from verl_lrstab.scheduler import LengthSurgeLR

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "research"))
import phenomena  # noqa: E402

logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
N, CAP, PROMPT = 64, 2048, 4  # responses per batch, the rollout's response cap, prompt tokens
# verl's update metrics (TrainingWorker.train_mini_batch's keys) by the step() argument they are
UPDATE_METRICS = {"entropy": "actor/entropy_loss", "grad_norm": "grad_norm", "kl_loss": "kl_loss",
                  "pg_clipfrac": "actor/pg_clipfrac"}
COLUMNS = {phenomena.ENTROPY: "entropy", phenomena.GRAD_NORM: "grad_norm", phenomena.KL_LOSS: "kl_loss",
           phenomena.PG_CLIPFRAC: "pg_clipfrac"}


def responses(length: float, clip: float, score: float) -> tuple[list[int], int]:
    """``(per-response lengths, right answers)`` of a batch of N: its mean length ``length`` rounded to a
    token, ``clip`` x N responses at the cap (fewer if the others would be empty), ``score`` x N right."""
    total, at_cap = round(length * N), round(clip * N)
    while at_cap and total - at_cap * CAP < N - at_cap:
        at_cap -= 1
    rest, extra = divmod(total - at_cap * CAP, N - at_cap)
    lengths = [CAP] * at_cap + [rest + (i < extra) for i in range(N - at_cap)]
    assert all(0 < n <= CAP for n in lengths) and sum(lengths) == total
    return lengths, round(score * N)


def verl_batch(lengths: list[int], right: int):
    """What verl's driver sends the actor (left-padded prompts, right-padded responses, the token-level
    scores) in the worker's no-padding layout, tagged as the step's only update with the response cap."""
    mask = (torch.arange(CAP)[None] < torch.tensor(lengths)[:, None]).long()
    attention = torch.cat([torch.ones(N, PROMPT, dtype=torch.long), mask], 1)
    scores = torch.zeros(N, CAP)
    for i in range(right):
        scores[i, lengths[i] - 1] = 1.0
    tensors = {"input_ids": torch.ones(N, PROMPT + CAP, dtype=torch.long), "attention_mask": attention,
               "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
               "prompts": torch.ones(N, PROMPT, dtype=torch.long),
               "responses": torch.ones(N, CAP, dtype=torch.long), "response_mask": mask,
               "old_log_probs": torch.zeros(N, CAP), "token_level_scores": scores}
    data = left_right_2_no_padding(DataProto.from_dict(tensors=tensors).to_tensordict())
    tu.assign_non_tensor_data(data, STEP_POSITION_KEY, [0, 1, 0, CAP])
    return data


class Engine:
    """What the worker glue reads of verl's engine: its LR scheduler (ours, on a real optimizer)."""

    def __init__(self):
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.lr_scheduler = LengthSurgeLR(self.optimizer)

    def get_data_parallel_group(self):
        return None


class Worker:
    def __init__(self):
        self.engine = Engine()


def verls_update(update_figures: dict):
    """verl's ``train_mini_batch`` as far as the glue sees it: the optimizer and the LR scheduler step (the
    scheduler with no argument, as verl's engine steps it), the update's metrics come back."""

    def update(self, data):
        self.engine.optimizer.step()
        self.engine.lr_scheduler.step()
        metrics = {UPDATE_METRICS[name]: [value] for name, value in update_figures.items()}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})
    return update


def megatron_scheduler():
    pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
    from verl_lrstab.megatron import LengthSurgeParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LengthSurgeParamScheduler(opt, None, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0,
                                     lr_decay_steps=1000, start_wd=0.0, end_wd=0.0, wd_incr_steps=1000,
                                     wd_incr_style="constant")


def test_torch_megatron_and_verls_glue_decide_alike_from_the_same_figures():
    (tr,) = phenomena.traces(seeds=[0], classes="T")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    torch_loop, megatron_loop, verl = LengthSurgeLR(opt), megatron_scheduler(), Worker()
    lrs = {"torch": [], "megatron": [], "verl": []}
    logged_fired_by = {}
    for i, step in enumerate(tr.steps):
        lengths, right = responses(tr.length[i], tr.clip[i], tr.score[i])
        update = {COLUMNS[col]: float(values[i]) for col, values in tr.cosignals.items()}
        figures = dict(response_length=sum(lengths) / N, score=right / N,
                       clip_ratio=sum(n >= CAP for n in lengths) / N, **update)
        opt.step()
        torch_loop.step(**figures)
        megatron_loop.step(1, **figures)
        output = worker._train_mini_batch(verls_update(update), verl, verl_batch(lengths, right))
        metrics = tu.get(output, "metrics")
        logged_fired_by.update({k: v for k, v in metrics.items() if k.startswith("lrstab/fired_by/")})
        lrs["torch"].append(torch_loop.get_last_lr()[0])
        lrs["megatron"].append(megatron_loop.get_last_lr()[0])
        lrs["verl"].append(verl.engine.lr_scheduler.get_last_lr()[0])
    ours = verl.engine.lr_scheduler.schedule
    assert ours.surge_step is not None and ours.surge_step >= tr.onset, (ours.surge_step, tr.onset)
    for loop in (torch_loop, megatron_loop):
        assert loop.schedule.surge_step == ours.surge_step
        assert loop.schedule.detector.fired_by == ours.detector.fired_by
    assert lrs["torch"] == lrs["megatron"] == lrs["verl"]
    assert lrs["verl"][tr.steps.index(ours.surge_step)] == 0.5  # the first halving, right after the surge
    way = ours.detector.fired_by[0]
    assert logged_fired_by == {f"lrstab/fired_by/{way}": [ours.surge_step]}
    # the figures reached the detector alike, not only the decisions
    assert torch_loop.schedule.detector.state_dict() == ours.detector.state_dict()


def test_step_takes_every_figure_the_default_detector_reads():
    figures = set(CusumDetector.reads)
    assert set(inspect.signature(LengthSurgeLR.step).parameters) - {"self"} == figures
    pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
    from verl_lrstab.megatron import LengthSurgeParamScheduler

    assert set(inspect.signature(LengthSurgeParamScheduler.step).parameters) - {"self", "increment"} == figures


def test_step_refuses_an_unknown_figure_by_name():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LengthSurgeLR(opt)
    opt.step()
    with pytest.raises(TypeError, match="entropi"):
        sched.step(500.0, entropi=0.3)
