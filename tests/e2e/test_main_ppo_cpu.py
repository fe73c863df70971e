"""End-to-end: verl 0.9.1's real ``main_ppo`` (GRPO, FSDP2 on gloo, Ray, agent loop, reward loop)
on CPU with ``lr_scheduler_type=length_surge``, read back from verl's own file-logger JSONL.

The CPU stand-ins are the ``cpu`` platform and the ``transformers`` rollout (verl_lrstab.cpu);
everything else is verl's code. The reward ``longer_is_better`` provokes a real length surge.
Runs are shared between tests (``main_ppo`` fixture); the V1 surge/resume forms are ``slow``.
"""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from verl_lrstab.cpu.launch import CONFIG_DIR
from verl_lrstab.schedule import replay

pytestmark = pytest.mark.e2e

N_STEPS = 16  # the surge comes at ~step 11 with these settings; two decays fit before 16
RESUME_AT = 12  # after the surge: the resumed run must restore a fired detector
LR0 = 5e-4
PERIOD_FACTOR = 0.3
SURGE = [
    f"actor_rollout_ref.actor.optim.lr={LR0}",
    f"actor_rollout_ref.actor.optim.length_surge.period_factor={PERIOD_FACTOR}",
]
TRAINER = {"v0": ["trainer.use_v1=false"], "v1": ["trainer.use_v1=true"]}
V1_SLOW = pytest.param("v1", marks=pytest.mark.slow)


def surge_run(main_ppo, trainer: str):
    return main_ppo(f"surge-{trainer}", SURGE + TRAINER[trainer] + [f"trainer.total_training_steps={N_STEPS}"])


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
        run = surge_run(main_ppo, "v0")
    else:  # the smallest V1 form for CI; the V1 surge run is in the slow set
        run = main_ppo("short-v1", SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"])
    steps = sorted(run.metrics)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, steps
    consumed = series(run.metrics, "actor/lrstab/response_length")
    logged = series(run.metrics, "response_length/mean")
    assert set(consumed) == set(logged) == set(steps)
    for step in steps:
        assert consumed[step] == pytest.approx(logged[step], rel=1e-9, abs=1e-9), step


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_rollout_log_probs_are_the_trainers(main_ppo, trainer):
    """float32 generation with the synced weights gives the trainer's own log-probs every step.

    A missed weight sync (the server sampling with step t-1 weights) or log-probs taken at the
    wrong temperature would show as a gap far above float rounding.
    """
    run = surge_run(main_ppo, "v0") if trainer == "v0" else main_ppo(
        "short-v1", SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]
    )
    gaps = series(run.metrics, "rollout_corr/log_ppl_abs_diff")
    assert len(gaps) == len(run.metrics)
    assert max(gaps.values()) < 1e-4, gaps


# -- 2. a provoked surge: the detector fires and actor/lr follows the decay rule ------------------
def expected_lr(step: int, surge: int, period: int, gamma: float = 0.5, floor: float = 0.1) -> float:
    """verl logs the LR after stepping: the LR of update ``step + 1`` (origin "surge")."""
    update = step + 1
    n = 0 if update <= surge else 1 + (update - surge - 1) // period
    return LR0 * (1.0 if n == 0 else max(floor, gamma**n))


@pytest.mark.parametrize("trainer", ["v0", V1_SLOW])
def test_provoked_surge_decays_lr(main_ppo, trainer):
    run = surge_run(main_ppo, trainer)
    length = series(run.metrics, "response_length/mean")
    steps = sorted(length)
    first, last = [length[s] for s in steps[:3]], [length[s] for s in steps[-3:]]
    assert sum(last) / 3 >= 1.5 * sum(first) / 3, f"no length surge: {length}"

    surge = series(run.metrics, "actor/lrstab/surge_step")
    fired = [s for s in steps if surge[s] >= 0]
    assert fired, f"the detector never fired: {length}"
    s = fired[0]
    assert all(surge[t] == -1 for t in steps if t < s) and all(surge[t] == s for t in steps if t >= s)
    period = series(run.metrics, "actor/lrstab/decay_period")[s]
    assert period == max(1, math.floor(PERIOD_FACTOR * s + 0.5))
    assert s + period <= steps[-1], "the test must see a second decay; raise N_STEPS"

    lr = series(run.metrics, "actor/lr")
    for t in steps:
        assert lr[t] == pytest.approx(expected_lr(t, s, period), rel=1e-9), (t, s, period)
        assert series(run.metrics, "actor/lrstab/lr_scale")[t] == pytest.approx(lr[t] / LR0, rel=1e-9)

    # The offline replay (`lrstab replay`) runs the same detector on the logged lengths.
    offline = replay(steps, [length[t] for t in steps], length_surge_options())
    assert offline.surge_step == s


# -- 3. resume from a checkpoint reproduces the uninterrupted run ----------------------------------
RESUMED_KEYS = ("actor/lr", "response_length/mean")


@pytest.mark.parametrize("trainer", ["v0", V1_SLOW])
def test_resume_matches_uninterrupted_run(main_ppo, trainer):
    full = surge_run(main_ppo, trainer)
    name, base = f"resume-{trainer}", SURGE + TRAINER[trainer]
    # verl's file logger opens its file with "wb": each segment writes its own file.
    first = main_ppo(name, base + [f"trainer.total_training_steps={RESUME_AT}", f"trainer.save_freq={RESUME_AT}"],
                     metrics_name="segment1.jsonl")
    second = main_ppo(name, base + [f"trainer.total_training_steps={N_STEPS}", "trainer.resume_mode=auto"],
                      metrics_name="segment2.jsonl")
    assert sorted(first.metrics) == list(range(1, RESUME_AT + 1))
    assert sorted(second.metrics) == list(range(RESUME_AT + 1, N_STEPS + 1)), "did not resume at the checkpoint"

    stitched = {**first.metrics, **second.metrics}
    for step in range(1, N_STEPS + 1):
        want, got = full.metrics[step], stitched[step]
        keys = [k for k in want if k.startswith("actor/lrstab/")] + list(RESUMED_KEYS)
        assert {k for k in got if k.startswith("actor/lrstab/")} == {k for k in want if k.startswith("actor/lrstab/")}
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (step, key)


# -- 5. without length_surge the installed package changes nothing ---------------------------------
def test_other_schedulers_match_stock_verl(main_ppo):
    """cosine + warmup, with the verl-lrstab plugin loaded vs disabled (VERL_USE_EXTERNAL_PLUGINS=none)."""
    overrides = TRAINER["v0"] + [
        "trainer.total_training_steps=4",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        "~actor_rollout_ref.actor.optim.length_surge",
    ]
    with_plugin = main_ppo("cosine-plugin", overrides)
    stock = main_ppo("cosine-stock", overrides, env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert sorted(with_plugin.metrics) == sorted(stock.metrics) == [1, 2, 3, 4]
    lrs = [stock.metrics[s]["actor/lr"] for s in range(1, 5)]
    assert len(set(lrs)) > 2, f"the LR should move under cosine + warmup: {lrs}"
    for step in range(1, 5):
        a, b = with_plugin.metrics[step], stock.metrics[step]
        assert not [k for k in (*a, *b) if k.startswith("actor/lrstab/")]
        assert set(a) == set(b), set(a) ^ set(b)
        for key in ("actor/lr", "actor/grad_norm", "response_length/mean", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (step, key)
