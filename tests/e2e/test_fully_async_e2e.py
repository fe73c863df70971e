"""End-to-end: verl 0.9.1's real fully-async trainer (``verl.experimental.fully_async_policy.fully_async_main``: a
``FullyAsyncTrainer`` and a ``FullyAsyncRollouter``, Ray actors, fed through verl's message queue) on CPU with
``lr_scheduler_type=length_surge``: cpu_demo.yaml plus ``verl_lrstab_cpu.launch.FULLY_ASYNC`` (the weight sync
through the CPU backend's ``gloo`` checkpoint engine; 4 prompts x 4 samples a trainer step, one update a sync cycle).

verl logs a sync cycle's aggregated metrics at the next cycle's end, under the version it then holds (the
rows' ``training/global_step`` is the update they hold), does not log the last cycle's with ``test_freq`` <= 0,
and otherwise logs it under the label of the row before; after a resume it counts ``training/global_step`` from
the checkpoint's version + 2. The runs' metrics are read by the product's reader
(:func:`verl_lrstab.runs.read_metrics`), which reads each update once, under its number
(tests/test_runs_async.py checks it on logs of these runs).
"""

from __future__ import annotations

import pytest

from test_main_ppo_cpu import LR0, SURGE, fresh_scheduler, step_as_logged
from verl_lrstab_cpu.launch import FULLY_ASYNC, FULLY_ASYNC_MODULE

pytestmark = pytest.mark.e2e

PROMPTS = 24  # +rollout.total_rollout_steps: 6 trainer steps of 4 prompts


def update_rows(run) -> dict:
    """``{update: its logged metrics}``: the steps the product's reader gives that hold an actor update (the
    rollouter's own rows, under the version they follow, are merged in)."""
    rows = {step: data for step, data in run.metrics.items() if "actor/lr" in data}
    assert rows, "no actor update was logged"
    return rows


def fully_async(main_ppo, name: str, staleness: float, prompts: int = PROMPTS, extra=()):
    run = main_ppo(name, FULLY_ASYNC + SURGE + [f"++async_training.staleness_threshold={staleness}",
                                                f"+rollout.total_rollout_steps={prompts}", "trainer.test_freq=-1",
                                                *extra], module=FULLY_ASYNC_MODULE)
    return update_rows(run)


@pytest.mark.parametrize("staleness", [0, 1])
def test_fully_async_feeds_the_length_and_only_the_fresh_samples_mismatch(main_ppo, staleness):
    rows = fully_async(main_ppo, f"fully-async-s{staleness}", staleness)
    assert sorted(rows) == list(range(1, len(rows) + 1)) and len(rows) >= 3, sorted(rows)
    assert all(data["training/global_step"] == step for step, data in rows.items())
    replayed = fresh_scheduler()
    fresh_k3, stale_k3 = [], []
    for step in sorted(rows):
        data = rows[step]
        assert data["actor/lrstab/response_length"] == pytest.approx(data["response_length/mean"], rel=1e-9), step
        step_as_logged(replayed, data)  # every logged lrstab/* figure is what the package makes of the feed
        assert data["actor/lr"] == pytest.approx(replayed.get_last_lr()[0], rel=1e-12), step
        share = data["actor/mismatch/fresh_share"]
        if share > 0:
            fresh_k3.append(data["actor/mismatch/k3"])
            assert data["actor/lrstab/mismatch_kl"] == data["actor/mismatch/k3"], step
        else:
            assert "actor/mismatch/k3" not in data and "actor/lrstab/mismatch_kl" not in data, step
        stale_k3 += [v for k, v in data.items() if k.startswith("actor/mismatch/stale/") and k.endswith("/k3")]
    assert rows[1]["actor/mismatch/fresh_share"] == 1.0  # the first update trains on the weights synced at start
    assert fresh_k3 and max(fresh_k3) < 1e-8, fresh_k3  # float32 both sides: the engine agrees to rounding
    if staleness == 1:
        assert stale_k3 and min(stale_k3) > 1e3 * max(max(fresh_k3), 1e-12), (fresh_k3, stale_k3)
    assert replayed.get_last_lr()[0] == LR0  # a few steps: no surge yet


N_STEPS, RESUME_AT, BATCH = 26, 20, 8  # the resumed pair: 8 prompts a step (as cpu_demo's other runs)


@pytest.mark.slow  # two segments of a 26-step run
def test_fully_async_surge_decays_the_lr_as_a_replay_and_resumes_the_schedule_exactly(main_ppo):
    from pathlib import Path

    import torch

    from test_main_ppo_cpu import same

    # test_freq above the run's length: verl then logs the last cycle too (and never validates)
    base = FULLY_ASYNC + SURGE + ["++async_training.staleness_threshold=1", "trainer.test_freq=1000",
                                  f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}"]
    first = main_ppo("fully-async-resume", base + [f"+rollout.total_rollout_steps={BATCH * RESUME_AT}",
                                                   f"trainer.save_freq={RESUME_AT}"],
                     metrics_name="segment1.jsonl", module=FULLY_ASYNC_MODULE)
    second = main_ppo("fully-async-resume", base + [f"+rollout.total_rollout_steps={BATCH * N_STEPS}",
                                                    "trainer.resume_mode=auto"],
                      metrics_name="segment2.jsonl", module=FULLY_ASYNC_MODULE)
    rows1, rows2 = update_rows(first), update_rows(second)
    assert sorted(rows1) == list(range(1, RESUME_AT + 1)), sorted(rows1)
    # verl's resume sets global_steps to the checkpoint's version + 1, then its fit adds 1: the resumed updates'
    # training/global_step runs from RESUME_AT + 2; they are read as the scheduler counts them, RESUME_AT + 1 on
    assert sorted(rows2) == list(range(RESUME_AT + 1, N_STEPS + 1)), sorted(rows2)
    assert [rows2[u]["training/global_step"] for u in sorted(rows2)] == list(range(RESUME_AT + 2, N_STEPS + 2))
    replayed = fresh_scheduler()
    for step in range(1, RESUME_AT + 1):
        step_as_logged(replayed, rows1[step])
        assert rows1[step]["actor/lr"] == pytest.approx(replayed.get_last_lr()[0], rel=1e-12), step
    ckpt = sorted(Path(first.metrics_path.parent, "checkpoints", f"global_step_{RESUME_AT}").rglob(
        "extra_state_world_size_*_rank_0.pt"))
    assert len(ckpt) == 1, ckpt
    saved = torch.load(ckpt[0], weights_only=False)["lr_scheduler"]
    assert same(saved, replayed.state_dict()), (saved, replayed.state_dict())
    for step in sorted(rows2):
        data = rows2[step]
        step_as_logged(replayed, data)
        assert data["actor/lr"] == pytest.approx(replayed.get_last_lr()[0], rel=1e-12), step
        for key, value in replayed.metrics().items():
            assert data[f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (step, key)
    # the first resumed update trains on the weights synced at the start
    assert rows2[RESUME_AT + 1]["actor/mismatch/fresh_share"] == 1.0
    assert replayed.surge_step is not None and replayed.get_last_lr()[0] < LR0, "no surge, no decay"


@pytest.mark.slow  # one more run (about 5 min on 2 cores)
def test_two_updates_a_sync_cycle_are_fed_and_read_once_a_cycle(main_ppo):
    """``trigger_parameter_sync_step=2``: the scheduler is fed once a cycle, on its last update, where its figures
    are logged; verl's row at a cycle's end holds the cycle before's last update and this cycle's first (its
    ``actor/lr``, ``response_length/mean`` are their mean), the last cycle's row the last update alone."""
    rows = main_ppo("fully-async-k2", FULLY_ASYNC + SURGE + [
        "++async_training.trigger_parameter_sync_step=2", "++async_training.staleness_threshold=1",
        f"+rollout.total_rollout_steps={PROMPTS}", "trainer.test_freq=1000"], module=FULLY_ASYNC_MODULE).metrics
    cycles = {step: data for step, data in rows.items() if "actor/lrstab/response_length" in data}
    assert sorted(cycles) == [1, 2, 3], sorted(rows)  # 6 trainer steps of 4 prompts, 2 a cycle
    assert [cycles[c]["training/global_step"] for c in (1, 2, 3)] == [3, 5, 6]
    replayed = fresh_scheduler()
    for cycle in (1, 2, 3):
        step_as_logged(replayed, cycles[cycle])
        assert cycles[cycle]["actor/lrstab/lr_scale"] == pytest.approx(replayed.get_last_lr()[0] / LR0, rel=1e-12)
        for key, value in replayed.metrics().items():
            assert cycles[cycle][f"actor/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-15), (cycle, key)
    assert cycles[1]["actor/mismatch/fresh_share"] == 1.0  # the first cycle trains on the weights synced at start


@pytest.mark.slow  # two more runs
def test_a_stock_fully_async_run_is_the_same_with_the_plugin_and_without(main_ppo):
    """constant LR, staleness 0 (the rollouter samples each version's batch on that version: no timing in the
    data), the verl-lrstab plugin loaded vs disabled (VERL_USE_EXTERNAL_PLUGINS=none): the same rows and numbers."""
    overrides = FULLY_ASYNC + ["++async_training.staleness_threshold=0", "+rollout.total_rollout_steps=16",
                               "trainer.test_freq=-1", "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
                               "~actor_rollout_ref.actor.optim.length_surge"]
    with_plugin = update_rows(main_ppo("fully-async-stock-plugin", overrides, module=FULLY_ASYNC_MODULE))
    stock = update_rows(main_ppo("fully-async-stock-none", overrides, module=FULLY_ASYNC_MODULE,
                                 env={"VERL_USE_EXTERNAL_PLUGINS": "none"}))
    assert sorted(with_plugin) == sorted(stock) and len(stock) >= 2, (sorted(with_plugin), sorted(stock))
    for step in stock:
        a, b = with_plugin[step], stock[step]
        assert not [k for k in (*a, *b) if k.startswith(("actor/lrstab/", "actor/mismatch/"))]
        assert set(a) == set(b), set(a) ^ set(b)
        for key in ("actor/lr", "response_length/mean", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), (step, key)
        # the same samples, but they reach the trainer in the order the rollouter finishes them, so the float32
        # gradient is summed in another order from run to run: 1.6e-7 relative measured (update 3, one run of
        # two); a changed LR or a changed loss moves it by far more
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5), step
