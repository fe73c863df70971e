"""The admission check's verdict: budget, drift at LR 0, the JSON contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from verl_lrstab.admit.verdict import (DEFAULT_BUDGET_K3, Budget, calibrated_budget, drift_ratio, judge,
                                       report_json, report_table)
from verl_lrstab.mismatch_checks import Finding
from verl_lrstab.runs import load_run, metric_series


def steps(k3s, **other):
    return [{"actor/mismatch/k3": k, "actor/mismatch/k1": 2 * k, **other} for k in k3s]


def test_a_candidate_within_the_budget_is_admitted_and_one_over_it_rejected():
    budget = Budget(DEFAULT_BUDGET_K3)
    ok = judge("bf16", steps([3e-5, 2.5e-5, 3.5e-5, 3e-5]), budget)
    hot = judge("bf16-t1.3", steps([4e-3, 3.8e-3, 4.2e-3, 4e-3]), budget)
    assert ok.verdict == "admit" and ok.k3 == pytest.approx(3e-5) and ok.ratio_to_budget == pytest.approx(0.06)
    assert hot.verdict == "reject" and hot.ratio_to_budget == pytest.approx(8.0)
    assert "8 x the budget" in hot.reasons[0]


def test_k3_that_grows_at_lr_0_is_a_system_mismatch():
    drifting = judge("drift", steps([1e-5, 1.5e-5, 3e-5, 6e-5, 1.2e-4, 2.4e-4]), Budget(1e-3))
    assert drifting.verdict == "reject" and drifting.drift_ratio >= 1.5
    assert "grows at LR 0" in drifting.reasons[0] and "no LR schedule" in drifting.reasons[0]
    steady = judge("steady", steps([1e-5, 1.3e-5, 0.9e-5, 1.2e-5, 1e-5, 1.1e-5]), Budget(1e-3))
    assert steady.verdict == "admit" and steady.drift_ratio < 1.5
    assert drift_ratio([1e-5, 2e-5, 3e-5]) is None  # too few steps to tell


def test_no_figures_is_rejected_and_a_failed_run_is_failed_with_the_reason():
    none = judge("off", [{"actor/loss": 0.1}] * 3, Budget(1e-3),
                 findings=[Finding("no_rollout_log_probs", ("x",), "calculate_log_probs=false ...")])
    assert none.verdict == "reject" and "no actor/mismatch/k3" in none.reasons[0]
    assert none.findings == ["no_rollout_log_probs"]
    failed = judge("bad", [], Budget(1e-3), error="exit status 1: unknown key foo")
    assert failed.verdict == "failed" and failed.reasons[0].startswith("the run failed")  # not a verdict on it


def test_a_calibrated_budget_is_the_reference_times_the_factor():
    reports = [judge("fp32", steps([1e-12] * 4), Budget(1.0)), judge("bf16", steps([3e-5] * 4), Budget(1.0))]
    b = calibrated_budget(reports, "bf16", 4.0)
    assert b.value == pytest.approx(1.2e-4) and b.source == "reference" and b.reference == "bf16"
    with pytest.raises(ValueError, match="--reference 'nope' is not a candidate"):
        calibrated_budget(reports, "nope", 4.0)
    with pytest.raises(ValueError, match="--budget-factor"):
        calibrated_budget(reports, "bf16", 0)
    with pytest.raises(ValueError, match="--budget"):
        Budget(-1.0)


def test_the_json_contract_and_the_table():
    budget = Budget(DEFAULT_BUDGET_K3)
    reports = [judge("bf16-t1.3", steps([4e-3] * 4), budget), judge("fp32", steps([1e-12] * 4), budget),
               judge("broken", [], budget, error="boom")]
    data = json.loads(json.dumps(report_json(budget, reports)))
    assert data["budget"]["value"] == DEFAULT_BUDGET_K3 and data["budget"]["source"] == "default"
    assert [(c["name"], c["verdict"]) for c in data["candidates"]] == [("bf16-t1.3", "reject"), ("fp32", "admit"),
                                                                        ("broken", "failed")]
    assert data["candidates"][1]["k3"] == pytest.approx(1e-12) and data["candidates"][2]["k3"] is None
    table = report_table(budget, reports).splitlines()
    assert [line.split("|")[1].strip() for line in table[4:]] == ["fp32", "bf16-t1.3", "broken"]  # by k3, failed last
    assert not any(math.isnan(c["k3"]) for c in data["candidates"] if c["k3"] is not None)


# -- the runner's candidates and the distribution figure ---------------------------------------------
def test_a_candidates_env_tokens_reach_verls_ray_runtime_env_as_strings():
    from pathlib import Path

    from verl_lrstab.admit.runner import NO_UPDATE, QUIET, parse_candidate
    from verl_lrstab.guard.supervisor import compose_config

    cand = parse_candidate("bf16-t1.3=actor_rollout_ref.rollout.dtype=bfloat16 env:LRSTAB_VLLM_SAMPLER_TEMPERATURE=1.3 "
                           "env:LRSTAB_VLLM_SAMPLER_WEIGHTS=fp8_e4m3")
    assert cand.overrides == ["actor_rollout_ref.rollout.dtype=bfloat16"]
    assert cand.env == {"LRSTAB_VLLM_SAMPLER_TEMPERATURE": "1.3", "LRSTAB_VLLM_SAMPLER_WEIGHTS": "fp8_e4m3"}
    launcher = ["python", "-m", "verl.trainer.main_ppo"]
    cfg = compose_config(launcher, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *QUIET,
                                    "++ray_kwargs.ray_init.address=auto", *cand.launch_overrides(), *NO_UPDATE],
                         Path.cwd())
    env_vars = dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars == cand.env and all(isinstance(v, str) for v in env_vars.values())  # Ray takes strings only
    assert cfg.ray_kwargs.ray_init.address == "auto"
    assert cfg.actor_rollout_ref.actor.optim.lr == 0.0 and cfg.trainer.save_freq == -1
    # a candidate may override the quiet defaults (a checkpoint to check), never the LR
    saving = parse_candidate("save=trainer.save_freq=2 actor_rollout_ref.actor.optim.lr=1e-3")
    cfg = compose_config(launcher, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", *QUIET,
                                    *saving.launch_overrides(), *NO_UPDATE], Path.cwd())
    assert cfg.trainer.save_freq == 2 and cfg.actor_rollout_ref.actor.optim.lr == 0.0


@pytest.mark.parametrize("text, named", [("=x=1", "NAME"), ("a/b=x=1", "NAME"), ("ok=env:1BAD=x", "env:1BAD=x"),
                                         ("ok=env:NOVALUE", "env:NOVALUE"), ("ok=env:Q='x'", "env:Q='x'")])
def test_a_malformed_candidate_is_refused_naming_the_token(text, named):
    from verl_lrstab.admit.runner import parse_candidate

    with pytest.raises(ValueError, match=named.replace("'", ".")):
        parse_candidate(text)


def tail_rows(tails, n_tokens):
    labels = ("1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "0.1", "1")
    return {"actor/mismatch/k3": 1e-4, "actor/mismatch/n_tokens": n_tokens,
            **{f"actor/mismatch/frac_over_{label}": share for label, share in zip(labels, tails)}}


def test_tail_shares_weigh_the_steps_by_their_tokens():
    from verl_lrstab.admit.verdict import tail_shares

    rows = [tail_rows([1.0, 0.5, 0.2, 0.1, 0.0, 0.0, 0.0], 100), tail_rows([1.0, 0.8, 0.5, 0.1, 0.1, 0.0, 0.0], 300)]
    got = tail_shares(rows)
    assert got["1e-5"] == pytest.approx((0.5 * 100 + 0.8 * 300) / 400)
    assert got["1e-2"] == pytest.approx(0.075) and got["1"] == 0.0
    assert tail_shares([{"actor/mismatch/k3": 1e-4}]) == {}  # logged by an older version: no tail, no fake zeros


def test_the_distribution_figure_draws_every_candidate_with_a_tail(tmp_path):
    from verl_lrstab.admit.verdict import plot_tails

    budget = Budget(DEFAULT_BUDGET_K3)
    reports = [judge("fp32", [tail_rows([1e-3, 0, 0, 0, 0, 0, 0], 50)] * 4, budget),
               judge("bf16", [tail_rows([0.99, 0.9, 0.6, 0.2, 0.01, 0, 0], 50)] * 4, budget),
               judge("broken", [], budget, error="boom")]
    assert reports[1].tail["1e-3"] == pytest.approx(0.2)
    path = plot_tails(reports, tmp_path / "admit.png")
    assert path.stat().st_size > 10_000
    assert plot_tails(reports[2:], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_the_manuals_gpu_example_composes_in_verls_config():
    """Every candidate of docs/admit.md's copy-paste example is a valid verl override set (composed, not run)."""
    import re
    import shlex
    from pathlib import Path

    from verl_lrstab.admit.runner import NO_UPDATE, QUIET, parse_candidate
    from verl_lrstab.guard.supervisor import compose_config, split_command

    manual = (Path(__file__).resolve().parents[1] / "docs" / "admit.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", manual, re.S) if "--ray-address auto \\" in b)
    argv = shlex.split(block.replace("\\\n", " "))
    cut = argv.index("--")
    launcher, base = split_command(argv[cut + 1:])
    texts = [argv[i + 1] for i, a in enumerate(argv[:cut]) if a == "--candidate"]
    assert len(texts) >= 3
    for text in texts:
        cand = parse_candidate(text)
        cfg = compose_config(launcher, base + QUIET + ["++ray_kwargs.ray_init.address=auto"] + cand.launch_overrides()
                             + NO_UPDATE, Path.cwd())
        assert cfg.actor_rollout_ref.rollout.dtype == "bfloat16" and cfg.actor_rollout_ref.actor.optim.lr == 0.0
        assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True


REAL = Path(__file__).resolve().parents[1] / "scripts" / "research" / "traces" / "real"


def test_the_default_budget_is_below_every_step_of_the_public_collapsing_runs():
    # docs/method.md: the two arms of the Qwen3-1.7B mismatch study that collapsed (the sampler's log-probs as
    # PPO's old ones), their k3 before and inside the judged surge window (EXPECT.txt), to two figures
    windows = dict(line.split() for line in (REAL / "EXPECT.txt").read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    for name, before, inside in (("akna13_nt_vllmold", 6.4e-4, 1.0e-3), ("akna13_nt_vllmold_s1", 6.9e-4, 1.2e-3)):
        lo, hi = map(int, windows[name].split("-"))
        k3 = metric_series(load_run(REAL / f"{name}.csv"), "mismatch_kl_k3")
        assert round(float(k3[k3.index < lo].median()), 5) == before
        assert round(float(k3[(k3.index >= lo) & (k3.index <= hi)].median()), 4) == inside
        assert k3[k3.index <= hi].min() > DEFAULT_BUDGET_K3, name
    for name in ("akna13_nt_fp16", "akna13_nt_fp16_s1", "akna13_th_fp16"):  # the arms that stayed healthy in FP16
        assert metric_series(load_run(REAL / f"{name}.csv"), "mismatch_kl_k3").median() < DEFAULT_BUDGET_K3 / 10
