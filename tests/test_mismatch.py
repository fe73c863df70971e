"""Mismatch figures (verl_lrstab.mismatch) and the mismatch-budget trigger (verl_lrstab.mismatch_trigger)."""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_lrstab.mismatch import (
    BYPASS_KEY,
    DEFAULT_THRESHOLD,
    STAT_FIELDS,
    TAIL_EDGES,
    TAIL_LABELS,
    FirstMiniBatchCapture,
    all_reduce_or_none,
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


def test_tail_shares_count_the_tokens_above_each_decade():
    # |d| of the 6 response tokens: 0, 5e-7, 2e-6, 3e-4, 0.05, 2.0; padding holds a 10 that must not count
    d = torch.tensor([[0.0, 5e-7, 2e-6, 3e-4], [-0.05, 2.0, 10.0, 10.0]], dtype=torch.float64)
    rollout = torch.full_like(d, -2.0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    m = mismatch_metrics(rollout + d, rollout, mask)
    above = {"1e-6": 4, "1e-5": 3, "1e-4": 3, "1e-3": 2, "1e-2": 2, "0.1": 1, "1": 1}
    assert TAIL_LABELS == tuple(above)
    for label, count in above.items():
        assert m[f"mismatch/frac_over_{label}"] == pytest.approx(count / 6), label


def test_tail_shares_fall_with_the_edge_and_match_a_direct_count():
    old, roll, mask = _batch(bs=16, scale=0.3)
    a = (old - roll)[mask.bool()].abs()
    m = mismatch_metrics(old, roll, mask)
    shares = [m[f"mismatch/frac_over_{label}"] for label in TAIL_LABELS]
    assert shares == sorted(shares, reverse=True)
    for edge, share in zip(TAIL_EDGES, shares):
        assert share == pytest.approx((a > edge).double().mean().item()), edge
    # jagged and padded layouts agree
    _assert_same(mismatch_metrics(_nested(old, mask), _nested(roll, mask), _nested(mask, mask)), m, rel=1e-12)


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


def test_the_same_tensor_gives_exact_zeros():
    # verl's bypass mode on the driver: old_log_probs IS rollout_log_probs (glue.batch_figures spots it)
    old, _, mask = _batch(dtype=torch.float32)
    m = mismatch_metrics(old, old, mask)
    assert m["mismatch/max_abs_diff"] == 0.0 and m["mismatch/n_tokens"] == mask.sum().item()
    assert math.copysign(1.0, m["mismatch/k1"]) == 1.0  # +0.0, not -0.0, in the logs


def test_nan_stats_from_a_failed_rank_give_nothing_to_log():
    old, roll, mask = _batch()
    stats = compute_stats(old, roll, mask)
    assert finalize(_combine([stats, torch.full_like(stats, float("nan"))])) is None


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
    local = compute_stats(old[rows], roll[rows], mask[rows])
    n = len(STAT_FIELDS)
    or_none = all_reduce_or_none(local, n, n_max=1)
    # one rank that cannot measure: every rank gets None, not a partial figure
    one_missing = all_reduce_or_none(None if rank == 1 else local, n, n_max=1)
    assert one_missing is None, (rank, one_missing)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"all_reduce_or_none": finalize(or_none)}, f)
    dist.destroy_process_group()


def test_all_reduce_over_a_real_gloo_group(tmp_path):
    out = tmp_path / "out.json"
    mp.spawn(_dp_worker, args=(3, str(tmp_path / "init"), str(out)), nprocs=3, join=True)
    old, roll, mask = _batch(bs=9, scale=0.4)
    got = json.loads(out.read_text())
    _assert_same(got["all_reduce_or_none"], mismatch_metrics(old, roll, mask), rel=1e-12)


def test_all_reduce_is_a_noop_without_a_process_group():
    old, roll, mask = _batch()
    stats = compute_stats(old, roll, mask)
    assert torch.equal(all_reduce_or_none(stats, len(STAT_FIELDS), n_max=1), stats.double())
    assert all_reduce_or_none(None, len(STAT_FIELDS), n_max=1) is None


# -- bypass mode: the first mini-batch's training forward (mismatch.FirstMiniBatchCapture) ---------------
def _micro_batches(old, roll, mask, sizes):
    """Consecutive row slices of the batch, as verl's micro-batches."""
    out, start = [], 0
    for n in sizes:
        out.append((old[start:start + n], roll[start:start + n], mask[start:start + n], n))
        start += n
    return out


def test_capture_covers_exactly_the_first_mini_batch():
    old, roll, mask = _batch(bs=12, scale=0.3)
    capture = FirstMiniBatchCapture(n_sequences=6)  # mini-batch 1 = rows 0-5, in micro-batches 2 + 4
    added = [capture.add_micro_batch(*mb) for mb in _micro_batches(old, roll, mask, [2, 4, 3, 3])]
    assert added == [True, True, False, False] and capture.complete
    capture.reduce()
    got = capture.metrics()
    assert got.pop(BYPASS_KEY) == 1.0
    _assert_same(got, mismatch_metrics(old[:6], roll[:6], mask[:6]), rel=1e-12)
    assert got["mismatch/n_tokens"] == mask[:6].sum().item() < mask.sum().item()


def test_capture_reads_log_probs_that_require_grad_without_touching_the_graph():
    old, roll, mask = _batch(bs=4, scale=0.2, dtype=torch.float32)
    log_probs = old.clone().requires_grad_(True)
    capture = FirstMiniBatchCapture(4)
    capture.add_micro_batch(log_probs * 1.0, roll, mask, 4)
    assert log_probs.grad is None and capture.stats.requires_grad is False
    capture.reduce()
    assert capture.metrics()["mismatch/k3"] == pytest.approx(mismatch_metrics(old, roll, mask)["mismatch/k3"], rel=1e-6)


def _view(model_output, data):
    return model_output["log_probs"], data["rollout_log_probs"], data["response_mask"], data["n"]


def test_wrapped_loss_returns_verls_result_and_passes_other_calls_through():
    old, roll, mask = _batch(bs=4, scale=0.2)
    calls = []

    def loss_fn(model_output=None, data=None, dp_group=None, **kwargs):
        calls.append(sorted(kwargs) or "loss")
        return torch.tensor(1.5), {"actor/pg_loss": 1.5}

    capture = FirstMiniBatchCapture(4)
    wrapped = capture.wrap_loss(loss_fn, _view)
    batch = {"rollout_log_probs": roll, "response_mask": mask, "n": 4}
    loss, metrics = wrapped(model_output={"log_probs": old}, data=batch, dp_group=None)
    assert loss.item() == 1.5 and metrics == {"actor/pg_loss": 1.5}
    wrapped(student_logits=torch.zeros(1), data=batch)  # verl's logits-processor use of the loss function
    assert calls == ["loss", ["student_logits"]] and capture.seen == 4
    capture.reduce()
    _assert_same({k: v for k, v in capture.metrics().items() if k != BYPASS_KEY}, mismatch_metrics(old, roll, mask))


def test_a_failing_view_never_breaks_the_loss_and_logs_nothing(caplog):
    def loss_fn(model_output=None, data=None, dp_group=None):
        return torch.tensor(2.0), {}

    capture = FirstMiniBatchCapture(4)
    wrapped = capture.wrap_loss(loss_fn, lambda mo, d: mo["no_such_key"])
    with caplog.at_level("WARNING", logger="verl_lrstab"):
        assert wrapped(model_output={}, data={}, dp_group=None)[0].item() == 2.0
    assert "could not read" in caplog.text
    assert capture.reduce() is None and capture.metrics() is None  # no figures rather than a partial one


def test_optimizer_pre_hook_reduces_once_at_the_first_step():
    old, roll, mask = _batch(bs=8, scale=0.3)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    capture = FirstMiniBatchCapture(4)
    seen = []
    handle = optimizer.register_step_pre_hook(capture.optimizer_pre_hook(on_reduced=seen.append))
    for mb in _micro_batches(old, roll, mask, [2, 2]):  # mini-batch 1, then its optimizer step
        capture.add_micro_batch(*mb)
    param.grad = torch.ones(3)
    optimizer.step()
    assert capture.reduced and len(seen) == 1
    capture.add_micro_batch(old[4:], roll[4:], mask[4:], 4)  # mini-batch 2, after the step: ignored
    optimizer.step()
    handle.remove()
    assert len(seen) == 1 and seen[0] is capture.global_stats  # the global stats, reduced once
    expected = mismatch_metrics(old[:4], roll[:4], mask[:4])
    assert finalize(seen[0])["mismatch/k3"] == pytest.approx(expected["mismatch/k3"], rel=1e-12)
    assert capture.metrics() == {**finalize(seen[0]), BYPASS_KEY: 1.0}


class _Worker:
    """What the glue hands capture_first_mini_batch: an object whose ``loss_fn`` verl's engine reads."""

    def __init__(self):
        self.loss_fn = lambda model_output=None, data=None, dp_group=None: (torch.tensor(0.0), {})

    def update(self, batches, optimizer=None, fail=False):
        for model_output, data in batches:
            self.loss_fn(model_output=model_output, data=data, dp_group=None)
            if optimizer is not None:
                optimizer.step()
            if fail:
                raise RuntimeError("verl failed")


def test_capture_context_restores_the_loss_and_reduces_at_the_step():
    from verl_lrstab.mismatch import capture_first_mini_batch

    old, roll, mask = _batch(bs=4, scale=0.3)
    batches = [({"log_probs": old[:2]}, {"rollout_log_probs": roll[:2], "response_mask": mask[:2], "n": 2}),
               ({"log_probs": old[2:]}, {"rollout_log_probs": roll[2:], "response_mask": mask[2:], "n": 2})]
    worker, original = _Worker(), None
    original = worker.loss_fn
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    optimizer = torch.optim.SGD([param], lr=0.1)
    seen = []
    with capture_first_mini_batch(worker, 2, _view, optimizer=optimizer, on_reduced=seen.append) as capture:
        assert worker.loss_fn is not original
        worker.update(batches, optimizer)  # two mini-batches of 2, one optimizer step each
    assert worker.loss_fn is original and not optimizer._optimizer_step_pre_hooks
    assert len(seen) == 1 and seen[0] is capture.global_stats
    assert capture.metrics()["mismatch/k3"] == pytest.approx(
        mismatch_metrics(old[:2], roll[:2], mask[:2])["mismatch/k3"])

    with pytest.raises(RuntimeError, match="verl failed"):  # verl's error propagates, the loss is restored
        with capture_first_mini_batch(worker, 2, _view, optimizer=optimizer):
            worker.update(batches[:1], fail=True)
    assert worker.loss_fn is original and not optimizer._optimizer_step_pre_hooks


def test_capture_context_without_an_optimizer_hook_reduces_late_and_warns(caplog):
    from verl_lrstab import mismatch as mm
    from verl_lrstab.mismatch import capture_first_mini_batch

    mm._warned.discard("bypass_late")
    old, roll, mask = _batch(bs=2, scale=0.3)
    worker, seen = _Worker(), []
    with caplog.at_level("WARNING", logger="verl_lrstab"):
        with capture_first_mini_batch(worker, 2, _view, optimizer=object(), on_reduced=seen.append) as capture:
            worker.update([({"log_probs": old}, {"rollout_log_probs": roll, "response_mask": mask, "n": 2})])
    assert capture.reduced and "trigger skips" in caplog.text
    assert len(seen) == 1 and seen[0] is capture.global_stats  # after the block: too late for this step's LR
    assert capture.metrics()["mismatch/k3"] == pytest.approx(mismatch_metrics(old, roll, mask)["mismatch/k3"])


def test_capture_rejects_a_bad_size():
    with pytest.raises(ValueError, match="n_sequences"):
        FirstMiniBatchCapture(0)


def _bypass_dp_worker(rank, world_size, init_file, out_file, fail_rank):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    old, roll, mask = _batch(bs=8, scale=0.4)
    rows = slice(4 * rank, 4 * rank + 4)  # each rank: 4 rows, its first mini-batch = 2 rows
    capture = FirstMiniBatchCapture(2)
    for mb in _micro_batches(old[rows], roll[rows], mask[rows], [1, 1, 2]):
        capture.add_micro_batch(*mb) if rank != fail_rank else capture.add_micro_batch(mb[0][:, :-1], *mb[1:])
    capture.reduce()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(capture.metrics(), f)
    dist.destroy_process_group()


@pytest.mark.parametrize("fail_rank", [-1, 1])
def test_bypass_capture_all_reduces_over_a_real_gloo_group(tmp_path, fail_rank):
    out = tmp_path / "out.json"
    mp.spawn(_bypass_dp_worker, args=(2, str(tmp_path / "init"), str(out), fail_rank), nprocs=2, join=True)
    got = json.loads(out.read_text())
    if fail_rank >= 0:
        assert got is None  # one rank could not measure: no partial figure on any rank
        return
    old, roll, mask = _batch(bs=8, scale=0.4)
    first = [0, 1, 4, 5]  # rank 0's and rank 1's first mini-batches
    assert got.pop(BYPASS_KEY) == 1.0
    _assert_same(got, mismatch_metrics(old[first], roll[first], mask[first]), rel=1e-12)


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
    trig = MismatchTrigger({"mismatch_budget": 1e-3, "skip_first_steps": 2, "patience": 3})
    values = [5e-3, 5e-3] + [1e-4, 2e-3, 2e-3, 1e-4, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3]
    assert _feed(trig, values) == [9]  # steps 1-2 skipped; steps 4-5 are a streak of 2 only
    assert trig.fired and trig.fired_step == 9 and trig.budget == 1e-3


def test_fixed_budget_above_the_mismatch_never_fires():
    trig = MismatchTrigger({"mismatch_budget": 1e-2, "skip_first_steps": 0, "patience": 1})
    assert _feed(trig, [5e-3] * 50) == []


def test_calibrated_budget_is_factor_times_median_of_early_steps():
    trig = MismatchTrigger({"mismatch_budget_factor": 4.0, "mismatch_calibration_steps": 5, "skip_first_steps": 2,
                            "patience": 2})
    early = [9.0, 9.0]  # warmup, ignored
    calib = [1e-4, 3e-4, 2e-4, 5e-2, 2e-4]  # one wild value: the median ignores it
    assert _feed(trig, early + calib) == []
    assert trig.baseline == pytest.approx(2e-4) and trig.budget == pytest.approx(8e-4)
    assert _feed(trig, [7e-4] * 10, start=8) == []
    assert _feed(trig, [9e-4, 9e-4], start=18) == [19]


def test_nan_and_none_are_skipped_without_breaking_a_streak():
    trig = MismatchTrigger({"mismatch_budget": 1.0, "skip_first_steps": 0, "patience": 3})
    assert _feed(trig, [2.0, None, float("nan"), 2.0, float("inf"), "x", 2.0]) == [7]
    assert trig.num_skipped == 4
    cal = MismatchTrigger({"mismatch_calibration_steps": 2, "skip_first_steps": 0})
    _feed(cal, [None, float("nan"), 1e-3])
    assert cal.budget is None  # invalid values do not calibrate


def test_min_budget_floors_a_zero_baseline():
    trig = MismatchTrigger({"mismatch_calibration_steps": 3, "skip_first_steps": 0, "patience": 1})
    assert _feed(trig, [0.0, 0.0, 0.0, 5e-7, 5e-7]) == []
    assert trig.budget == 1e-6
    assert _feed(trig, [2e-6], start=6) == [6]


def test_state_dict_round_trip_resumes_mid_calibration_and_mid_streak():
    values = [1e-4, 2e-4, 1e-4, 1e-4, 3e-3, 3e-3, 1e-4, 3e-3, 3e-3, 3e-3, 3e-3]
    for cut in range(len(values)):
        ref = MismatchTrigger({"mismatch_calibration_steps": 4, "skip_first_steps": 1, "patience": 3})
        fired_ref = _feed(ref, values)
        a = MismatchTrigger({"mismatch_calibration_steps": 4, "skip_first_steps": 1, "patience": 3})
        fired = _feed(a, values[:cut])
        state = json.loads(json.dumps(a.state_dict()))  # plain Python types only
        b = MismatchTrigger({"mismatch_calibration_steps": 4, "skip_first_steps": 1, "patience": 3})
        b.load_state_dict(state)
        fired += _feed(b, values[cut:], start=cut + 1)
        assert fired == fired_ref == [10], cut
        assert b.state_dict() == ref.state_dict()


def test_fixed_budget_wins_over_a_restored_calibrated_one():
    a = MismatchTrigger({"mismatch_calibration_steps": 2, "skip_first_steps": 0})
    _feed(a, [1e-3, 1e-3])
    b = MismatchTrigger({"mismatch_budget": 0.5, "skip_first_steps": 0})
    b.load_state_dict(a.state_dict())
    assert b.budget == 0.5


@pytest.mark.parametrize("kwargs, key", [
    ({"mismatch_budget": 0.0}, "mismatch_budget"),
    ({"mismatch_budget": float("nan")}, "mismatch_budget"),
    ({"mismatch_budget_factor": -1}, "mismatch_budget_factor"),
    ({"mismatch_calibration_steps": 0}, "mismatch_calibration_steps"),
    ({"skip_first_steps": -1}, "skip_first_steps"),
    ({"patience": 1.5}, "patience"),
    ({"trigger": "length"}, "trigger"),
])
def test_trigger_rejects_bad_options_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"actor_rollout_ref\.actor\.optim\.length_surge\.{key}=.* is invalid: allowed"):
        MismatchTrigger(kwargs)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
