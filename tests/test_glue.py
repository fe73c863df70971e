"""The worker-side glue on batches in the layouts verl's V0 and V1 trainers send to update_actor."""

import gc
import logging
import weakref

import pytest
import torch

from verl import DataProto
from verl.trainer.ppo.metric_utils import _compute_response_info
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab import mismatch
from verl_lrstab.glue import driver
from verl_lrstab.glue.batch_figures import BatchStats, measure_batch, response_lengths
from verl_lrstab.glue.steps import PRE_RS_STATS_KEY, STEP_POSITION_KEY, state_of
from verl_lrstab.glue.update_metrics import finish_update

PROMPT, RESP = 6, 8
RESPONSE_LENS = [8, 3, 0, 5]  # one empty (aborted) response
PROMPT_LENS = [6, 2, 4, 1]


def padded_batch(with_rollout_log_probs=True):
    """Left-padded prompts, right-padded responses: what V0's DataProto holds."""
    bs = len(RESPONSE_LENS)
    attention_mask = torch.zeros(bs, PROMPT + RESP, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        attention_mask[i, PROMPT - p:PROMPT] = 1
        attention_mask[i, PROMPT:PROMPT + r] = 1
    response_mask = attention_mask[:, PROMPT:].clone()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(3, 50, (bs, PROMPT + RESP), generator=gen),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": torch.randint(3, 50, (bs, RESP), generator=gen),
        "response_mask": response_mask,
        "old_log_probs": -torch.rand(bs, RESP, generator=gen),
    }
    if with_rollout_log_probs:
        batch["rollout_log_probs"] = batch["old_log_probs"] + 0.01 * torch.randn(bs, RESP, generator=gen)
        batch["rollout_log_probs"][~response_mask.bool()] = float("nan")  # garbage in padding
    return batch


def v0_worker_batch(**kwargs):
    # What RayPPOTrainer._update_actor sends: DataProto -> TensorDict -> no-padding layout.
    return left_right_2_no_padding(DataProto.from_dict(tensors=padded_batch(**kwargs)).to_tensordict())


def v1_worker_batch():
    padded = padded_batch()
    rows = range(len(RESPONSE_LENS))
    jag = lambda key: torch.nested.as_nested_tensor(  # noqa: E731
        [padded[key][i, :RESPONSE_LENS[i]] for i in rows], layout=torch.jagged)
    return tu.get_tensordict({"responses": jag("responses"), "response_mask": jag("response_mask"),
                              "old_log_probs": jag("old_log_probs"), "rollout_log_probs": jag("rollout_log_probs")})


def global_mean_response_length(data, dp_group=None):
    """The step's mean length as the worker feeds it: ``sum / count`` of the global stats."""
    stats = measure_batch(data, dp_group).length
    assert stats is not None, "the length was not measurable"
    total, count = stats
    return total / count


def global_mismatch_metrics(data, dp_group=None, pre_rejection_stats=None):
    """The ``mismatch/*`` figures as the worker logs them."""
    return mismatch.finalize(measure_batch(data, dp_group, pre_rejection_stats=pre_rejection_stats).mismatch)


def verl_logged_mean():
    """verl's own response_length/mean for the same batch (metric_utils)."""
    batch = DataProto.from_dict(tensors=padded_batch())
    return _compute_response_info(batch)["response_length"].mean().item()


def test_v0_layout_matches_verl_response_length_mean():
    data = v0_worker_batch()
    assert response_lengths(data).tolist() == RESPONSE_LENS
    assert global_mean_response_length(data) == pytest.approx(verl_logged_mean())


def test_v1_layout_uses_jagged_response_lengths():
    data = v1_worker_batch()
    assert response_lengths(data).tolist() == RESPONSE_LENS
    assert global_mean_response_length(data) == pytest.approx(sum(RESPONSE_LENS) / len(RESPONSE_LENS))


def test_unmeasurable_batch_gives_none_not_a_crash(caplog):
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    assert measure_batch(tu.get_tensordict({"foo": torch.zeros(2, 3)})).length is None
    assert "could not measure" in caplog.text


def test_empty_batch_gives_zero_counts_not_unmeasurable():
    data = tu.get_tensordict({"attention_mask": torch.zeros(0, PROMPT + RESP, dtype=torch.int64),
                              "response_mask": torch.zeros(0, RESP, dtype=torch.int64)})
    assert measure_batch(data).length == [0.0, 0.0]


def test_mismatch_on_v0_and_v1_layouts_equals_padded_reference():
    padded = padded_batch()
    expected = mismatch.mismatch_metrics(padded["old_log_probs"], padded["rollout_log_probs"], padded["response_mask"])
    for data in (v0_worker_batch(), v1_worker_batch()):
        got = global_mismatch_metrics(data)
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-6), key
    assert expected["mismatch/n_tokens"] == sum(RESPONSE_LENS)


def test_bypass_mode_shows_only_in_bit_identical_log_probs():
    from verl_lrstab.glue.batch_figures import shows_bypass_mode

    padded = padded_batch()
    old, mask = padded["old_log_probs"], padded["response_mask"]
    assert shows_bypass_mode(mismatch.compute_stats(old, old.clone(), mask))
    near = old.clone()
    near[0, 0] = torch.nextafter(near[0, 0], torch.tensor(0.0))  # one ulp on one token
    assert not shows_bypass_mode(mismatch.compute_stats(old, near, mask))
    assert not shows_bypass_mode(mismatch.compute_stats(old, old.clone(), torch.zeros_like(mask)))  # no token
    assert not shows_bypass_mode(None)
    assert not measure_batch(v0_worker_batch()).bypass
    padded["rollout_log_probs"] = old.clone()  # verl's bypass mode: old_log_probs := rollout_log_probs
    assert measure_batch(left_right_2_no_padding(DataProto.from_dict(tensors=padded).to_tensordict())).bypass


def test_missing_rollout_log_probs_logs_nothing_and_names_the_key(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    monkeypatch.setattr(mismatch, "_warned", set())
    assert global_mismatch_metrics(v0_worker_batch(with_rollout_log_probs=False)) is None
    assert "actor_rollout_ref.rollout.calculate_log_probs" in caplog.text


def test_metrics_are_added_to_verl_output():
    from verl_lrstab.scheduler import LengthSurgeLR

    sched = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-6), {"detector": "ratio"})
    output = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"lr": [1e-6], "loss": [0.5]}})
    merged = tu.get(finish_update(sched, state_of(sched).cosignals, output, True, {"mismatch/k3": 1e-4}), "metrics")
    assert merged == {"lr": [1e-6], "loss": [0.5], "mismatch/k3": [1e-4],
                      **{key: [value] for key, value in sched.metrics().items()}}
    assert merged["lrstab/surge_step"] == [-1]
    assert finish_update(sched, state_of(sched).cosignals, None, True, {"x": 1}) is None  # ranks that do not report


def test_v1_synthetic_padding_samples_are_left_out_like_verls_metrics():
    # verl V1 pads a batch to a multiple of the DP size with samples built by
    # construct_minimal_padding_template and skips them (is_padding tag) in response_length/*.
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    padded = padded_batch()
    sample = {"responses": padded["responses"][0, :RESPONSE_LENS[0]], "prompts": padded["input_ids"][0, :PROMPT],
              "input_ids": padded["input_ids"][0], "attention_mask": padded["attention_mask"][0],
              "position_ids": padded["position_ids"][0], "response_mask": padded["response_mask"][0, :RESPONSE_LENS[0]]}
    pad, tag = construct_minimal_padding_template(sample, {}, eos_token_id=2)
    assert tag["is_padding"]
    rows = range(len(RESPONSE_LENS))
    responses = [padded["responses"][i, :RESPONSE_LENS[i]] for i in rows] + [pad["responses"]] * 2
    masks = [padded["response_mask"][i, :RESPONSE_LENS[i]] for i in rows] + [pad["response_mask"]] * 2
    data = tu.get_tensordict({"responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
                              "response_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged)})
    assert response_lengths(data).tolist() == RESPONSE_LENS
    assert global_mean_response_length(data) == pytest.approx(sum(RESPONSE_LENS) / len(RESPONSE_LENS))


def test_collective_device_is_this_ranks_accelerator(monkeypatch):
    # CUDA/Ascend with more than one rank per node: each rank reduces on its own device, not device 0.
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert mismatch.collective_device(None) == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert mismatch.collective_device(None) == torch.device("cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # no process group: the CPU
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert mismatch.collective_device(None) == torch.device("cpu")


def test_v0_batch_without_attention_mask_is_not_measured_from_response_mask(caplog):
    # response_mask alone leaves out tool tokens (multi-turn): refuse to guess, loudly
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    data = tu.get_tensordict({"response_mask": torch.ones(2, 4, dtype=torch.int64)})
    assert measure_batch(data).length is None
    assert "tool tokens" in caplog.text and "attention_mask" in caplog.text


def _rollout_corr_inputs(rollout_rs, threshold):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    padded = padded_batch()
    padded["rollout_log_probs"] = padded["old_log_probs"] + 0.05 * torch.randn(
        padded["old_log_probs"].shape, generator=torch.Generator().manual_seed(1))
    config = RolloutCorrectionConfig(rollout_is=None, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    return DataProto.from_dict(tensors=padded), config


class _V0Trainer(RayPPOTrainer):
    def __init__(self):  # a trainer object of verl's class; verl's own __init__ needs workers
        pass


def _wrapped_rollout_correction():
    """The glue's wrapper around verl's own function (the installed one may already be ours)."""
    from verl.trainer.ppo import rollout_corr_helper
    from verl_lrstab.glue.wraps import original

    return driver.make_rollout_correction(original(rollout_corr_helper.compute_rollout_correction_and_add_to_batch))


@pytest.mark.parametrize("rollout_rs,threshold", [(None, None), ("token_k3", 1e-3), ("seq_mean_k1", "0.999_1.001")])
def test_mismatch_is_measured_before_rejection_sampling_like_verls_rollout_corr(rollout_rs, threshold,
                                                                                length_surge_trainer):
    """verl's own rollout correction (rejection overwrites response_mask) through the glue's wrap."""
    driver._pop_pre_rs_stats()  # nothing left from another test
    batch, config = _rollout_corr_inputs(rollout_rs, threshold)
    wrapped = _wrapped_rollout_correction()
    before = batch.batch["response_mask"].clone()
    batch, verl_metrics = wrapped(batch, config)
    stats = driver._pop_pre_rs_stats()
    if rollout_rs is not None:
        assert (batch.batch["response_mask"] != before).any(), "rejection sampling must drop tokens here"
        assert stats is not None
    else:  # no rejection: the mask is unchanged and the worker measures it itself
        assert stats is None and torch.equal(batch.batch["response_mask"], before)
    # the worker sees the post-rejection batch, and the driver's pre-rejection sums
    worker = left_right_2_no_padding(batch.to_tensordict())
    ours = global_mismatch_metrics(worker, pre_rejection_stats=stats)
    assert ours["mismatch/n_tokens"] == before.sum().item()
    assert ours["mismatch/k3"] == pytest.approx(verl_metrics["rollout_corr/k3_kl"], rel=1e-4)
    assert ours["mismatch/k1"] == pytest.approx(verl_metrics["rollout_corr/kl"], rel=1e-4)


def test_rollout_correction_of_a_stock_run_stashes_nothing(monkeypatch):
    # no length_surge trainer in this process: verl's function runs alone, nothing is measured
    monkeypatch.setattr(driver, "_checked", weakref.WeakKeyDictionary())
    driver._pop_pre_rs_stats()
    batch, config = _rollout_corr_inputs("token_k3", 1e-3)
    reference, _ = _rollout_corr_inputs("token_k3", 1e-3)
    from verl_lrstab.glue.wraps import original
    from verl.trainer.ppo import rollout_corr_helper

    batch, verl_metrics = _wrapped_rollout_correction()(batch, config)
    reference, reference_metrics = original(rollout_corr_helper.compute_rollout_correction_and_add_to_batch)(
        reference, config)
    assert driver._pop_pre_rs_stats() is None
    assert torch.equal(batch.batch["response_mask"], reference.batch["response_mask"])
    assert verl_metrics.keys() == reference_metrics.keys()


def test_a_stock_run_after_a_length_surge_trainer_is_gone_pays_nothing(monkeypatch):
    # a process that built a length_surge trainer (its real run checks) and later a stock one: the pre-rejection
    # pass runs only while a length_surge trainer is alive
    from hydra import compose, initialize_config_module

    monkeypatch.setattr(driver, "_checked", weakref.WeakKeyDictionary())
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge", "trainer.use_v1=false"])
    trainer = _V0Trainer()
    driver.check_run(config, require=lambda engine, trainer=None: None, trainer=trainer)
    driver._pop_pre_rs_stats()
    batch, rs_config = _rollout_corr_inputs("token_k3", 1e-3)
    _wrapped_rollout_correction()(batch, rs_config)
    assert driver._pop_pre_rs_stats() is not None  # the length_surge run's figures
    del trainer
    gc.collect()
    batch, rs_config = _rollout_corr_inputs("token_k3", 1e-3)
    _wrapped_rollout_correction()(batch, rs_config)
    assert driver._pop_pre_rs_stats() is None


def test_v0_driver_wrap_tags_the_step_and_hands_the_pre_rejection_stats_to_the_worker_batch():
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    sent = []
    wrapper = driver.make_v0_update_actor(
        lambda self, batch: sent.append(left_right_2_no_padding(batch.to_tensordict())))  # as _update_actor does
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {"lr_scheduler_type": "length_surge"}},
                                                     "rollout": {"response_length": 48}}})
    batch = DataProto.from_dict(tensors=padded_batch())
    stats = mismatch.compute_stats(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                   batch.batch["response_mask"]).tolist()
    driver._run.pre_rs = stats
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # its checks (check_run) are tested in test_glue_trainers.py
    trainer.config = config
    driver._checked[trainer] = False  # what check_run records for V0's RayPPOTrainer: sync
    wrapper(trainer, batch)
    assert tu.pop(sent[0], key=PRE_RS_STATS_KEY, default=None) == stats
    # V0: one update per step, sync; the rollout's response cap
    assert list(tu.pop(sent[0], key=STEP_POSITION_KEY, default=None)) == [0, 1, 0, 48]
    assert driver._pop_pre_rs_stats() is None  # consumed: never handed to a later batch
    # a stock run's batch is untouched
    config.actor_rollout_ref.actor.optim.lr_scheduler_type = "cosine"
    driver._run.pre_rs = stats
    wrapper(SimpleNamespace(config=config), DataProto.from_dict(tensors=padded_batch()))
    assert tu.pop(sent[1], key=STEP_POSITION_KEY, default=None) is None
    assert tu.pop(sent[1], key=PRE_RS_STATS_KEY, default=None) is None
    driver._run.pre_rs = None


# -- the clip ratio against the rollout's cap ----------------------------------------------------
def padded_to(width: int) -> dict:
    """``padded_batch()`` with the response side padded to ``width`` tokens (as a rollout padding
    to its cap would), plus what verl's ``compute_data_metrics`` reads."""
    import torch.nn.functional as F

    batch = padded_batch()
    extra = width - RESP
    for key in ("input_ids", "attention_mask", "position_ids"):
        batch[key] = F.pad(batch[key], (0, extra))
    for key in ("responses", "response_mask", "old_log_probs", "rollout_log_probs"):
        batch[key] = F.pad(batch[key], (0, extra))
    bs = len(RESPONSE_LENS)
    batch["prompts"] = batch["input_ids"][:, :PROMPT]
    for key in ("token_level_scores", "token_level_rewards", "advantages", "returns"):
        batch[key] = torch.zeros(bs, width)
    return batch


def verl_clip_ratio(width: int) -> float:
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    return compute_data_metrics(DataProto.from_dict(tensors=padded_to(width)), use_critic=False)[
        "response_length/clip_ratio"]


@pytest.mark.parametrize("cap", [RESP, 16])
def test_clip_ratio_against_the_cap_equals_verls_figure_on_a_batch_padded_to_the_cap(cap):
    # verl's response_length/clip_ratio counts responses as long as the batch's padded width; the
    # glue's counts responses at the rollout's cap. On a batch padded to the cap they are the same
    # figure: 1 of 4 responses (8 tokens) at cap 8, none at cap 16.
    expected = verl_clip_ratio(cap)
    assert expected == pytest.approx(0.25 if cap == RESP else 0.0)
    v0 = left_right_2_no_padding(DataProto.from_dict(tensors=padded_to(cap)).to_tensordict())
    for data in (v0, v1_worker_batch()):
        total, count, at_cap = measure_batch(data, cap=cap).length
        assert at_cap / count == pytest.approx(expected)
        assert total / count == pytest.approx(sum(RESPONSE_LENS) / len(RESPONSE_LENS))


def test_clip_ratio_is_against_the_cap_not_the_batch_width():
    # the same batch, padded to its widest response (8) as V0 pads it: verl's figure says 1/4
    # responses are clipped, but with a cap of 16 none is: the glue feeds 0
    assert verl_clip_ratio(RESP) == pytest.approx(0.25)
    assert measure_batch(v0_worker_batch(), cap=16).length[2] == 0.0


def test_the_step_feeds_the_clip_ratio_over_its_updates():
    from verl_lrstab.glue.steps import StepState

    def clip_ratio(*lengths):
        state = StepState()
        for length in lengths:
            state.add_batch(BatchStats(length, [0.0, 0.0], None))
        return state.figures("k3", False)[0].clip_ratio

    assert clip_ratio([30.0, 4.0, 1.0], [10.0, 4.0, 2.0]) == pytest.approx(3 / 8)
    assert clip_ratio([30.0, 4.0]) is None  # no cap known: no clip ratio, never a made-up 0
    assert clip_ratio(None) is None


@pytest.mark.parametrize("tag,expected", [([0, 1, 0], (0, 1, False, 0)), ([1, 2, 1, 256], (1, 2, True, 256))])
def test_step_position_carries_the_response_cap(tag, expected):
    from verl_lrstab.glue.worker import step_position

    assert step_position(tag) == expected


def test_the_driver_reads_the_response_cap_from_verls_config():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data": {"max_response_length": 512},
                            "actor_rollout_ref": {"rollout": {"response_length": "${data.max_response_length}"}}})
    assert driver.response_cap(cfg) == 512
    assert driver.response_cap(OmegaConf.create({"data": {"max_response_length": 64}})) == 64
    assert driver.response_cap(OmegaConf.create({})) == 0
