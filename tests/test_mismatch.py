"""Mismatch figures (verl_lrstab.mismatch) and the mismatch-budget trigger (verl_lrstab.mismatch_trigger)."""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_lrstab.mismatch import (
    DEFAULT_THRESHOLD,
    STAT_FIELDS,
    all_reduce_stats,
    compute_stats,
    finalize,
    mismatch_metrics,
)
from verl_lrstab.mismatch_trigger import MismatchTrigger

LN2 = math.log(2.0)


def _batch(bs=6, T=40, scale=0.05, seed=0, dtype=torch.float64):
    """Trainer/rollout log-probs of real categorical draws, a noisy copy, and a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, T, 16, generator=g, dtype=torch.float64)
    old = torch.log_softmax(logits, -1)[..., 0]
    roll = torch.log_softmax(logits + scale * torch.randn(logits.shape, generator=g, dtype=torch.float64), -1)[..., 0]
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return old.to(dtype), roll.to(dtype), mask


def _nested(padded, mask):
    rows = [padded[i, : int(mask[i].sum())] for i in range(padded.shape[0])]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _assert_same(a, b, rel=1e-9):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-12), k


# -- known answers ---------------------------------------------------------------------------
def test_all_equal_log_probs_give_exactly_zero():
    old, _, mask = _batch(dtype=torch.float32)
    m = mismatch_metrics(old, old.clone(), mask)
    for key in ("k1", "k3", "seq_k1", "seq_k3", "max_abs_diff", "frac_over_thr", "n_nonfinite"):
        assert m[f"mismatch/{key}"] == 0.0, key
    assert m["mismatch/n_tokens"] == mask.sum().item()


def test_hand_computed_values():
    # d = old - rollout: row 0 = [ln2, -ln2, 0], row 1 = [1, <padding>]
    d = torch.tensor([[LN2, -LN2, 0.0], [1.0, 123.0, 0.0]], dtype=torch.float64)
    rollout = -torch.rand(2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.1
    old = rollout + d
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = mismatch_metrics(old, rollout, mask, threshold=0.5)
    k3_sum = (2 - 1 - LN2) + (0.5 - 1 + LN2) + 0.0 + (math.e - 2)  # exp(d) - 1 - d per token
    assert m["mismatch/k1"] == pytest.approx(-(LN2 - LN2 + 0 + 1) / 4, abs=1e-12)
    assert m["mismatch/k3"] == pytest.approx(k3_sum / 4, rel=1e-12)
    assert m["mismatch/seq_k1"] == pytest.approx(-1.0 / 2, rel=1e-12)  # per-sequence sums: 0 and -1
    assert m["mismatch/seq_k3"] == pytest.approx(k3_sum / 2, rel=1e-12)
    assert m["mismatch/max_abs_diff"] == pytest.approx(1.0, rel=1e-12)  # 123 is padding
    assert m["mismatch/frac_over_thr"] == pytest.approx(3 / 4)
    assert m["mismatch/n_tokens"] == 4 and m["mismatch/n_nonfinite"] == 0


def test_default_threshold_is_log2():
    assert DEFAULT_THRESHOLD == pytest.approx(LN2)
    rollout = torch.full((1, 4), -1.0, dtype=torch.float64)
    old = rollout + torch.tensor([[0.70, -0.70, 0.69, -0.69]], dtype=torch.float64)
    m = mismatch_metrics(old, rollout, torch.ones(1, 4))
    assert m["mismatch/frac_over_thr"] == pytest.approx(0.5)


def test_k3_is_nonnegative_and_matches_definition():
    old, roll, mask = _batch(scale=0.5)
    d = (old - roll)[mask.bool()]
    m = mismatch_metrics(old, roll, mask)
    assert m["mismatch/k3"] == pytest.approx((torch.exp(d) - 1 - d).mean().item(), rel=1e-10)
    assert m["mismatch/k1"] == pytest.approx((-d).mean().item(), rel=1e-10)
    assert m["mismatch/max_abs_diff"] == pytest.approx(d.abs().max().item())
    assert m["mismatch/k3"] > 0


# -- masking and non-finite values --------------------------------------------------------------
def test_padding_values_and_mask_dtype_do_not_matter():
    old, roll, mask = _batch()
    ref = mismatch_metrics(old, roll, mask)
    pad = ~mask.bool()
    old2, roll2 = old.clone(), roll.clone()
    old2[pad], roll2[pad] = 50.0, -50.0  # |d| = 100 where masked
    for m in (mask, mask.bool(), mask.float(), mask.int()):
        _assert_same(mismatch_metrics(old2, roll2, m), ref, rel=1e-12)


def test_nan_and_inf_in_padded_positions_are_ignored():
    old, roll, mask = _batch(dtype=torch.float32)
    ref = mismatch_metrics(old, roll, mask)
    pad = (~mask.bool()).nonzero()
    assert len(pad) >= 3
    old2, roll2 = old.clone(), roll.clone()
    old2[tuple(pad[0])], roll2[tuple(pad[1])] = float("nan"), float("nan")
    old2[tuple(pad[2])], roll2[tuple(pad[2])] = float("inf"), float("-inf")
    old2[tuple(pad[-1])] = float("-inf")
    got = mismatch_metrics(old2, roll2, mask)
    _assert_same(got, ref, rel=0)
    assert all(math.isfinite(v) for v in got.values())


def test_nonfinite_inside_the_mask_is_counted_and_left_out():
    old, roll, mask = _batch()
    old2 = old.clone()
    old2[0, 0], old2[0, 1] = float("nan"), float("-inf")  # row 0 is full length: both in the mask
    mask2 = mask.clone()
    mask2[0, :2] = 0
    ref = mismatch_metrics(old, roll, mask2)  # the same tokens, masked out
    got = mismatch_metrics(old2, roll, mask)
    assert got["mismatch/n_nonfinite"] == 2
    assert got["mismatch/n_tokens"] == ref["mismatch/n_tokens"]
    for key in ("k1", "k3", "seq_k1", "seq_k3", "max_abs_diff", "frac_over_thr"):
        assert got[f"mismatch/{key}"] == pytest.approx(ref[f"mismatch/{key}"], rel=1e-12), key


def test_bf16_inputs_are_computed_in_float32():
    old, roll, mask = _batch(scale=0.3)
    old_b, roll_b = old.bfloat16(), roll.bfloat16()
    _assert_same(mismatch_metrics(old_b, roll_b, mask), mismatch_metrics(old_b.float(), roll_b.float(), mask), rel=1e-6)


def test_float32_k3_is_accurate_for_small_differences():
    # bf16-vs-fp32-sized differences (|d| ~ 1e-3): exp(d) - 1 - d cancels in float32, expm1(d) - d does not.
    old, roll, mask = _batch(bs=32, T=256, scale=1e-3)  # mean |d| ~ 8e-4
    truth = mismatch_metrics(old, roll, mask)["mismatch/k3"]  # float64 inputs
    got = mismatch_metrics(old.float(), roll.float(), mask)["mismatch/k3"]
    assert 1e-8 < truth < 1e-5
    assert got == pytest.approx(truth, rel=1e-4)  # exp(d) - 1 - d in float32 is off by ~3e-3 here


# -- layouts ----------------------------------------------------------------------------------------
def test_nested_and_flat_layouts_match_padded():
    old, roll, mask = _batch()
    mask[2, :3] = 0  # a hole inside a sequence, as tool tokens in a multi-turn response
    ref = mismatch_metrics(old, roll, mask)
    lengths = mask.sum(-1) + 0
    full = (torch.arange(old.shape[1])[None] < (lengths + 3).clamp(max=old.shape[1])[:, None]).long()
    n_old, n_roll, n_mask = _nested(old, full), _nested(roll, full), _nested(mask, full)
    _assert_same(mismatch_metrics(n_old, n_roll, n_mask), ref, rel=1e-12)
    offsets = n_old.offsets()
    _assert_same(mismatch_metrics(n_old.values(), n_roll.values(), n_mask.values(), offsets=offsets), ref, rel=1e-12)


def test_nested_sequences_without_tokens_do_not_count():
    old, roll, mask = _batch()
    mask[1] = 0  # a rejected sequence / V1's synthetic padding sample
    ref = mismatch_metrics(old, roll, mask)
    full = torch.ones_like(mask)
    got = mismatch_metrics(_nested(old, full), _nested(roll, full), _nested(mask, full))
    assert got["mismatch/seq_k3"] == pytest.approx(ref["mismatch/seq_k3"], rel=1e-12)
    assert ref["mismatch/seq_k3"] == pytest.approx(ref["mismatch/k3"] * ref["mismatch/n_tokens"] / 5, rel=1e-12)


def test_absent_or_empty_rollout_log_probs_give_none():
    old, _, mask = _batch()
    assert compute_stats(old, None, mask) is None
    assert mismatch_metrics(old, None, mask) is None
    assert mismatch_metrics(old, torch.empty(0), mask) is None
    assert finalize(None) is None
    assert mismatch_metrics(old, old, mask) is None  # verl's bypass mode: old_log_probs IS rollout_log_probs


def test_warn_once_names_the_config_key(caplog):
    import verl_lrstab.mismatch as mm

    mm._warned.discard("missing")
    with caplog.at_level("WARNING", logger="verl_lrstab"):
        mm.warn_once("missing")
        mm.warn_once("missing")
    assert [r.getMessage().count("actor_rollout_ref.rollout.calculate_log_probs") for r in caplog.records] == [1]
    with pytest.raises(ValueError, match="allowed"):
        mm.warn_once("nope")


def test_no_response_token_gives_zero_stats_and_nothing_to_log():
    old, roll, mask = _batch()
    stats = compute_stats(old, roll, torch.zeros_like(mask))
    assert stats.tolist() == [0.0] * len(STAT_FIELDS)  # still joins the DP collective
    assert finalize(stats) is None
    empty = torch.empty(0, 8)
    assert compute_stats(empty, empty, empty).tolist() == [0.0] * len(STAT_FIELDS)


def test_bad_inputs_raise_clear_errors():
    old, roll, mask = _batch()
    with pytest.raises(ValueError, match="same shape"):
        compute_stats(old, roll[:, :-1], mask)
    with pytest.raises(ValueError, match="all be nested"):
        compute_stats(_nested(old, mask), roll, mask)
    with pytest.raises(ValueError, match="threshold"):
        compute_stats(old, roll, mask, threshold=-1.0)
    with pytest.raises(ValueError, match="different sequence lengths"):
        compute_stats(_nested(old, mask), _nested(roll, torch.ones_like(mask)), _nested(mask, mask))


# -- data-parallel aggregation ----------------------------------------------------------------------
def _combine(parts):
    n = len(STAT_FIELDS) - 1
    out = torch.stack(parts)
    return torch.cat([out[:, :n].sum(0), out[:, n:].max(0).values])


def test_split_batch_aggregates_to_the_whole_batch():
    old, roll, mask = _batch(bs=9, scale=0.4)
    whole = mismatch_metrics(old, roll, mask, threshold=0.1)
    parts = [compute_stats(old[s], roll[s], mask[s], threshold=0.1) for s in (slice(0, 4), slice(4, 9))]
    _assert_same(finalize(_combine(parts)), whole, rel=1e-12)


def _dp_worker(rank, world_size, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    old, roll, mask = _batch(bs=9, scale=0.4)
    rows = [slice(0, 4), slice(4, 9), slice(9, 9)][rank]  # rank 2 holds no sequence at all
    stats = all_reduce_stats(compute_stats(old[rows], roll[rows], mask[rows]))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(finalize(stats), f)
    dist.destroy_process_group()


def test_all_reduce_over_a_real_gloo_group(tmp_path):
    out = tmp_path / "out.json"
    mp.spawn(_dp_worker, args=(3, str(tmp_path / "init"), str(out)), nprocs=3, join=True)
    old, roll, mask = _batch(bs=9, scale=0.4)
    _assert_same(json.loads(out.read_text()), mismatch_metrics(old, roll, mask), rel=1e-12)


def test_all_reduce_is_a_noop_without_a_process_group():
    old, roll, mask = _batch()
    stats = compute_stats(old, roll, mask)
    assert torch.equal(all_reduce_stats(stats.clone()), stats)
    assert all_reduce_stats(None) is None


# -- agreement with verl's own figures ------------------------------------------------------------------
def test_k1_k3_equal_verl_rollout_corr_kl_and_k3_kl():
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_offpolicy_metrics,
        compute_rollout_corr_metrics_from_logprobs,
    )

    old, roll, mask = _batch(bs=8, T=64, scale=0.3)
    ours = mismatch_metrics(old, roll, mask)
    verl = compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=roll, response_mask=mask)
    # verl divides by (count + 1e-8): equal up to ~1e-8 / n_tokens relative
    assert ours["mismatch/k1"] == pytest.approx(verl["kl"], rel=1e-9)
    assert ours["mismatch/k3"] == pytest.approx(verl["k3_kl"], rel=1e-9)
    prefixed = compute_rollout_corr_metrics_from_logprobs(old, roll, mask)
    assert ours["mismatch/k3"] == pytest.approx(prefixed["rollout_corr/k3_kl"], rel=1e-9)
    # verl's sequence figure is a mean of per-sequence *means*; ours a mean of per-sequence *sums*.
    # With equal lengths L they differ exactly by the factor L.
    full = torch.ones_like(mask)
    ours_full = mismatch_metrics(old, roll, full)
    verl_full = compute_offpolicy_metrics(old, roll, full)
    assert ours_full["mismatch/seq_k1"] == pytest.approx(old.shape[1] * verl_full["log_ppl_diff"], rel=1e-7)


def test_verl_rollout_probs_diff_compares_probabilities_not_log_probs():
    from verl.protocol import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    # One low-probability token where the engines disagree 10x: 1e-4 vs 1e-3.
    old = torch.log(torch.tensor([[0.9, 0.5, 1e-4]]))
    roll = torch.log(torch.tensor([[0.9, 0.5, 1e-3]]))
    mask = torch.ones(1, 3, dtype=torch.long)
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask,
                                 "responses": torch.zeros(1, 3, dtype=torch.long)})
    verl = calculate_debug_metrics(batch)
    ours = mismatch_metrics(old, roll, mask)
    assert verl["training/rollout_probs_diff_max"] < 1e-3  # |p_trainer - p_rollout| hides it
    assert ours["mismatch/max_abs_diff"] == pytest.approx(math.log(10), rel=1e-5)
    assert ours["mismatch/frac_over_thr"] == pytest.approx(1 / 3)


# -- the mismatch-budget trigger -------------------------------------------------------------------------
def _feed(trig, values, start=1):
    return [s for s, v in enumerate(values, start=start) if trig.update(s, v)]


def test_fixed_budget_fires_after_patience_and_only_once():
    trig = MismatchTrigger(budget=1e-3, skip_first_steps=2, patience=3)
    values = [5e-3, 5e-3] + [1e-4, 2e-3, 2e-3, 1e-4, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3]
    assert _feed(trig, values) == [9]  # steps 1-2 skipped; steps 4-5 are a streak of 2 only
    assert trig.fired and trig.fired_step == 9 and trig.budget == 1e-3


def test_fixed_budget_above_the_mismatch_never_fires():
    trig = MismatchTrigger(budget=1e-2, skip_first_steps=0, patience=1)
    assert _feed(trig, [5e-3] * 50) == []


def test_calibrated_budget_is_factor_times_median_of_early_steps():
    trig = MismatchTrigger(budget_factor=4.0, calibration_steps=5, skip_first_steps=2, patience=2)
    early = [9.0, 9.0]  # warmup, ignored
    calib = [1e-4, 3e-4, 2e-4, 5e-2, 2e-4]  # one wild value: the median ignores it
    assert _feed(trig, early + calib) == []
    assert trig.baseline == pytest.approx(2e-4) and trig.budget == pytest.approx(8e-4)
    assert _feed(trig, [7e-4] * 10, start=8) == []
    assert _feed(trig, [9e-4, 9e-4], start=18) == [19]


def test_nan_and_none_are_skipped_without_breaking_a_streak():
    trig = MismatchTrigger(budget=1.0, skip_first_steps=0, patience=3)
    assert _feed(trig, [2.0, None, float("nan"), 2.0, float("inf"), "x", 2.0]) == [7]
    assert trig.num_skipped == 4
    cal = MismatchTrigger(calibration_steps=2, skip_first_steps=0)
    _feed(cal, [None, float("nan"), 1e-3])
    assert cal.budget is None  # invalid values do not calibrate


def test_min_budget_floors_a_zero_baseline():
    trig = MismatchTrigger(calibration_steps=3, skip_first_steps=0, patience=1, min_budget=1e-6)
    assert _feed(trig, [0.0, 0.0, 0.0, 5e-7, 5e-7]) == []
    assert trig.budget == 1e-6
    assert _feed(trig, [2e-6], start=6) == [6]


def test_state_dict_round_trip_resumes_mid_calibration_and_mid_streak():
    values = [1e-4, 2e-4, 1e-4, 1e-4, 3e-3, 3e-3, 1e-4, 3e-3, 3e-3, 3e-3, 3e-3]
    for cut in range(len(values)):
        ref = MismatchTrigger(calibration_steps=4, skip_first_steps=1, patience=3)
        fired_ref = _feed(ref, values)
        a = MismatchTrigger(calibration_steps=4, skip_first_steps=1, patience=3)
        fired = _feed(a, values[:cut])
        state = json.loads(json.dumps(a.state_dict()))  # plain Python types only
        b = MismatchTrigger(calibration_steps=4, skip_first_steps=1, patience=3)
        b.load_state_dict(state)
        fired += _feed(b, values[cut:], start=cut + 1)
        assert fired == fired_ref == [10], cut
        assert b.state_dict() == ref.state_dict()


def test_fixed_budget_wins_over_a_restored_calibrated_one():
    a = MismatchTrigger(calibration_steps=2, skip_first_steps=0)
    _feed(a, [1e-3, 1e-3])
    b = MismatchTrigger(budget=0.5, skip_first_steps=0)
    b.load_state_dict(a.state_dict())
    assert b.budget == 0.5


@pytest.mark.parametrize("kwargs, key", [
    ({"budget": 0.0}, "budget"),
    ({"budget": float("nan")}, "budget"),
    ({"budget_factor": -1}, "budget_factor"),
    ({"calibration_steps": 0}, "calibration_steps"),
    ({"skip_first_steps": -1}, "skip_first_steps"),
    ({"patience": 1.5}, "patience"),
    ({"min_budget": -1e-9}, "min_budget"),
])
def test_trigger_rejects_bad_options_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        MismatchTrigger(**kwargs)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
