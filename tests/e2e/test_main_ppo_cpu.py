"""End-to-end: verl 0.9.1's real ``main_ppo`` (GRPO, FSDP2 on gloo, Ray, agent loop, reward loop)
on CPU with ``lr_scheduler_type=length_surge`` and the default detector (``cusum``), read back from
verl's own file-logger JSONL.

The CPU stand-ins are the ``cpu`` platform and the ``transformers`` rollout (verl_lrstab_cpu);
everything else is verl's code. The reward ``longer_is_better`` provokes a real length surge.
Runs are shared between tests (``main_ppo`` fixture); the V1 surge/resume forms are ``slow``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.detectors import UpdateFigures
from verl_lrstab.glue.update_metrics import UPDATE_FIGURES
from verl_lrstab.log_replay import replay
from verl_lrstab_cpu.launch import CONFIG_DIR
from verl_lrstab.scheduler import LengthSurgeLR

pytestmark = pytest.mark.e2e

# The default detector (cusum, configs/cpu_demo.yaml's CPU windows) fired at step 14 (V0) and 15 (V1)
# with these settings on one machine and at 17 (V0) on another (measured): the CPU's float kernels
# change the sampled trajectory. A detection up to step 20 leaves room for the checkpoint and a
# second decay before 26.
N_STEPS = 26
RESUME_AT = 20  # after the surge: the resumed run must restore a fired detector
LR0 = 5e-4
PERIOD_FACTOR = 0.3
SURGE = [
    f"actor_rollout_ref.actor.optim.lr={LR0}",
    f"actor_rollout_ref.actor.optim.length_surge.period_factor={PERIOD_FACTOR}",
]
TRAINER = {"v0": ["trainer.use_v1=false"], "v1": ["trainer.use_v1=true"]}
V1_SLOW = pytest.param("v1", marks=pytest.mark.slow)


def surge_run(main_ppo, trainer: str):
    """The provoked surge, N_STEPS in one run (``slow``: make test reads :func:`surge_log`)."""
    return main_ppo(f"surge-{trainer}", SURGE + TRAINER[trainer] + [f"trainer.total_training_steps={N_STEPS}"])


def surge_log(main_ppo, trainer: str) -> dict[int, dict]:
    """The provoked surge's N_STEPS as logged: the resumed pair's two segments stitched (one run fewer
    in make test; that the pair equals the uninterrupted run is test_resume_matches_uninterrupted_run)."""
    first, second = resumed_run(main_ppo, trainer)
    return {**first.metrics, **second.metrics}


def length_surge_options() -> dict:
    """The scheduler options of this run: configs/cpu_demo.yaml plus the overrides above."""
    options = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "cpu_demo.yaml"))
    options = options["actor_rollout_ref"]["actor"]["optim"]["length_surge"]
    options["period_factor"] = PERIOD_FACTOR
    return options


def series(metrics: dict, key: str) -> dict[int, float]:
    return {step: data[key] for step, data in sorted(metrics.items()) if key in data}


# -- 1. the signal the scheduler consumes is verl's response_length/mean ---------------------------
@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_scheduler_consumes_verl_response_length(main_ppo, trainer):
    if trainer == "v0":
        metrics = surge_log(main_ppo, "v0")
    else:  # the smallest V1 form for CI; the V1 surge run is in the slow set
        metrics = main_ppo("short-v1", SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]).metrics
    steps = sorted(metrics)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, steps
    consumed = series(metrics, "actor/lrstab/response_length")
    logged = series(metrics, "response_length/mean")
    assert set(consumed) == set(logged) == set(steps)
    for step in steps:
        assert consumed[step] == pytest.approx(logged[step], rel=1e-9, abs=1e-9), step
    # the score co-signal (detector: cusum) is verl's critic/score/mean of the same step
    scores, verl_scores = series(metrics, "actor/lrstab/score"), series(metrics, "critic/score/mean")
    assert set(scores) == set(verl_scores) == set(steps)
    for step in steps:
        assert scores[step] == pytest.approx(verl_scores[step], rel=1e-6, abs=1e-6), step
    # the entropy co-signal: verl's actor/entropy of the same step, which its driver computes from
    # the old-log-prob pass; the glue reads the same pass's output on the worker (float64 against verl's float32)
    entropy, verl_entropy = series(metrics, "actor/lrstab/entropy"), series(metrics, "actor/entropy")
    assert set(entropy) == set(verl_entropy) == set(steps)
    for step in steps:
        assert entropy[step] == pytest.approx(verl_entropy[step], rel=1e-5), step
    # the clip-ratio co-signal: the share of responses at the cap (data.max_response_length). verl's own
    # response_length/clip_ratio compares with the batch's padded width: the cap in V0 (the same figure
    # every step), the longest response of the batch in V1 (the same figure when that one is at the
    # cap, while ours is 0 when no response reached it and verl's is not)
    cap = OmegaConf.load(CONFIG_DIR / "cpu_demo.yaml").data.max_response_length
    clip, verl_clip = series(metrics, "actor/lrstab/clip_ratio"), series(metrics, "response_length/clip_ratio")
    longest = series(metrics, "response_length/max")
    assert set(clip) == set(steps)
    for step in steps:
        expected = verl_clip[step] if longest[step] >= cap else 0.0
        assert clip[step] == pytest.approx(expected, abs=1e-9), (step, longest[step], verl_clip[step])
    if trainer == "v1":
        assert any(longest[s] < cap and verl_clip[s] > 0 for s in steps)  # where the two figures differ


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_rollout_log_probs_are_the_trainers(main_ppo, trainer):
    """float32 generation with the synced weights gives the trainer's own log-probs every step.

    A missed weight sync (the server sampling with step t-1 weights) or log-probs taken at the
    wrong temperature would show as a gap far above float rounding.
    """
    metrics = surge_log(main_ppo, "v0") if trainer == "v0" else main_ppo(
        "short-v1", SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]
    ).metrics
    gaps = series(metrics, "rollout_corr/log_ppl_abs_diff")
    assert len(gaps) == len(metrics)
    assert max(gaps.values()) < 1e-4, gaps


# Bit-identical from run to run: the samples (lengths, scores), the trainer's figures, the LR.
REPRODUCED_KEYS = ("response_length/mean", "critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr",
                   "rollout_corr/log_ppl_abs_diff")


def assert_bit_identical(a: dict, b: dict) -> None:
    """Two runs' logs: the same steps, and on each the REPRODUCED_KEYS and every actor/lrstab/* equal."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for step in a:
        keys = list(REPRODUCED_KEYS) + [k for k in a[step] if k.startswith("actor/lrstab/")]
        for key in keys:
            assert a[step][key] == b[step][key], (step, key)


@pytest.mark.slow  # CI's form: the guard's twin (test_guard_e2e), a second run of short-v1 compared bit for bit
def test_v1_runs_are_reproducible(main_ppo):
    """Two identical V1 runs give bit-identical samples and updates on every step.

    V1 batches rollout requests as they arrive and trains on samples in the order they finish;
    the rollout's batch-invariant forward and ContentOrderedReplayBuffer (configs/cpu_demo.yaml)
    take the timing out. Without them, actor/pg_loss differed already at step 1.
    """
    overrides = SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]
    a, b = main_ppo("short-v1", overrides), main_ppo("short-v1-again", overrides)
    assert sorted(a.metrics) == [1, 2, 3, 4, 5]
    assert_bit_identical(a.metrics, b.metrics)


# -- 2. a provoked surge: the detector fires and actor/lr follows the decay rule ------------------
def expected_lr(step: int, surge: int, period: int, gamma: float = 0.5, floor: float = 0.1) -> float:
    """verl logs the LR after stepping: the LR of update ``step + 1`` (origin "surge")."""
    update = step + 1
    n = 0 if update <= surge else 1 + (update - surge - 1) // period
    return LR0 * (1.0 if n == 0 else max(floor, gamma**n))


@pytest.mark.parametrize("trainer", ["v0", V1_SLOW])
def test_provoked_surge_decays_lr(main_ppo, trainer):
    metrics = surge_log(main_ppo, trainer)
    length = series(metrics, "response_length/mean")
    steps = sorted(length)
    first, last = [length[s] for s in steps[:3]], [length[s] for s in steps[-3:]]
    assert sum(last) / 3 >= 1.5 * sum(first) / 3, f"no length surge: {length}"

    surge = series(metrics, "actor/lrstab/surge_step")
    fired = [s for s in steps if surge[s] >= 0]
    assert fired, f"the detector never fired: {length}"
    s = fired[0]
    assert all(surge[t] == -1 for t in steps if t < s) and all(surge[t] == s for t in steps if t >= s)
    period = series(metrics, "actor/lrstab/decay_period")[s]
    assert period == max(1, math.floor(PERIOD_FACTOR * s + 0.5))
    assert s + period <= steps[-1], "the test must see a second decay; raise N_STEPS"

    lr = series(metrics, "actor/lr")
    for t in steps:
        assert lr[t] == pytest.approx(expected_lr(t, s, period), rel=1e-9), (t, s, period)
        assert series(metrics, "actor/lrstab/lr_scale")[t] == pytest.approx(lr[t] / LR0, rel=1e-9)

    # The offline replay (`lrstab replay`) runs the same detector on the logged lengths.
    scores = series(metrics, "critic/score/mean")  # cusum's co-signal, as the glue fed it
    offline = replay(steps, [length[t] for t in steps], length_surge_options(), score=[scores[t] for t in steps])
    assert offline.surge_step == s


# -- 3. resume from a checkpoint continues the schedule exactly -------------------------------------
RESUMED_KEYS = ("actor/lr", "response_length/mean")


def resumed_run(main_ppo, trainer: str):
    """A run stopped with a checkpoint at RESUME_AT and resumed (``resume_mode=auto``) to N_STEPS."""
    name, base = f"resume-{trainer}", SURGE + TRAINER[trainer]
    # verl's file logger opens its file with "wb": each segment writes its own file.
    first = main_ppo(name, base + [f"trainer.total_training_steps={RESUME_AT}", f"trainer.save_freq={RESUME_AT}"],
                     metrics_name="segment1.jsonl")
    second = main_ppo(name, base + [f"trainer.total_training_steps={N_STEPS}", "trainer.resume_mode=auto"],
                      metrics_name="segment2.jsonl")
    assert sorted(first.metrics) == list(range(1, RESUME_AT + 1))
    assert sorted(second.metrics) == list(range(RESUME_AT + 1, N_STEPS + 1)), "did not resume at the checkpoint"
    return first, second


def fresh_scheduler() -> LengthSurgeLR:
    """verl-lrstab's own torch scheduler with this run's options, on a one-parameter optimizer."""
    return LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR0), length_surge_options())


def step_as_logged(scheduler: LengthSurgeLR, data: dict) -> None:
    """Step with the figures the trainer's scheduler consumed at that step (its logged metrics)."""
    metric = LengthSurgeConfig.from_dict(length_surge_options()).mismatch_metric
    kl = data.get("actor/lrstab/mismatch_kl", data.get(f"actor/mismatch/{metric}"))
    # the co-signals the glue fed (critic/score/mean, the share at the cap)
    scheduler.observe_update(UpdateFigures(score=data.get("actor/lrstab/score"),
                                           clip_ratio=data.get("actor/lrstab/clip_ratio")))
    scheduler.step(data["actor/lrstab/response_length"], kl)
    # what verl's update logged: the glue hands it after the update, observed under the step just taken
    cosignals = {name: data[f"actor/lrstab/{name}"] for name in UPDATE_FIGURES if f"actor/lrstab/{name}" in data}
    scheduler.observe_update(UpdateFigures(cosignals=cosignals))


def same(a, b) -> bool:
    """Exact equality of nested plain values, NaN equal to NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("trainer", ["v0", V1_SLOW])
def test_resume_restores_the_checkpointed_schedule(main_ppo, trainer):
    """Holds whether or not two runs are bit-identical: the checkpoint's scheduler state is the
    state of its step (as the logged figures give it), and the resumed run's LR follows from it."""
    first, second = resumed_run(main_ppo, trainer)
    ckpt = sorted(Path(first.metrics_path.parent, "checkpoints", f"global_step_{RESUME_AT}").rglob(
        "extra_state_world_size_*_rank_0.pt"))
    assert len(ckpt) == 1, ckpt
    saved = torch.load(ckpt[0], weights_only=False)["lr_scheduler"]  # the file also holds verl's numpy RNG state

    # the state of step RESUME_AT, rebuilt from the first segment's log: detector history, trigger,
    # period, LR
    logged = fresh_scheduler()
    for step in range(1, RESUME_AT + 1):
        step_as_logged(logged, first.metrics[step])
    assert same(saved, logged.state_dict()), (saved, logged.state_dict())
    assert saved["last_epoch"] == RESUME_AT and saved["_last_lr"] == [first.metrics[RESUME_AT]["actor/lr"]]
    trigger = saved["schedule"]["trigger_step"]
    assert trigger is not None and trigger <= RESUME_AT, "the checkpoint must hold a fired detector"
    assert first.metrics[RESUME_AT]["actor/lrstab/trigger_step"] == trigger
    assert first.metrics[RESUME_AT]["actor/lrstab/decay_period"] == logged.decay_period == max(
        1, math.floor(PERIOD_FACTOR * trigger + 0.5))

    # the resumed run continues from the checkpoint's state, not from a fresh schedule
    restored = fresh_scheduler()
    restored.load_state_dict(saved)
    for step in range(RESUME_AT + 1, N_STEPS + 1):
        step_as_logged(restored, second.metrics[step])
        assert second.metrics[step]["actor/lr"] == pytest.approx(restored.get_last_lr()[0], rel=1e-12), step
        for key, value in restored.metrics().items():
            assert second.metrics[step][f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)
    assert restored.surge_step == trigger and restored.get_last_lr()[0] < LR0 / 2, "a second decay after resuming"


DISMISSED_STEPS = 4  # the resumed segment with the decay dismissed: RESUME_AT + 1 .. RESUME_AT + 4


def test_a_dismissed_false_alarm_resumes_at_the_initial_lr_and_rearms_the_detector(main_ppo):
    """The documented way back from a false alarm: resume from the checkpoint after it with
    ``length_surge.dismiss_trigger_step`` naming the update the decay started at (V0's resumed pair's
    checkpoint, one more segment of 4 steps)."""
    first, second = resumed_run(main_ppo, "v0")
    trigger = int(first.metrics[RESUME_AT]["actor/lrstab/trigger_step"])
    assert 0 < trigger <= RESUME_AT and second.metrics[RESUME_AT + 1]["actor/lr"] < LR0, "the checkpoint holds a decay"
    run_dir = first.metrics_path.parent
    dismissed_dir = run_dir.parent / "dismiss-v0"
    shutil.copytree(run_dir / "checkpoints", dismissed_dir / "checkpoints")  # the checkpoint at RESUME_AT only
    end = RESUME_AT + DISMISSED_STEPS
    dismissed = main_ppo("dismiss-v0", SURGE + TRAINER["v0"] + [
        f"trainer.total_training_steps={end}", "trainer.resume_mode=auto",
        f"+actor_rollout_ref.actor.optim.length_surge.dismiss_trigger_step={trigger}"])
    assert sorted(dismissed.metrics) == list(range(RESUME_AT + 1, end + 1)), "did not resume at the checkpoint"
    log = dismissed.log_path.read_text(errors="replace")
    assert f"the decay that started at update {trigger} is dismissed" in log
    # the initial LR from the first resumed update on, no surge on record: a fresh detector
    resumed = dismissed.metrics[RESUME_AT + 1]
    assert resumed["actor/lr"] == pytest.approx(LR0, rel=1e-12)
    assert resumed["actor/lrstab/trigger_step"] == -1 and resumed["actor/lrstab/surge_step"] == -1
    assert resumed["actor/lrstab/lr_scale"] == 1.0
    # re-armed, not switched off: every step is what a fresh detector started at RESUME_AT makes of the
    # logged figures (the schedulers' own load: a checkpoint without length_surge state restarts it)
    rearmed = fresh_scheduler()
    rearmed.load_state_dict({"base_lrs": [LR0], "last_epoch": RESUME_AT, "_step_count": RESUME_AT + 1})
    for step in range(RESUME_AT + 1, end + 1):
        step_as_logged(rearmed, dismissed.metrics[step])
        assert dismissed.metrics[step]["actor/lr"] == pytest.approx(rearmed.get_last_lr()[0], rel=1e-12), step
        for key, value in rearmed.metrics().items():
            assert dismissed.metrics[step][f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)


@pytest.mark.slow  # one more run; make test keeps the resumed pair's own checks (above)
@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_resume_matches_uninterrupted_run(main_ppo, trainer):
    """Where runs are bit-reproducible (V0; V1 with ContentOrderedReplayBuffer and the batch-invariant
    rollout) the resumed run also gives the uninterrupted run's samples and LRs."""
    full = surge_run(main_ppo, trainer)
    stitched = surge_log(main_ppo, trainer)
    for step in range(1, N_STEPS + 1):
        want, got = full.metrics[step], stitched[step]
        keys = [k for k in want if k.startswith("actor/lrstab/")] + list(RESUMED_KEYS)
        assert {k for k in got if k.startswith("actor/lrstab/")} == {k for k in want if k.startswith("actor/lrstab/")}
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (step, key)


# -- 5. without length_surge the installed package changes nothing ---------------------------------
def test_other_schedulers_match_stock_verl(main_ppo, tmp_path_factory, sitecustomize):
    """cosine + warmup, with the verl-lrstab plugin loaded vs disabled (VERL_USE_EXTERNAL_PLUGINS=none)."""
    overrides = TRAINER["v0"] + [
        "trainer.total_training_steps=4",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        "~actor_rollout_ref.actor.optim.length_surge",
    ]
    # every process that installs the glue leaves a record (the sitecustomize fixture, test code only)
    probes = {name: Path(tmp_path_factory.mktemp(f"probes-{name}")) for name in ("plugin", "stock")}
    with_plugin = main_ppo("cosine-plugin", overrides, env=sitecustomize(probes=probes["plugin"]))
    stock = main_ppo("cosine-stock", overrides, env={**sitecustomize(probes=probes["stock"]),
                                                     "VERL_USE_EXTERNAL_PLUGINS": "none"})
    records = [json.loads(p.read_text()) for p in probes["plugin"].iterdir()]
    assert any(not r["ray"] for r in records), "the driver installs the glue"
    assert sum(r["ray"] for r in records) >= 2, f"the TaskRunner and the workers install the glue: {records}"
    assert not list(probes["stock"].iterdir()), [p.read_text() for p in probes["stock"].iterdir()]
    assert sorted(with_plugin.metrics) == sorted(stock.metrics) == [1, 2, 3, 4]
    lrs = [stock.metrics[s]["actor/lr"] for s in range(1, 5)]
    assert len(set(lrs)) > 2, f"the LR should move under cosine + warmup: {lrs}"
    for step in range(1, 5):
        a, b = with_plugin.metrics[step], stock.metrics[step]
        assert not [k for k in (*a, *b) if k.startswith("actor/lrstab/")]
        assert set(a) == set(b), set(a) ^ set(b)
        for key in ("actor/lr", "actor/grad_norm", "response_length/mean", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (step, key)


# -- 6. V1 colocate_async: the step tag through TransferQueue, the mismatch split by version lag ---------
COLOCATE = TRAINER["v1"] + ["trainer.v1.trainer_mode=colocate_async",
                            "~trainer.v1.sampler.custom_sampler"]  # ContentOrderedReplayBuffer is sync-only


def test_colocate_async_feeds_the_length_and_only_the_fresh_samples_mismatch(main_ppo):
    """One actor update per trainer step; some batches were sampled one policy version back.

    The run itself shows the step tag's transport (a missing tag fails the update). The samples'
    versions reach the worker (V1: in ``extra_fields``); ``mismatch/*`` are the fresh samples' (float32
    both sides: ~1e-13) and the only KL fed, the stale ones are logged apart and measure staleness
    (more than 1000 x the fresh k3), and ``mismatch/fresh_share`` agrees with verl's own staleness figures.
    """
    run = main_ppo("colocate-v1", SURGE + COLOCATE + ["trainer.total_training_steps=4"])
    assert sorted(run.metrics) == [1, 2, 3, 4]
    staleness = series(run.metrics, "training/off_policy/trajectory_staleness/max")
    fresh_staleness = series(run.metrics, "training/off_policy/trajectory_staleness/min")
    spans = series(run.metrics, "training/off_policy/trajectory_spans/max")
    share = series(run.metrics, "actor/mismatch/fresh_share")
    assert set(share) == set(run.metrics)
    assert any(v > 0 for v in staleness.values()), f"no stale batch in this run: {staleness}"
    fresh_k3, stale_k3 = [], []
    for step, data in run.metrics.items():
        assert data["actor/lrstab/response_length"] == pytest.approx(data["response_length/mean"], rel=1e-9)
        if staleness[step] == 0 and spans[step] == 1:
            assert share[step] == 1.0, step
        if fresh_staleness[step] > 0:
            assert share[step] == 0.0, step
        if share[step] > 0:
            fresh_k3.append(data["actor/mismatch/k3"])
            assert data["actor/mismatch/k3"] < 1e-8, (step, data["actor/mismatch/k3"])  # fresh: float32 both sides
            assert data["actor/lrstab/mismatch_kl"] == pytest.approx(data["actor/mismatch/k3"], rel=1e-12)
        else:
            assert "actor/mismatch/k3" not in data and "actor/lrstab/mismatch_kl" not in data, step
        stale_k3 += [v for k, v in data.items() if k.startswith("actor/mismatch/stale/") and k.endswith("/k3")]
    assert fresh_k3 and stale_k3, (share, staleness)
    assert min(stale_k3) > 1e3 * max(max(fresh_k3), 1e-12), (fresh_k3, stale_k3)
