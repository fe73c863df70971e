"""LengthSurgeParamScheduler against megatron-core's real OptimizerParamScheduler and ChainedOptimizer.

No verl import: this file also runs on the megatron-core 0.19 line (Python 3.12,
``make test-megatron312``). The optimizer is megatron-core's ``ChainedOptimizer`` over two
torch optimizers whose groups carry the keys megatron-core's ``_get_param_groups`` sets
(``wd_mult`` 0 for biases and norms, a decoupled ``max_lr`` for embeddings).
"""

import copy
import io
import logging
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from verl_lrstab.detectors import UpdateFigures  # noqa: E402
from verl_lrstab.megatron import LengthSurgeParamScheduler  # noqa: E402
from verl_lrstab.scheduler import LengthSurgeLR  # noqa: E402

LR, DECOUPLED_LR, WD = 1e-6, 2e-6, 0.1
# Small ratio detector: a surge from 100 to 300 tokens at update 7 is reported at update 7.
FAST = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3, "patience": 1}
SURGE = [100.0] * 6 + [300.0] * 34


def chained():
    """megatron-core's ChainedOptimizer: dense groups (decay, no decay) + an embedding group."""
    w, b, emb = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(3))
    common = {"lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False}
    dense = torch.optim.AdamW([
        {"params": [w], "wd_mult": 1.0, "max_lr": LR, "min_lr": 0.0, "default_config": True, **common},
        {"params": [b], "wd_mult": 0.0, "max_lr": LR, "min_lr": 0.0, "default_config": True, **common},
    ], lr=LR)
    embedding = torch.optim.AdamW([{"params": [emb], "wd_mult": 1.0, "max_lr": DECOUPLED_LR, "min_lr": 1e-7,
                                    "default_config": False, **common}], lr=LR)
    return ChainedOptimizer([dense, embedding]), (w, b, emb)


def args(warmup=0, init_lr=0.0, **kw):
    base = dict(init_lr=init_lr, max_lr=LR, min_lr=0.0, lr_warmup_steps=warmup, lr_decay_steps=1000,
                start_wd=WD, end_wd=WD, wd_incr_steps=1000, wd_incr_style="constant",
                use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    base.update(kw)
    return base


def make(config=None, **kw):
    opt, params = chained()
    return opt, LengthSurgeParamScheduler(opt, config, **args(**kw)), params


def groups(opt):
    return [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def drive(sched, opt, values):
    out = []
    for v in values:
        sched.step(1, response_length=v)
        out.append(groups(opt))
    return out


def test_constructor_step0_sets_the_lr_without_feeding_the_detector():
    opt, sched, _ = make(FAST, warmup=4, init_lr=1e-7)
    assert sched.num_steps == 0 and sched.lr_decay_style == "length_surge"
    assert sched.schedule.detector.last_step is None and sched.schedule.detector.num_skipped == 0
    # Megatron's warmup starts at init_lr for every group; no-decay groups get weight decay 0.
    assert groups(opt) == [(1e-7, WD), (1e-7, 0.0), (1e-7, WD)]


def test_matches_megatron_constant_schedule_until_the_decay():
    """Warmup from lr_warmup_init, per-group max_lr and wd_mult: identical to the stock class."""
    values = [100.0] * 12
    stock_opt, _ = chained()
    stock = OptimizerParamScheduler(stock_opt, lr_decay_style="constant", **args(warmup=4, init_lr=1e-7))
    ours_opt, ours, _ = make(warmup=4, init_lr=1e-7)
    assert groups(ours_opt) == groups(stock_opt)
    for v in values:
        stock.step(1)
        ours.step(1, response_length=v)
        assert groups(ours_opt) == groups(stock_opt)
    # Closed form of Megatron's warmup: init + (max - init) * n / W, n = 1..4, then max.
    ours_opt, ours, _ = make(warmup=4, init_lr=1e-7)
    lrs = [g[0][0] for g in drive(ours, ours_opt, values[:6])]
    assert lrs == pytest.approx([1e-7 + 9e-7 * n / 4 for n in (1, 2, 3, 4)] + [LR, LR], rel=1e-12)


def test_surge_then_closed_form_decay_on_every_group():
    opt, sched, _ = make({**FAST, "origin": "start"})  # the paper's form (the default halves at the surge)
    trace = drive(sched, opt, SURGE)
    assert sched.surge_step == 7 and sched.decay_period == 13  # round(1.8 * 7)
    # trace[u - 1] is set after update u: the LR of update u + 1 (verl logs it as actor/lr).
    # Halvings counted from the start: in force from update 13 (x0.5), 26 (x0.25), 39 (x0.125).
    for u, scale in ((1, 1.0), (11, 1.0), (12, 0.5), (24, 0.5), (25, 0.25), (37, 0.25), (38, 0.125), (40, 0.125)):
        assert trace[u - 1] == [(LR * scale, WD), (LR * scale, 0.0), (DECOUPLED_LR * scale, WD)], u
    assert sched.metrics()["lrstab/lr_scale"] == 0.125 and sched.metrics()["lrstab/surge_step"] == 7


def test_floor_is_min_lr_ratio_of_each_groups_max_lr():
    opt, sched, _ = make({**FAST, "decay_period": 2, "min_lr_ratio": 0.1})
    drive(sched, opt, [100.0] * 20)
    assert groups(opt) == [(LR * 0.1, WD), (LR * 0.1, 0.0), (DECOUPLED_LR * 0.1, WD)]


def test_same_trajectory_as_the_fsdp_scheduler():
    """One implementation: with Megatron's warmup from 0, the LR scale equals LengthSurgeLR's."""
    config = {**FAST, "origin": "surge"}
    opt, sched, _ = make(config, warmup=3)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    fsdp = LengthSurgeLR(torch_opt, config, warmup_steps=3)
    assert opt.param_groups[0]["lr"] == pytest.approx(fsdp.get_last_lr()[0], abs=0)
    for v in SURGE:
        sched.step(1, response_length=v)
        torch_opt.step()
        fsdp.step(v)
        assert opt.param_groups[0]["lr"] == pytest.approx(fsdp.get_last_lr()[0], rel=1e-12)
        assert sched.metrics() == pytest.approx(fsdp.metrics(), nan_ok=True)
    assert sched.surge_step == fsdp.surge_step == 7


def test_weight_decay_follows_wd_mult_through_real_adamw_steps():
    opt, sched, (w, b, emb) = make({**FAST, "decay_period": 1})
    for update in (1, 2, 3):
        for p in (w, b, emb):
            p.grad = torch.zeros_like(p)  # zero grads: AdamW moves a weight only by its decay
        before = (w.detach()[0].item(), emb.detach()[0].item())
        for inner in opt.chained_optimizers:
            inner.step()
        # Update u runs at LR x 0.5**u (period 1, halvings from the start), WD x wd_mult.
        assert float(w[0]) == pytest.approx(before[0] * (1 - LR * 0.5**update * WD), rel=1e-12)
        assert float(emb[0]) == pytest.approx(before[1] * (1 - DECOUPLED_LR * 0.5**update * WD), rel=1e-12)
        sched.step(1, response_length=100.0)
    assert float(b[0]) == 1.0  # wd_mult 0: never decayed


def test_a_handed_length_is_consumed_by_verls_bare_step():
    opt, sched, _ = make({"skip_first_steps": 0})
    sched.observe_update(UpdateFigures(response_length=321.0))
    sched.step(1)  # what verl's MegatronEngine.lr_scheduler_step calls
    assert sched.metrics()["lrstab/response_length"] == 321.0 and not sched.figures_waiting
    sched.step(1)  # no value this step: skipped, not reused
    assert "lrstab/response_length" not in sched.metrics() and sched.metrics()["lrstab/skipped_steps"] == 1


def test_a_handed_score_reaches_the_cusum_detector_once():
    opt, sched, _ = make({"skip_first_steps": 0})
    sched.observe_update(UpdateFigures(response_length=300.0, score=0.75))  # the glue's co-signal (critic/score/mean)
    sched.step(1)
    assert sched.metrics()["lrstab/score"] == 0.75 and not sched.figures_waiting
    sched.observe_update(UpdateFigures(response_length=300.0))
    sched.step(1)  # no score this update: unavailable, not reused
    assert "lrstab/score" not in sched.metrics()  # NaN figures are not logged


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, 0.0, -5.0])
def test_bad_lengths_never_crash_or_fake_a_surge(bad):
    opt, sched, _ = make(FAST)
    drive(sched, opt, [100.0] * 6 + [bad] * 10)
    assert sched.surge_step is None and sched.metrics()["lrstab/skipped_steps"] == 10
    assert groups(opt)[0] == (LR, WD)


def roundtrip(state):
    """What a checkpoint does: torch.save, then torch.load(weights_only=True) in another process."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("at", [5, 9, 20])  # before the surge, just after it, after the first halving
def test_resume_continues_the_exact_trajectory(at):
    opt, sched, _ = make(FAST, warmup=2, init_lr=1e-8)
    full = drive(sched, opt, SURGE)
    full_metrics = sched.metrics()

    opt, sched, _ = make(FAST, warmup=2, init_lr=1e-8)
    drive(sched, opt, SURGE[:at])
    state = roundtrip(sched.state_dict())
    assert state["num_steps"] == at and state["lr_decay_style"] == "length_surge"

    opt2, resumed, _ = make(FAST, warmup=2, init_lr=1e-8)
    resumed.load_state_dict(state)
    assert resumed.num_steps == at and groups(opt2) == full[at - 1]
    # The replay step(num_steps) inside load_state_dict did not feed the detector.
    assert repr(resumed.schedule.state_dict()) == repr(sched.schedule.state_dict())
    assert resumed.schedule.detector.last_step == at
    assert drive(resumed, opt2, SURGE[at:]) == full[at:]
    assert resumed.metrics() == pytest.approx(full_metrics, nan_ok=True)


def test_resume_from_a_stock_checkpoint_warns_and_keeps_length_surge(caplog):
    stock_opt, _ = chained()
    stock = OptimizerParamScheduler(stock_opt, lr_decay_style="constant", **args())
    for _ in range(8):
        stock.step(1)
    opt, sched, _ = make(FAST)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        sched.load_state_dict(roundtrip(stock.state_dict()))
    assert "no length_surge state" in caplog.text
    assert sched.num_steps == 8 and sched.lr_decay_style == "length_surge"
    assert sched.schedule.detector.last_step is None  # nothing was fed by the replay
    drive(sched, opt, [100.0] * 6 + [300.0] * 4)
    assert sched.surge_step == 15  # the detector works from the resumed step on


def test_a_changed_option_is_named_as_on_fsdp(caplog):
    # one behaviour on both engines (FedSchedule._restore_schedule; FSDP: tests/test_glue_guarantees.py)
    opt, sched, _ = make({**FAST, "period_factor": 1.8})
    drive(sched, opt, [100.0] * 3)
    opt2, resumed, _ = make({**FAST, "period_factor": 1.2})
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        resumed.load_state_dict(roundtrip(sched.state_dict()))
    assert "options changed since the checkpoint at update 3" in caplog.text
    assert "'period_factor': (1.8, 1.2)" in caplog.text
    assert resumed.config.period_factor == 1.2  # the configured options apply from now on


def test_checkpoint_max_lr_wins_with_a_warning(caplog):
    opt, sched, _ = make(FAST)
    drive(sched, opt, [100.0] * 3)
    state = roundtrip(sched.state_dict())
    opt2, resumed, _ = make(FAST, max_lr=5e-7)
    with caplog.at_level(logging.WARNING, logger="verl_lrstab"):
        resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.max_lr == LR and "configured optim.lr 5e-07 is ignored" in caplog.text
