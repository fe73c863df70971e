"""Fast checks of the reproduction's task, reward, arms and report logic (scripts/research/repro); no main_ppo runs."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pandas as pd
import pytest

# verl ships a top-level `scripts` package that shadows ours: import `repro` from scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "research"))
from repro import arms, bypass_arms, evaluate, report, task  # noqa: E402

# vllm_server imports verl's vllm rollout, which imports vLLM: not in the venv `make install` builds
VLLM_REASON = "needs vLLM (verl's vllm rollout imports it): make install-vllm"


@pytest.mark.parametrize("a,b", [(347, 589), (9999, 1), (5, 7), (0, 0), (120, 4031)])
def test_worked_answer_is_a_correct_column_addition(a, b):
    text = task.worked_answer(a, b)
    steps = text.split(",")
    assert steps[-1] == f"={a + b}"
    assert len(steps) - 1 == max(len(str(a)), len(str(b)))
    digits, carry = [], 0
    for i, step in enumerate(steps[:-1]):
        lhs, rhs = step.split("=")
        terms = [int(t) for t in lhs.split("+")]
        assert sum(terms) == int(rhs)
        assert terms[2:] == ([carry] if carry else [])  # the carry is written only when there is one
        digits.append(int(rhs) % 10)
        carry = int(rhs) // 10
    assert int((str(carry) if carry else "") + "".join(map(str, reversed(digits)))) == a + b
    assert task.compute_score("", text, str(a + b)) == 1.0
    assert len(text) > len(task.direct_answer(a, b)) + 5  # the worked form is the long one


@pytest.mark.parametrize(
    "response,expected",
    [("=936", 1.0), ("7+9=16,4+8+1=13,3+5+1=9,=936", 1.0), ("=937", 0.0), ("936", 0.0), ("", 0.0),
     ("=936 and more", 0.0), ("7+9=16,=93", 0.0), ("=936\n", 1.0)],
)
def test_reward_checks_only_the_final_answer(response, expected):
    assert task.compute_score("lrstab_repro_add", response, "936") == expected
    assert task.compute_score("lrstab_repro_add", response, 936) == expected


def test_reward_does_not_pay_for_length():
    right_short, right_long = task.direct_answer(347, 589), task.worked_answer(347, 589)
    assert task.compute_score("", right_short, 936) == task.compute_score("", right_long, 936) == 1.0
    assert task.answer_mode(right_short) == "direct" and task.answer_mode(right_long) == "worked"


def test_problems_respect_digit_bounds():
    rng = random.Random(0)
    pairs = [task.make_problem(rng, 2, 4) for _ in range(500)]
    lengths = {len(str(x)) for p in pairs for x in p}
    assert lengths == {2, 3, 4}
    with pytest.raises(ValueError, match="min_digits"):
        task.make_problem(rng, 3, 2)


def test_parquet_has_verls_layout(tmp_path):
    path = tmp_path / "train.parquet"
    task.write_parquet(path, [(12, 34), (500, 7)], "train")
    df = pd.read_parquet(path)
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert df.loc[1, "reward_model"]["ground_truth"] == "507"
    assert list(df.loc[0, "prompt"]) == [{"role": "user", "content": "12+34"}]


def test_arms_all_carry_mismatch_but_the_control():
    for name in arms.ARMS:
        ov = arms.arm_overrides(name, seed=3, steps=50, lr=1e-4, noise=0.02)
        assert "trainer.use_v1=false" in ov and "data.seed=3" in ov and "trainer.total_training_steps=50" in ov
        noisy = "actor_rollout_ref.rollout.engine_kwargs.transformers.weight_noise=0.02" in ov
        bf16 = "actor_rollout_ref.rollout.dtype=bfloat16" in ov
        assert noisy == bf16 == (name != "control"), name
    assert any("rollout_is=token" in o for o in arms.arm_overrides("const_tis", 1, 5, 1e-4, 0.0))
    assert f"{arms.LS}.origin=surge" in arms.arm_overrides("ls_surge", 1, 5, 1e-4, 0.0)
    with pytest.raises(ValueError, match="allowed values"):
        arms.arm_overrides("nope", 1, 5, 1e-4, 0.0)


@pytest.mark.parametrize(
    "val,expected",
    [({0: 0.1, 10: 0.5, 20: 0.6, 30: 0.2, 40: 0.1}, 30),   # falls and stays below half the peak
     ({0: 0.1, 10: 0.6, 20: 0.2, 30: 0.5}, None),          # recovers: no collapse
     ({0: 0.1, 10: 0.6, 20: 0.2, 30: 0.5, 40: 0.29, 50: 0.1}, 40),  # the last dip counts from its start
     ({0: 0.1, 10: 0.6, 20: 0.5, 30: 0.2}, None),          # one low last point is not a collapse
     ({0: 0.0, 10: 0.03, 20: 0.0}, None),                  # never learned: cannot collapse
     ({}, None)],
)
def test_collapse_rule(val, expected):
    assert report.collapse_step(val) == expected


def test_report_reads_verl_jsonl(tmp_path):
    run = tmp_path / "runs" / "const-s1"
    run.mkdir(parents=True)
    lines = [{"step": 0, "data": {report.VAL_KEY: 0.2}}]
    for s in range(1, 31):
        d = {"response_length/mean": 10.0 + s, "actor/mismatch/k3": 1e-3 * s, "actor/lrstab/surge_step": -1 if s < 20 else 20,
             "actor/lrstab/trigger_step": -1 if s < 25 else 25}
        if s % 10 == 0:
            d[report.VAL_KEY] = {10: 0.5, 20: 0.2, 30: 0.1}[s]
        lines.append({"step": s, "data": d})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 31, \"da")
    (run / "run.json").write_text(json.dumps({"arm": "const", "seed": 1, "wall_s": 12.0}))
    assert report.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    row = json.loads((tmp_path / "rep" / "summary.json").read_text())[0]
    assert row["decay_step"] == 25
    assert (row["surge_step"], row["collapse_step"], row["start_val"], row["peak_val"], row["final_val"]) == (20, 20, 0.2, 0.5, 0.1)
    assert row["len_first10"] == pytest.approx(15.5) and row["len_last10"] == pytest.approx(35.5)
    assert row["lead"] == 0 and row["val_source"] == "sampler"
    assert "| const | 1 | 20 | 25 | 1/1 (20) | 0 | 0.2 | 0.5 | 0.1 |" in (tmp_path / "rep" / "summary.md").read_text()
    assert row["late_val"] == pytest.approx((0.2 + 0.5 + 0.2 + 0.1) / 4)  # fewer than LATE_POINTS validations: all
    for name in ("overview", "length", "val", "mismatch", "lr"):
        assert (tmp_path / "rep" / f"{name}.png").stat().st_size > 0


def test_all_refuses_a_warm_start_of_another_recipe(tmp_path):
    from repro import all as repro_all

    (tmp_path / "warmstart.json").write_text(json.dumps({"args": {"steps": 8000, "min_digits": 2, "max_digits": 3,
                                                                   "worked_fraction": 0.4}}))
    args = repro_all.parse_args([])
    args.sft_steps = 8000
    with pytest.raises(SystemExit, match="min_digits: built 2, asked 3.*max_digits: built 3, asked 4"):
        repro_all.check_recipe(tmp_path, args)
    args.min_digits, args.max_digits = 2, 3
    repro_all.check_recipe(tmp_path, args)  # the same recipe: reused


def test_all_reuses_a_finished_run_only_with_the_same_setting(tmp_path):
    from repro import all as repro_all

    info = tmp_path / "run.json"
    assert not repro_all.finished_run(info, steps=150, lr=5e-4, noise=0.3)  # never ran
    info.write_text(json.dumps({"returncode": 0, "timed_out": False, "steps": 150, "lr": 5e-4, "noise": 0.3}))
    assert repro_all.finished_run(info, steps=150, lr=5e-4, noise=0.3)
    with pytest.raises(SystemExit, match="lr: ran 0.0005, asked 0.001"):
        repro_all.finished_run(info, steps=150, lr=1e-3, noise=0.3)
    info.write_text(json.dumps({"returncode": 1, "steps": 150, "lr": 5e-4, "noise": 0.3}))
    assert not repro_all.finished_run(info, steps=150, lr=5e-4, noise=0.3)  # failed: run again


def test_bypass_arms_differ_only_in_what_they_name():
    base = set(bypass_arms.arm_overrides("bp_const", seed=2, steps=300, lr=5e-4))
    assert {"+cpu_rollout=vllm", "data.max_response_length=128", "data.seed=2", "trainer.total_training_steps=300",
            "actor_rollout_ref.rollout.full_determinism=true", bypass_arms.BYPASS, bypass_arms.MONITOR} <= base
    assert f"{bypass_arms.LS}.detector=cusum" in base  # the package's detector, not the demo's short windows
    assert "~actor_rollout_ref.actor.optim.length_surge.cusum_span" in base
    extra = {arm: set(bypass_arms.arm_overrides(arm, 2, 300, 5e-4)) - base for arm in bypass_arms.ARMS}
    assert extra["bp_ls_start"] == {f"{bypass_arms.LS}.origin=start"} | ({f"trainer.experiment_name=bp_ls_start-s2"})
    assert f"{bypass_arms.LS}.origin=surge" in extra["bp_ls_surge"]
    assert "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine" in extra["bp_cosine"]
    assert {"algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.loss_type=reinforce"} <= extra["bp_tis"]
    # where verl's engine workers read the loss (the V0 driver's apply_bypass_mode does not reach them)
    assert {"++actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
            "++actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}"} <= extra["bp_tis"]
    recompute = set(bypass_arms.arm_overrides("recompute", 2, 300, 5e-4))
    assert bypass_arms.BYPASS not in recompute and bypass_arms.MONITOR in recompute
    for arm in ("bp_ls_start", "bp_ls_surge", "bp_cosine"):  # the LR moves in these arms only
        assert bypass_arms.MONITOR not in set(bypass_arms.arm_overrides(arm, 2, 300, 5e-4))
    with pytest.raises(ValueError, match="allowed values are"):
        bypass_arms.arm_overrides("const", 1, 5, 1e-4)
    assert bypass_arms.sampler_env("bf16", 1.0) == {"LRSTAB_VLLM_SAMPLER_WEIGHTS": "", "LRSTAB_VLLM_SAMPLER_TEMPERATURE": ""}
    assert bypass_arms.sampler_env("bf16")["LRSTAB_VLLM_SAMPLER_TEMPERATURE"] == "1.3"  # the recipe's default amplifier
    assert bypass_arms.sampler_env("fp8_e4m3", 1.3)["LRSTAB_VLLM_SAMPLER_TEMPERATURE"] == "1.3"
    with pytest.raises(ValueError, match="--sampler-temperature 0.0: allowed values are numbers > 0"):
        bypass_arms.sampler_env("bf16", 0.0)
    with pytest.raises(ValueError, match="--sampler 'fp4'.*allowed values"):
        bypass_arms.sampler_env("fp4")


def test_sampler_rounding_keeps_the_kind_of_the_mismatch(monkeypatch):
    import torch

    pytest.importorskip("vllm", reason=VLLM_REASON)
    from verl_lrstab_cpu import vllm_server

    # rows of very different scales (1e-6 to 1): one scale for the whole tensor would flush the small rows to
    # zero, a scale per row keeps each row's error within half a step of its top binade (3 / 2 mantissa bits)
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=generator) * torch.logspace(-6, 0, 64)[:, None]
    name = "model.layers.0.mlp.down_proj.weight"
    errors = {}
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        q = vllm_server.round_sampler_weight(name, w, fmt)
        # each row's largest error against the row's largest value (an element near zero may be subnormal:
        # its own relative error is no bound)
        rel = (q - w).abs().amax(dim=1) / w.abs().amax(dim=1)
        errors[fmt] = ((q - w).norm() / w.norm()).item()
        assert q.dtype == w.dtype and q.shape == w.shape
        assert (rel < {"fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}[fmt]).all(), rel.max()
        assert not torch.equal(q, w)
    assert errors["fp8_e5m2"] > 1.5 * errors["fp8_e4m3"]  # fewer mantissa bits: the larger mismatch
    for untouched in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert vllm_server.round_sampler_weight(untouched, w, "fp8_e5m2") is w
    assert vllm_server.round_sampler_weight(name, w, None) is w
    monkeypatch.setenv(vllm_server.SAMPLER_WEIGHTS_ENV, "fp8_e5m2")
    assert vllm_server.sampler_format() == "fp8_e5m2"
    monkeypatch.setenv(vllm_server.SAMPLER_WEIGHTS_ENV, "int4")
    with pytest.raises(ValueError, match="LRSTAB_VLLM_SAMPLER_WEIGHTS='int4': allowed values"):
        vllm_server.sampler_format()


def test_the_marked_grader_ignores_what_follows_the_answer(tmp_path):
    import json as _json

    from repro import bypass_arms, evaluate, task

    worked = task.worked_answer(347, 589)
    for text in (worked, worked + ",7+7=14,3", worked + " +", "=936"):
        assert task.compute_score_marked("", text, 936) == 1.0
    assert task.compute_score("", worked + ",7+7=14,3", 936) == 0.0  # the strict grader wants the answer last
    assert task.compute_score_marked("", "7+9=16,4+8+1=13,3+5+1=9,=935,=936", 936) == 1.0  # the last marker counts
    assert task.compute_score_marked("", "7+9=16,4+8+1=13,3+5+1=936", 936) == 0.0  # a column step is no answer
    assert task.compute_score_marked("", "", 936) == 0.0
    overrides = bypass_arms.arm_overrides("bp_const", 1, 10, 5e-4, grader="marked")
    assert "reward.custom_reward_function.name=compute_score_marked" in overrides
    assert "reward.custom_reward_function.name=compute_score" in bypass_arms.arm_overrides("bp_const", 1, 10, 5e-4)
    with pytest.raises(ValueError, match="--grader 'loose': allowed values are"):
        bypass_arms.arm_overrides("bp_const", 1, 10, 5e-4, grader="loose")
    (tmp_path / "run.json").write_text(_json.dumps({"grader": "marked"}))
    assert evaluate.run_grader(tmp_path) is task.compute_score_marked  # fp32 validation grades as training did
    assert evaluate.run_grader(tmp_path / "older-run") is task.compute_score


def test_sampler_temperature_makes_the_sampler_heavier_tailed(monkeypatch):
    import torch

    pytest.importorskip("vllm", reason=VLLM_REASON)
    from verl_lrstab_cpu import vllm_server

    monkeypatch.delenv(vllm_server.SAMPLER_TEMPERATURE_ENV, raising=False)
    assert vllm_server.sampler_temperature_factor() == 1.0
    monkeypatch.setenv(vllm_server.SAMPLER_TEMPERATURE_ENV, "1.3")
    factor = vllm_server.sampler_temperature_factor()
    assert factor == 1.3
    params = {"temperature": 1.0, "top_p": 1.0, "logprobs": 0}
    hot = vllm_server.scale_sampling_temperature(params, factor)
    assert hot == {**params, "temperature": 1.3} and params["temperature"] == 1.0  # the caller's dict is untouched
    greedy = {"temperature": 0}
    assert vllm_server.scale_sampling_temperature(greedy, factor) is greedy  # greedy stays greedy
    # the kind of mismatch it makes: the tail is likelier under the sampler than under the trainer
    logits = torch.tensor([4.0, 1.0, 0.0, -2.0])
    trainer, sampler = torch.softmax(logits, 0), torch.softmax(logits / hot["temperature"], 0)
    assert sampler[0] < trainer[0] and (sampler[1:] > trainer[1:]).all()
    for bad in ("0", "-1", "hot", "inf", "nan"):
        monkeypatch.setenv(vllm_server.SAMPLER_TEMPERATURE_ENV, bad)
        with pytest.raises(ValueError, match="LRSTAB_VLLM_SAMPLER_TEMPERATURE=.*allowed values are numbers > 0"):
            vllm_server.sampler_temperature_factor()


def test_report_prefers_the_fp32_validation(tmp_path):
    run = tmp_path / "runs" / "bp_const-s1"
    run.mkdir(parents=True)
    sampler = "val-core/lrstab_repro_add/acc/mean@4"
    lines = [{"step": 0, "data": {sampler: 0.3}}]
    for s in range(1, 61):
        d = {"response_length/mean": 30.0 if s < 35 else 110.0, "actor/lrstab/surge_step": -1 if s < 36 else 36}
        if s % 20 == 0:
            d[sampler] = 0.25
        lines.append({"step": s, "data": d})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (run / "run.json").write_text(json.dumps({"arm": "bp_const", "seed": 1, "recipe": "bypass", "sampler": "bf16",
                                              "sampler_temperature": 1.3, "grader": "strict"}))
    fp32 = {"0": 0.4, "20": 0.8, "40": 0.1, "60": 0.05}
    (run / "fp32_val.json").write_text(json.dumps({k: {"acc": v, "mean_length": 30.0} for k, v in fp32.items()}))
    row = report.collect(tmp_path / "runs")[0][0]
    assert row["val_source"] == "fp32" and (row["peak_val"], row["final_val"], row["start_val"]) == (0.8, 0.05, 0.4)
    assert (row["collapse_step"], row["surge_step"], row["lead"]) == (40, 36, 4)
    assert row["sampler_final_val"] == 0.25
    # the table says which amplifier and grader made it
    assert report.setting_line([row]) == "Setting: recipe bypass, sampler bf16, sampler_temperature 1.3, grader strict"


def test_evaluate_finds_the_checkpoints(tmp_path):
    for step in (20, 40, 100):
        hf = tmp_path / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
        hf.mkdir(parents=True)
        if step != 40:  # a checkpoint without its HF model is not scored
            (hf / "config.json").write_text("{}")
    assert list(evaluate.checkpoints(tmp_path)) == [20, 100]
    with pytest.raises(SystemExit):
        evaluate.parse_args([str(tmp_path), "--n", "0"])


def test_all_scores_a_run_in_fp32_only_when_a_checkpoint_is_unscored(tmp_path):
    from repro import all as repro_all

    assert not repro_all.fp32_validated(tmp_path)  # never scored
    for step in (20, 40):
        hf = tmp_path / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
    (tmp_path / "fp32_val.json").write_text(json.dumps({"0": {}, "20": {}}))
    assert not repro_all.fp32_validated(tmp_path)  # step 40 is not scored yet
    (tmp_path / "fp32_val.json").write_text(json.dumps({"0": {}, "20": {}, "40": {}}))
    assert repro_all.fp32_validated(tmp_path)
