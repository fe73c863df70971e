"""``lrstab guard``'s decisions: verl's real config tree, the trouble and its onset, the rule.

The supervisor itself runs verl's real ``main_ppo`` in ``tests/e2e/test_guard_e2e.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_lrstab.config import LengthSurgeConfig
from verl_lrstab.detectors import LengthSurgeSchedule
from verl_lrstab.guard.plan import (GuardError, GuardOptions, Trouble, checkpoint_steps, choose_checkpoint,
                                    decay_period_for, find_trouble, plan_run, rollback_overrides)
from verl_lrstab.guard.supervisor import compose_config, split_command
from verl_lrstab.scheduler import LengthSurgeLR

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "research"))
import phenomena  # noqa: E402

MAIN = ["python", "-m", "verl.trainer.main_ppo"]


def verl_config(*overrides):
    return compose_config(MAIN, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *overrides], Path.cwd())


# -- the command and the checkpoint plan -----------------------------------------------------------
@pytest.mark.parametrize("command", [["python", "train.py"], ["torchrun", "-m", "verl.trainer.fsdp_sft_trainer"], []])
def test_a_command_that_is_not_verls_main_ppo_is_refused(command):
    with pytest.raises(GuardError, match=r"python -m verl\.trainer\.main_ppo"):
        split_command(command)


def test_the_command_splits_into_launcher_and_overrides():
    launcher, overrides = split_command(MAIN + ["--config-path", "/c", "--config-name", "x", "a=1", "b=2"])
    assert launcher == MAIN + ["--config-path", "/c", "--config-name", "x"] and overrides == ["a=1", "b=2"]


def test_verls_config_is_composed_from_its_folder_as_from_its_module_without_importing_verl(tmp_path):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    overrides = ["trainer.save_freq=4", "actor_rollout_ref.actor.optim.lr=3e-5", "algorithm.adv_estimator=grpo"]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        expected = OmegaConf.to_yaml(compose(config_name="ppo_trainer", overrides=overrides))
    assert OmegaConf.to_yaml(compose_config(MAIN, overrides, tmp_path)) == expected
    # the guard's and admit's start: composing verl's config does not import verl (nor torch: ~5 s)
    code = ("import sys; from verl_lrstab.guard.supervisor import compose_config; "
            "compose_config(['python', '-m', 'verl.trainer.main_ppo'], ['trainer.save_freq=4'], None); "
            "print(sorted(m for m in ('verl', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("overrides,message", [
    (["trainer.save_freq=-1"], r"trainer\.save_freq=-1: verl saves no checkpoint"),
    (["trainer.save_freq=50", "trainer.total_training_steps=50"], r"trainer\.save_freq=50 with trainer\.total_training_steps=50"),
    (["trainer.save_freq=5", "actor_rollout_ref.actor.checkpoint.save_contents=[model]"],
     r"save_contents=\['model'\] lacks \['optimizer', 'extra'\]"),
])
def test_a_run_that_could_never_roll_back_is_refused_naming_the_key(overrides, message):
    with pytest.raises(GuardError, match=message):
        plan_run(verl_config(*overrides), Path("/run"))


def test_sparse_or_few_checkpoints_give_a_warning_with_the_numbers(tmp_path):
    plan = plan_run(verl_config("trainer.save_freq=10", "trainer.max_actor_ckpt_to_keep=2",
                                "trainer.default_local_dir=ckpts"), tmp_path)
    assert plan.save_freq == 10 and plan.keep == 2 and plan.checkpoint_dir == tmp_path / "ckpts"
    assert any("max_actor_ckpt_to_keep=2" in w and "last 20 steps" in w for w in plan.warnings)
    assert plan_run(verl_config("trainer.save_freq=10"), tmp_path).warnings == []


def test_the_checkpoint_is_the_newest_at_or_before_the_onset_minus_the_margin(tmp_path):
    for step in (5, 10, 15, 20):  # verl's layout, finished: one rank's shards, fsdp_config.json, data.pt, the tracker
        actor = tmp_path / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True)
        for prefix in ("model", "optim", "extra_state"):
            (actor / f"{prefix}_world_size_1_rank_0.pt").write_bytes(b"x")
        (actor / "fsdp_config.json").write_text('{"FSDP_version": 1, "world_size": 1}')
        (actor.parent / "data.pt").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    (tmp_path / "global_step_25").mkdir()  # a save cut off before its actor folder: not a checkpoint
    steps = checkpoint_steps(tmp_path)
    assert steps == [5, 10, 15, 20]
    assert choose_checkpoint(steps, onset=17, margin=2) == 15
    assert choose_checkpoint(steps, onset=16, margin=2) == 10
    assert choose_checkpoint(steps, onset=6, margin=2) is None


# -- the trouble -------------------------------------------------------------------------------------
def records_of(**columns):
    n = len(next(iter(columns.values())))
    return {s: {k: v[s - 1] for k, v in columns.items() if v[s - 1] is not None} for s in range(1, n + 1)}


def test_a_logged_non_finite_grad_norm_is_trouble_a_missing_one_is_not():
    gn = [1.0] * 6 + [None, float("nan")] + [1.0] * 4  # step 7 does not log it; step 8 logs NaN
    t = find_trouble(records_of(**{"actor/grad_norm": gn, "response_length/mean": [100.0] * 12}),
                     GuardOptions(non_finite_steps=1), LengthSurgeConfig())
    assert t == Trouble("non_finite", 8, 8)
    # by default a NaN must repeat on 2 consecutive steps (verl skips one bad update itself)
    assert find_trouble(records_of(**{"actor/grad_norm": gn}), GuardOptions(), LengthSurgeConfig()) is None
    gn2 = [1.0] * 6 + [float("nan"), None, float("nan"), float("inf")] + [1.0] * 2
    assert find_trouble(records_of(**{"actor/grad_norm": gn2}), GuardOptions(), LengthSurgeConfig()) == \
        Trouble("non_finite", 10, 9)
    assert find_trouble(records_of(**{"actor/grad_norm": gn}), GuardOptions(on_non_finite=False),
                        LengthSurgeConfig()) is None
    assert find_trouble(records_of(**{"actor/grad_norm": gn}), GuardOptions(non_finite_steps=1), LengthSurgeConfig(),
                        after=8) is None


def test_a_reward_crash_has_its_onset_at_the_peak():
    score = [0.2 + 0.05 * s for s in range(10)] + [0.65, 0.66, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1]
    t = find_trouble(records_of(**{"critic/score/mean": score}), GuardOptions(), LengthSurgeConfig())
    assert t.reason == "reward_crash" and t.onset <= 12 and t.step > t.onset
    # the 5-point rolling median falls below 0.6 x its peak there, not before
    assert find_trouble(records_of(**{"critic/score/mean": score[:13]}), GuardOptions(), LengthSurgeConfig()) is None


def test_a_reward_crash_of_a_zero_centred_score_is_judged_above_its_floor():
    # a +-1 reward: accuracy 0.44 -> 0.05 is the score -0.12 -> -0.9; verl's critic/score/min is -1
    score = [-0.12] * 10 + [-0.9] * 6
    t = find_trouble(records_of(**{"critic/score/mean": score, "critic/score/min": [-1.0] * 16}), GuardOptions(),
                     LengthSurgeConfig())
    assert t is not None and t.reason == "reward_crash" and 11 <= t.step <= 14
    # a fall to 0.7 of the accuracy (0.44 -> 0.31: score -0.38) is above 0.6 of the height over the floor
    mild = [-0.12] * 10 + [-0.38] * 6
    assert find_trouble(records_of(**{"critic/score/mean": mild, "critic/score/min": [-1.0] * 16}), GuardOptions(),
                        LengthSurgeConfig()) is None


def test_the_compounded_rule_starts_one_decay_below_the_one_in_force():
    from verl_lrstab.guard.plan import compounded_rule, halvings_in_force

    assert compounded_rule(20, 18, 0) == (20, 18)
    start, period = compounded_rule(20, 18, 1)  # 1 decay in force at 20: the next update runs at gamma ** 2
    assert expected_scale(21, start, period) == 0.25 and period == 18 and start == 2
    start, period = compounded_rule(8, 18, 2)  # too early a checkpoint for the origin: the period shortens
    assert expected_scale(9, start, period) == 0.125 and start >= 0
    assert halvings_in_force(20, {}, (8, 18)) == 1
    assert halvings_in_force(20, {20: {"actor/lrstab/lr_scale": 0.25}}, (8, 18)) == 2  # the run's own decay


@pytest.mark.parametrize("seed", range(3))
def test_a_surge_has_its_onset_where_the_length_left_its_baseline(seed):
    (tr,) = phenomena.traces(seeds=[seed], classes="A")
    recs = records_of(**{"response_length/mean": tr.length.tolist(), "critic/score/mean": tr.score.tolist(),
                         "actor/lrstab/mismatch_kl": tr.k3.tolist()})
    t = find_trouble(recs, GuardOptions(on_reward_crash=False), LengthSurgeConfig())
    assert t.reason == "surge" and t.surge_step == t.step < tr.crash
    assert tr.onset - 3 <= t.onset <= t.step and t.onset <= tr.onset + 3, (t, tr.onset)


def test_in_a_multi_turn_log_the_guard_reads_the_models_own_tokens_as_the_trainer_does():
    (tr,) = phenomena.traces(seeds=[0], classes="A")
    surge = tr.length.tolist()
    flat = [surge[0]] * len(surge)
    tool = [40.0] * len(surge)  # every response also holds 40 tokens of tool output
    # the model's tokens surge under a constant tool share: a surge whatever the length read
    recs = records_of(**{"response_length/mean": [m + t for m, t in zip(surge, tool)],
                         "actor/lrstab/model_tokens": surge, "critic/score/mean": tr.score.tolist()})
    assert find_trouble(recs, GuardOptions(on_reward_crash=False), LengthSurgeConfig()).reason == "surge"
    # the tool's answers grow with the same shape while the model's tokens stay flat: no surge ...
    recs = records_of(**{"response_length/mean": [f + s for f, s in zip(flat, surge)],
                         "actor/lrstab/model_tokens": flat, "critic/score/mean": tr.score.tolist()})
    assert find_trouble(recs, GuardOptions(on_reward_crash=False), LengthSurgeConfig()) is None
    # ... where verl's full length, read as it was before, would be one
    verl_only = LengthSurgeConfig.from_dict({"length_tokens": "all"})
    assert find_trouble(recs, GuardOptions(on_reward_crash=False), verl_only).reason == "surge"


def test_healthy_runs_are_no_trouble():
    for tr in phenomena.traces(seeds=range(2), classes="CEH"):
        recs = records_of(**{"response_length/mean": tr.length.tolist(), "critic/score/mean": tr.score.tolist(),
                             "actor/lrstab/mismatch_kl": tr.k3.tolist()})
        assert find_trouble(recs, GuardOptions(), LengthSurgeConfig()) is None, tr.name


# -- the rollback: verl's resume, the decay from the checkpoint ------------------------------------
def test_the_rollback_resumes_verl_from_the_checkpoint_with_the_decay_started_there(tmp_path):
    plan = plan_run(verl_config("trainer.save_freq=5", "actor_rollout_ref.rollout.seed=7"), tmp_path)
    out = rollback_overrides(tmp_path, 10, 27, 1, GuardOptions(reseed=True), plan)
    assert "trainer.resume_mode=resume_path" in out
    assert f"trainer.resume_from_path={tmp_path / 'global_step_10'}" in out
    assert "actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge" in out
    assert "++actor_rollout_ref.actor.optim.length_surge.decay_from_step=10" in out
    assert "++actor_rollout_ref.actor.optim.length_surge.decay_period=27" in out
    assert "actor_rollout_ref.rollout.seed=1007" in out
    # the period: period_factor x the surge step (the paper's calibrated second run), else x the onset
    assert decay_period_for(Trouble("surge", 15, 12, 15), LengthSurgeConfig()) == 27
    assert decay_period_for(Trouble("reward_crash", 40, 30), LengthSurgeConfig()) == 54


def expected_scale(update: int, start: int, period: int) -> float:
    """The documented rule: halve on the first update after ``start``, then every ``period``; floor 0.1."""
    n = 0 if update <= start else 1 + (update - start - 1) // period
    return max(0.1, 0.5 ** n)


def test_the_guards_decay_wins_over_the_checkpoints_scheduler_state():
    # a checkpoint written before any surge (no decay) and one written after the run's own decay
    # started at update 4: resumed with decay_from_step=10, both follow the guard's rule
    w = torch.nn.Parameter(torch.zeros(1))
    for own_trigger in (None, 4):
        sched = LengthSurgeLR(torch.optim.SGD([w], lr=1.0), {"origin": "surge", "skip_first_steps": 0})
        for u in range(10):
            sched.step(100.0)
        state = sched.state_dict()
        state["schedule"]["trigger_step"] = own_trigger
        resumed = LengthSurgeLR(torch.optim.SGD([w], lr=1.0), {"decay_from_step": 10, "decay_period": 3})
        resumed.load_state_dict(state)
        assert resumed.schedule.trigger_step == 10 and resumed.schedule.trigger_source == "guard"
        lrs = []
        for u in range(11, 20):
            lrs.append(resumed.get_last_lr()[0])  # the LR of update u
            resumed.step(100.0)
        assert lrs == pytest.approx([expected_scale(u, 10, 3) for u in range(11, 20)])


def test_a_checkpoint_of_verls_constant_schedule_gets_the_guards_decay_too():
    s = LengthSurgeSchedule({"decay_from_step": 6, "decay_period": 2})  # the foreign-checkpoint path keeps __init__'s state
    assert [s.decay_scale(u) for u in range(5, 11)] == pytest.approx([expected_scale(u, 6, 2) for u in range(5, 11)])


@pytest.mark.parametrize("options,key", [({"decay_from_step": 3}, "decay_from_step"),
                                         ({"decay_from_step": -1, "decay_period": 3}, "decay_from_step"),
                                         ({"decay_from_step": 3, "decay_period": 3, "monitor_only": True}, "decay_from_step"),
                                         ({"guard_rollbacks": -1}, "guard_rollbacks")])
def test_bad_guard_options_name_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        LengthSurgeConfig(**options)


def test_the_rollback_count_is_logged():
    assert LengthSurgeSchedule({"guard_rollbacks": 2}).metrics(0)["lrstab/rollbacks"] == 2
    assert "lrstab/rollbacks" not in LengthSurgeSchedule().metrics(0)


@pytest.mark.parametrize("kwargs,key", [({"max_rollbacks": -1}, "max-rollbacks"), ({"margin": -2}, "margin"),
                                        ({"crash_fraction": 1.5}, "crash-fraction")])
def test_bad_guard_cli_options_name_the_option(kwargs, key):
    with pytest.raises(GuardError, match=key):
        GuardOptions(**kwargs)


def test_lrstab_guard_refuses_a_command_that_is_not_main_ppo(capsys):
    from verl_lrstab.cli import main

    assert main(["guard", "--", "python", "train.py"]) == 2
    assert "python -m verl.trainer.main_ppo" in capsys.readouterr().err


def test_an_unwritable_run_dir_is_refused(tmp_path):
    from verl_lrstab.guard.supervisor import Guard

    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # (root writes anywhere: a folder under a file cannot be made by anyone)
    with pytest.raises(GuardError, match=r"--run-dir .*cannot write there"):
        Guard(MAIN + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.save_freq=5"],
              run_dir=blocker / "guard", cwd=tmp_path)


def test_compare_reads_a_guard_run_and_draws_the_abandoned_segment(tmp_path, monkeypatch):
    import json

    from verl_lrstab import cli, plots

    def write(path, steps, length):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"step": s, "data": {"response_length/mean": length(s),
                                                                "critic/score/mean": 0.5}}) + "\n" for s in steps))

    run = tmp_path / "guard"
    write(run / "abandoned" / "attempt-1" / "metrics.jsonl", range(1, 17), lambda s: 10.0 + s * s / 5)
    write(run / "metrics.jsonl", range(1, 25), lambda s: 10.0 + s / 2)
    events = [{"event": "start", "step": 0}, {"event": "surge", "step": 15, "onset_step": 7},
              {"event": "rollback", "step": 15, "checkpoint_step": 4, "onset_step": 7, "attempt": 1, "reason": "surge",
               "abandoned_metrics": str(run / "abandoned" / "attempt-1" / "metrics.jsonl")},
              {"event": "done", "step": 24, "metrics": str(run / "metrics.jsonl")}]
    (run / "lrstab_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    drawn = []
    real = plots.plot_curves
    monkeypatch.setattr(plots, "plot_curves", lambda curves, *a, **k: (drawn.append(curves), real(curves, *a, **k))[1])
    assert cli.main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    curve = drawn[0][0]  # the first figure: the response length
    assert list(curve.rollback_steps) == [4]
    assert len(curve.abandoned) == 1 and list(curve.abandoned[0].index) == list(range(1, 17))
    assert list(curve.series.index) == list(range(1, 25))
    assert (tmp_path / "cmp" / "length.png").exists()


@pytest.mark.parametrize("trainer", ["v1", "v0"])
def test_what_verl_prints_when_a_shard_fails_to_load_is_a_failed_load(trainer):
    from verl_lrstab.guard.plan import LOAD_BEGINS, checkpoint_failed_to_load

    log = (Path(__file__).resolve().parent / "standin" / "verl_logs" / f"{trainer}_damaged_model_shard.log").read_text()
    assert checkpoint_failed_to_load(log)  # the Ray traceback through the trainer's _load_checkpoint
    # killed while loading (no traceback): the trainer's line before the load is what is left
    begins = next(i for i, line in enumerate(log.splitlines()) if any(m in line for m in LOAD_BEGINS))
    cut = "\n".join(log.splitlines()[:begins + 1])
    assert "Traceback" not in cut and checkpoint_failed_to_load(cut)
    assert not checkpoint_failed_to_load("\n".join(log.splitlines()[:begins]))  # died before the load began
    # the load returned: fit()'s progress bar; a later death is not the checkpoint's
    assert not checkpoint_failed_to_load(cut + "\nTraining Progress:   0%|          | 4/6\nTraceback (most recent "
                                         "call last):\ntorch.OutOfMemoryError: CUDA out of memory")
