"""The mismatch split by version lag (verl_lrstab/version_split.py): a batch with known versions and
known log-probs, each figure checked against the value computed here by hand (float64 inputs, so
the package computes in float64 and agrees to rounding)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_lrstab import mismatch, version_split as vs

# version -> lag as the trainer side maps them: 3 is the trainer's current weights, 2 one behind
LAGS = {3: 0, 2: 1, 1: 2}
# five samples: two fresh, one a version behind, one partial (sampled on 2 then 3), one without versions
MIN = [3, 3, 2, 2, None]
MAX = [3, 3, 2, 3, None]
OLD = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
ROLL = [[-1.0, -2.5, 9.0], [-0.7, 5.0, 5.0], [-2.0, -1.0, -1.0], [-1.5, 0.0, 0.0], [-1.7, 0.0, 0.0]]
MASK = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]]


def k3(d: float) -> float:
    return math.expm1(d) - d


def padded():
    return (torch.tensor(OLD, dtype=torch.float64), torch.tensor(ROLL, dtype=torch.float64),
            torch.tensor(MASK, dtype=torch.int64))


def jagged():
    lengths = [2, 1, 3, 1, 1]
    rows = [[torch.tensor(r[:n], dtype=dt) for r, n in zip(src, lengths)]
            for src, dt in ((OLD, torch.float64), (ROLL, torch.float64), (MASK, torch.int64))]
    return tuple(torch.nested.nested_tensor(r, layout=torch.jagged) for r in rows)


def test_samples_are_grouped_by_lag_partial_ones_stale():
    ids = vs.group_ids(MIN, MAX, LAGS).tolist()
    assert [vs.GROUPS[i] for i in ids] == ["fresh", "fresh", "lag_1", "partial", "unknown"]
    # a partial sample is stale even when its newest version is the trainer's
    assert vs.GROUPS[vs.group_ids([2], [3], {2: 1, 3: 0}).item()] == "partial"
    assert [vs.GROUPS[i] for i in vs.group_ids([9, 7, 3], [9, 7, 3], {9: 6, 7: -1}).tolist()] == \
        ["lag_4_or_more", "unknown", "unknown"]  # clipped; a negative lag and an unmapped version are unknown


@pytest.mark.parametrize("layout", [padded, jagged])
def test_each_split_figure_equals_the_hand_computed_value(layout):
    old, roll, mask = layout()
    split = vs.split_stats(old, roll, mask, vs.group_ids(MIN, MAX, LAGS))
    assert split.shape == (vs.SIZE,)
    f = vs.split_figures(split)
    # fresh: d = old - roll = 0, 0.5 (sample 0), 0.2 (sample 1); padding (9.0, 5.0) never counts
    d = [0.0, 0.5, 0.2]
    assert f["mismatch/k1"] == pytest.approx(-sum(d) / 3, rel=1e-12)
    assert f["mismatch/k3"] == pytest.approx(sum(map(k3, d)) / 3, rel=1e-12)
    assert f["mismatch/seq_k1"] == pytest.approx(-sum(d) / 2, rel=1e-12)
    assert f["mismatch/seq_k3"] == pytest.approx(sum(map(k3, d)) / 2, rel=1e-12)
    assert f["mismatch/max_abs_diff"] == pytest.approx(0.5, rel=1e-12)
    assert f["mismatch/frac_over_thr"] == 0.0
    assert f["mismatch/frac_over_0.1"] == pytest.approx(2 / 3)
    assert f["mismatch/n_tokens"] == 3.0
    # a version behind: d = 1, 0, 0
    assert f["mismatch/stale/lag_1/k1"] == pytest.approx(-1 / 3, rel=1e-12)
    assert f["mismatch/stale/lag_1/k3"] == pytest.approx(k3(1.0) / 3, rel=1e-12)
    assert f["mismatch/stale/lag_1/seq_k3"] == pytest.approx(k3(1.0), rel=1e-12)
    assert f["mismatch/stale/lag_1/max_abs_diff"] == pytest.approx(1.0, rel=1e-12)
    assert f["mismatch/stale/lag_1/frac_over_thr"] == pytest.approx(1 / 3)  # |1| > log 2
    assert f["mismatch/stale/lag_1/n_tokens"] == 3.0
    # the partial rollout: d = 0.5, counted stale
    assert f["mismatch/stale/partial/k3"] == pytest.approx(k3(0.5), rel=1e-12)
    assert f["mismatch/stale/partial/n_tokens"] == 1.0
    # no versions: d = -0.3
    assert f["mismatch/stale/unknown/k1"] == pytest.approx(0.3, rel=1e-12)
    assert f["mismatch/stale/unknown/k3"] == pytest.approx(k3(-0.3), rel=1e-12)
    # fresh samples over the samples with a response token: 2 of 5
    assert f[vs.FRESH_SHARE_KEY] == pytest.approx(2 / 5)
    # groups without a sample log nothing
    assert not any(k.startswith(("mismatch/stale/lag_2/", "mismatch/stale/lag_3/")) for k in f)


def test_the_unsplit_figures_are_the_sum_of_the_groups():
    old, roll, mask = padded()
    split = vs.split_stats(old, roll, mask, vs.group_ids(MIN, MAX, LAGS))
    whole = mismatch.compute_stats(old, roll, mask)
    total = vs.group_stats(split, 0)
    for g in range(1, len(vs.GROUPS)):
        total = mismatch._combine(total, vs.group_stats(split, g))
    assert torch.allclose(total, whole, rtol=1e-12, atol=0)


def test_a_step_without_a_fresh_sample_has_no_engine_figure_and_a_zero_share():
    old, roll, mask = padded()
    split = vs.split_stats(old, roll, mask, vs.group_ids(MIN, MAX, {3: 1, 2: 2}))
    assert vs.fresh_stats(split) is None
    f = vs.split_figures(split)
    assert "mismatch/k3" not in f and f[vs.FRESH_SHARE_KEY] == 0.0
    assert f["mismatch/stale/lag_1/n_tokens"] == 3.0  # samples 0 and 1 are now one version behind
    assert f["mismatch/stale/lag_2/k3"] == pytest.approx(k3(1.0) / 3, rel=1e-12)


def test_two_updates_combine_as_one_batch():
    old, roll, mask = padded()
    ids = vs.group_ids(MIN, MAX, LAGS)
    both = vs.split_stats(old, roll, mask, ids)
    first = vs.split_stats(old[:2], roll[:2], mask[:2], ids[:2])
    rest = vs.split_stats(old[2:], roll[2:], mask[2:], ids[2:])
    assert torch.allclose(vs.combine(first, rest), both, rtol=1e-12, atol=0)
