"""The worker's mismatch split by version lag (glue/batch_figures.py, glue/steps.py), on batches in the layouts
verl's trainers send: V0's (``DataProto.to_tensordict`` + ``left_right_2_no_padding``: the versions as the agent
loop's non-tensor fields, as in the one-step-off and fully-async trainers) and V1's (``list_of_dict_to_tensordict``
of the agent loop's fields: the versions inside ``extra_fields``)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab import version_split
from verl_lrstab.glue.batch_figures import measure_batch
from verl_lrstab.glue.steps import StepState
from verl_lrstab.glue.worker import version_lags

PROMPT, CAP = 3, 4
# per sample: response tokens' d = old - rollout log-prob, and the (min, max) versions it was sampled with
SAMPLES = [([0.5, 0.25], (6, 6)), ([0.125], (6, 6)), ([1.0, 0.0, 0.0], (5, 5)), ([0.5], (5, 6))]
LAGS = {6: 0, 5: 1}  # the trainer's weights are version 6


def k3(d: float) -> float:
    return math.expm1(d) - d


def fresh_k3() -> float:
    d = [x for ds, (lo, hi) in SAMPLES if lo == hi == 6 for x in ds]
    return sum(map(k3, d)) / len(d)


def v0_batch(samples=SAMPLES) -> "tu.TensorDict":
    rows = len(samples)
    attention = torch.zeros(rows, PROMPT + CAP, dtype=torch.int64)
    mask = torch.zeros(rows, CAP, dtype=torch.int64)
    old = torch.zeros(rows, CAP, dtype=torch.float64)
    roll = torch.zeros(rows, CAP, dtype=torch.float64)
    for i, (ds, _) in enumerate(samples):
        attention[i, :PROMPT + len(ds)] = 1
        mask[i, :len(ds)] = 1
        roll[i, :len(ds)] = -1.0
        old[i, :len(ds)] = -1.0 + torch.tensor(ds, dtype=torch.float64)
    ids = torch.arange(rows * (PROMPT + CAP)).reshape(rows, -1) % 50 + 3
    data = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                 "prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "response_mask": mask,
                 "old_log_probs": old, "rollout_log_probs": roll,
                 "token_level_scores": torch.zeros(rows, CAP)},
        non_tensors={"min_global_steps": np.array([v[0] for _, v in samples], dtype=object),
                     "max_global_steps": np.array([v[1] for _, v in samples], dtype=object)})
    return left_right_2_no_padding(data.to_tensordict())


def v1_batch(samples=SAMPLES):
    fields = []
    for i, (ds, (lo, hi)) in enumerate(samples):
        n = len(ds)
        roll = torch.full((n,), -1.0, dtype=torch.float64)
        fields.append({"prompts": torch.tensor([3, 4, 5]), "responses": torch.arange(n) + 6,
                       "response_mask": torch.ones(n, dtype=torch.int64), "rollout_log_probs": roll,
                       "old_log_probs": roll + torch.tensor(ds, dtype=torch.float64),
                       "rm_scores": torch.zeros(n), "extra_fields": {"min_global_steps": lo, "max_global_steps": hi}})
    return tu.list_of_dict_to_tensordict(fields)


LAYOUTS = {"v0": v0_batch, "v1": v1_batch}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_async_step_feeds_the_fresh_samples_k3_and_logs_the_stale_apart(layout):
    stats = measure_batch(LAYOUTS[layout](), version_lags=LAGS)
    assert stats.split is not None
    state = StepState()
    state.add_batch(stats)
    fed, logged = state.figures("k3", is_async=True)
    assert fed.mismatch_kl == pytest.approx(fresh_k3(), rel=1e-12)
    assert logged["mismatch/k3"] == fed.mismatch_kl  # what replay reads is what was fed
    assert logged["mismatch/n_tokens"] == 3.0
    assert logged["mismatch/stale/lag_1/k3"] == pytest.approx(k3(1.0) / 3, rel=1e-12)
    assert logged["mismatch/stale/partial/k3"] == pytest.approx(k3(0.5), rel=1e-12)  # partial: stale
    assert logged[version_split.FRESH_SHARE_KEY] == 0.5


def test_the_sums_of_a_steps_updates_are_split_as_one_batch():
    state = StepState()
    state.add_batch(measure_batch(v0_batch(SAMPLES[:2]), version_lags=LAGS))
    state.add_batch(measure_batch(v0_batch(SAMPLES[2:]), version_lags=LAGS))
    fed, logged = state.figures("k3", is_async=True)
    assert fed.mismatch_kl == pytest.approx(fresh_k3(), rel=1e-12)
    assert logged[version_split.FRESH_SHARE_KEY] == 0.5


def test_a_step_without_a_fresh_sample_feeds_no_kl_and_says_so_once(caplog):
    version_split._warned.discard("no_fresh")
    stale = {6: 1, 5: 2}
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        for _ in range(2):
            state = StepState()
            state.add_batch(measure_batch(v0_batch(), version_lags=stale))
            fed, logged = state.figures("k3", is_async=True)
            assert fed.mismatch_kl is None
            assert "mismatch/k3" not in logged and logged[version_split.FRESH_SHARE_KEY] == 0.0
            assert logged["mismatch/stale/lag_1/n_tokens"] == 3.0
    assert sum("no fresh sample" in r.getMessage() for r in caplog.records) == 1


def test_without_the_drivers_versions_a_sync_step_is_unchanged_and_an_async_one_feeds_nothing():
    stats = measure_batch(v0_batch())
    assert stats.split is None
    state = StepState()
    state.add_batch(stats)
    fed, logged = state.figures("k3", is_async=False)
    every = [x for ds, _ in SAMPLES for x in ds]
    assert fed.mismatch_kl == pytest.approx(sum(map(k3, every)) / len(every), rel=1e-12)
    assert not any(k.startswith("mismatch/stale/") for k in logged)
    assert state.figures("k3", is_async=True)[0].mismatch_kl is None


def test_a_batch_without_versions_is_all_unknown_and_feeds_nothing():
    data = v0_batch()
    for key in ("min_global_steps", "max_global_steps"):
        tu.pop(data, key=key)
    state = StepState()
    state.add_batch(measure_batch(data, version_lags=LAGS))
    fed, logged = state.figures("k3", is_async=True)
    assert fed.mismatch_kl is None
    assert logged["mismatch/stale/unknown/n_tokens"] == 7.0


def test_the_version_tag_reads_back():
    from verl_lrstab.glue import versions

    assert versions.flat({4: 0, 3: 1}) == [3, 1, 4, 0]
    assert version_lags(versions.flat({4: 0, 3: 1})) == {3: 1, 4: 0}
    assert version_lags(None) is None
    assert version_lags([5, 1, 6, 0]) == {5: 1, 6: 0}
    with pytest.raises(ValueError):
        version_lags([5, 1, 6])


def _v1_trainer_at_step(cls, global_steps):
    trainer = object.__new__(cls)  # verl's class; its __init__ needs workers
    trainer.global_steps = global_steps
    return trainer


def test_v1_async_versions_lag_behind_global_steps_minus_one_as_the_old_log_prob_pass_scores():
    """V1 syncs under global_steps after the step's updates: at step G the trainer's weights are version G - 1
    (verl's trajectory_staleness). separate_async scores every update's old log-probs with the step's first
    weights; colocate_async scores a step's later updates with the weights the step changed."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_lrstab.glue import versions

    batch = SimpleNamespace(tags=[{"min_global_steps": 4, "max_global_steps": 4},
                                  {"min_global_steps": 3, "max_global_steps": 4}, {"is_padding": True}])
    separate, colocate = (_v1_trainer_at_step(cls, 5) for cls in (PPOTrainerSeparateAsync, PPOTrainerColocateAsync))
    for trainer in (separate, colocate):
        assert versions.v1_lags(trainer, batch, index=0) == {4: 0, 3: 1}
    assert versions.v1_lags(separate, batch, index=1) == versions.v1_lags(separate, batch, index=3) == {4: 0, 3: 1}
    assert versions.v1_lags(colocate, batch, index=1) == {4: 1, 3: 2}


def test_the_premise_of_the_v1_rule_holds_in_verls_trainers():
    """What the rule rests on, read from the installed verl: separate_async restores the step's first weights
    (saved at update 0) before its old-log-prob pass on later updates; colocate_async runs the base pass as is."""
    import inspect

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    source = inspect.getsource(PPOTrainerSeparateAsync._compute_old_log_prob)
    assert "save_model_to_cpu(0)" in source and "restore_model_from_cpu(0)" in source
    assert PPOTrainerColocateAsync._compute_old_log_prob is PPOTrainer._compute_old_log_prob


# -- what is not split: rejection sampling and bypass mode --------------------------------------------------
def every_token_k3() -> float:
    every = [x for ds, _ in SAMPLES for x in ds]
    return sum(map(k3, every)) / len(every)


def test_with_rejection_sampling_an_async_step_logs_the_drivers_sums_unsplit_and_feeds_none():
    """``rollout_rs``: the driver's sums over the mask before rejection (the whole batch, one group) win over the
    worker's measurement; the samples' versions do not split them, and an async step feeds none."""
    before_rejection = measure_batch(v0_batch()).mismatch.tolist()  # the whole batch's sums, as the driver takes them
    stats = measure_batch(v0_batch(), pre_rejection_stats=before_rejection, version_lags=LAGS)
    assert stats.split is None
    state = StepState()
    state.add_batch(stats)
    fed, logged = state.figures("k3", is_async=True)
    assert fed.mismatch_kl is None
    assert logged["mismatch/k3"] == pytest.approx(every_token_k3(), rel=1e-12)
    assert not any(k.startswith("mismatch/stale/") for k in logged) and version_split.FRESH_SHARE_KEY not in logged


def test_in_bypass_mode_an_async_step_logs_the_first_mini_batchs_figures_unsplit_and_feeds_none():
    """Bypass mode (``old_log_probs := rollout_log_probs``, the default of verl's one-step-off and fully-async
    configs): the batch's own figures are 0 by construction; the first mini-batch's loss forward gives them, summed
    over its tokens without the samples' versions: logged unsplit (``mismatch/bypass`` 1), not fed in an async step."""
    from verl_lrstab import mismatch
    from verl_lrstab.glue.steps import StepPosition
    from verl_lrstab.scheduler import LengthSurgeLR

    stats = measure_batch(v0_batch([([0.0] * len(ds), versions) for ds, versions in SAMPLES]), version_lags=LAGS)
    assert stats.bypass
    scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), {"detector": "cusum"})
    state, position = StepState(), StepPosition(0, 1, True, 0)
    state.add_batch(stats)
    fed = state.feed_figures(scheduler, position)
    assert fed.mismatch_kl is None and not any(k.startswith("mismatch/") for k in state.logged)
    scheduler.observe_update(fed)  # handed before the update, as run_update does
    state.take_first_mini_batch(scheduler, position, fed, measure_batch(v0_batch()).mismatch)  # the forward's sums
    assert state.logged["mismatch/k3"] == pytest.approx(every_token_k3(), rel=1e-12)
    assert state.logged[mismatch.BYPASS_KEY] == 1.0
    assert not any(k.startswith("mismatch/stale/") for k in state.logged)
    assert version_split.FRESH_SHARE_KEY not in state.logged
    scheduler.step()
    assert math.isnan(scheduler.schedule.mismatch_kl)
