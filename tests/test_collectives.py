"""Collectives per actor mini-batch on a real gloo group of two ranks: how many, and what they give.

docs/integration.md ("The per-update path") documents the count: one collective for the batch's
figures (length, score, clip share and mismatch, over the data-parallel group) before verl's
update, one for what verl's update logged (over the default group) after it; bypass mode adds
one, the first mini-batch's mismatch figures at the first optimizer step. Every function of
``torch.distributed`` that communicates is counted, whatever the glue calls.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

#: What docs/integration.md says, per mini-batch (``TrainingWorker.train_mini_batch`` call).
COLLECTIVES_PER_MINI_BATCH = 2
COLLECTIVES_PER_BYPASS_MINI_BATCH = 3

_COMMUNICATING = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
                  "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce",
                  "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "recv")


def _count_collectives(dist) -> list:
    calls: list = []
    for name in _COMMUNICATING:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def _batch(lengths, bypass: bool = False, position=(0, 1, 0)):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from verl_lrstab.glue.steps import STEP_POSITION_KEY

    rows, width = len(lengths), 10
    response_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, 2, dtype=torch.int64), response_mask], 1)
    old_log_probs = -torch.ones(rows, width)
    tensors = {"attention_mask": attention_mask, "input_ids": torch.randint(3, 50, (rows, 2 + width)),
               "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "prompts": torch.randint(3, 50, (rows, 2)),
               "responses": torch.randint(3, 50, (rows, width)), "response_mask": response_mask,
               "old_log_probs": old_log_probs, "token_level_scores": torch.ones(rows, width) * response_mask,
               "rollout_log_probs": old_log_probs.clone() if bypass else old_log_probs - 0.01 * response_mask}
    td = left_right_2_no_padding(DataProto.from_dict(tensors=tensors).to_tensordict())
    tu.assign_non_tensor_data(td, STEP_POSITION_KEY, list(position))
    return td


class _Engine:
    def __init__(self):
        from verl_lrstab.scheduler import LengthSurgeLR

        self.lr_scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3),
                                          {"detector": "cusum"})

    def get_data_parallel_group(self):
        return None  # the default group: both ranks are data-parallel


class _Worker:
    def __init__(self):
        self.engine = _Engine()
        self.loss_fn = lambda *args, **kwargs: None  # what bypass mode's capture wraps


def _verls_update(self, data):
    """verl's work replaced by what its engine does at the end: step the scheduler; rank 0 alone reports
    (a model-parallel source rank), as verl's workers do."""
    from verl.utils import tensordict_utils as tu

    self.engine.lr_scheduler.step()
    if torch.distributed.get_rank() != 0:
        return None
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"grad_norm": [0.5], "lr": [1e-3]}})


def _rank(rank, world_size, init_file, out_file):
    import torch.distributed as dist

    from verl_lrstab.glue import worker

    logging.getLogger("verl_lrstab").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = _count_collectives(dist)
    lengths = [(3, 5), (7, 9)][rank]  # global mean 6
    w = _Worker()
    result = {}
    for name, batches in (("one update", [_batch(lengths)]),
                          ("two updates", [_batch(lengths, position=(0, 2, 1)), _batch(lengths, position=(1, 2, 1))]),
                          ("bypass", [_batch(lengths, bypass=True)])):
        counts = []
        for data in batches:
            before = len(calls)
            worker._train_mini_batch(_verls_update, w, data)
            counts.append(len(calls) - before)
        result[name] = {"counts": counts, "kinds": sorted(set(calls)),
                        "length": w.engine.lr_scheduler.schedule.response_length}
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("collectives")
    mp.spawn(_rank, args=(2, str(tmp / "init"), str(tmp / "out")), nprocs=2, join=True)
    return [json.loads(Path(f"{tmp / 'out'}.{r}").read_text()) for r in range(2)]


def test_an_update_runs_the_documented_collectives_per_mini_batch(two_ranks):
    for ranks in two_ranks:
        assert ranks["one update"]["counts"] == [COLLECTIVES_PER_MINI_BATCH]
        assert ranks["two updates"]["counts"] == [COLLECTIVES_PER_MINI_BATCH] * 2  # held or fed: the same
        assert ranks["bypass"]["counts"] == [COLLECTIVES_PER_BYPASS_MINI_BATCH]
        assert ranks["bypass"]["kinds"] == ["all_gather"]


def test_both_ranks_feed_the_global_figures(two_ranks):
    first, second = two_ranks
    assert first["one update"]["length"] == second["one update"]["length"] == pytest.approx(6.0)
    assert first["two updates"]["length"] == second["two updates"]["length"] == pytest.approx(6.0)


def _reduce_rank(rank, world_size, init_file, out_file):
    import torch.distributed as dist

    from verl_lrstab.collective import Part, reduce_or_none

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = _count_collectives(dist)
    sums = torch.tensor([1.0 + rank, 10.0], dtype=torch.float64)
    with_max = torch.tensor([2.0, 3.0 * (rank + 1), 0.5 - rank], dtype=torch.float64)  # the last two: MAX
    got = reduce_or_none([Part(sums, 2), Part(None if rank == 1 else sums, 2), Part(with_max, 3, n_max=2)])
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump({"calls": calls, "got": [None if g is None else g.tolist() for g in got]}, f)
    dist.destroy_process_group()


def test_sums_maxima_and_a_rank_that_cannot_measure_travel_in_one_collective(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_reduce_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    for r in range(2):
        out = json.loads(Path(f"{tmp_path / 'out'}.{r}").read_text())
        assert out["calls"] == ["all_gather"]
        assert out["got"] == [[3.0, 20.0], None, [4.0, 6.0, 0.5]]
