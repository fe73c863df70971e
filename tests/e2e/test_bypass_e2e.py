"""End-to-end: ``actor/mismatch/*`` in verl's bypass mode, in verl's real main_ppo on CPU.

With ``algorithm.rollout_correction.bypass_mode=true`` verl uses ``rollout_log_probs`` as the old
log-probs and never recomputes them; the figures then come from the trainer's own log-probs of the
first mini-batch's forward (``verl_lrstab.mismatch.FirstMiniBatchCapture``). The CPU rollout
generates in bf16 (a real mismatch against the fp32 trainer) or fp32 (none). Each bypass run has a twin without bypass mode
(``test_mismatch_e2e.bf16_run``: same overrides otherwise), whose first step samples the same
tokens with the same weights: there the two figures must agree. The last test drives verl's
actor worker directly (2 DP ranks, 2 mini-batches per update: ``tests/bypass_engine_check.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_main_ppo_cpu import SURGE, TRAINER, series
from test_mismatch_e2e import BF16_STEPS, FP32_K3_MAX, MISMATCH_KEYS, ONE_BATCH, bf16_run
from verl_lrstab.mismatch import finalize

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]  # a test may start two runs of RUN_TIMEOUT_S

BYPASS = "algorithm.rollout_correction.bypass_mode=true"
BYPASS_KEY = "actor/mismatch/bypass_mode"
BUDGET = 1e-7  # below every bf16 k3 measured here (~1e-5): the trigger must fire
FP32_STEPS = 3
BATCH = 8 * 4  # data.train_batch_size x rollout.n (configs/cpu_demo.yaml): one mini-batch


def bypass_run(main_ppo, dtype: str = "bfloat16", trainer: str = "v0", steps: int = BF16_STEPS):
    """``bf16_run``'s overrides plus bypass mode (and the rollout dtype): the decay is started by the mismatch trigger."""
    return main_ppo(f"bypass-{trainer}-{dtype}-{steps}", SURGE + TRAINER[trainer] + [
        f"trainer.total_training_steps={steps}",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        "actor_rollout_ref.actor.optim.length_surge.trigger=mismatch",
        f"actor_rollout_ref.actor.optim.length_surge.mismatch_budget={BUDGET}",
        BYPASS,
        ONE_BATCH,  # the same batches as its twin (bf16_run), so step 1 compares the same samples
    ])


def test_bypass_mode_measures_the_training_forward_against_the_rollout(main_ppo):
    run = bypass_run(main_ppo)
    twin = bf16_run(main_ppo, budget=BUDGET)  # the same run with the trainer's recompute
    steps = sorted(run.metrics)
    assert steps == list(range(1, BF16_STEPS + 1))
    for step in steps:
        data = run.metrics[step]
        assert MISMATCH_KEYS | {BYPASS_KEY} <= set(data), (step, MISMATCH_KEYS - set(data))
        assert data[BYPASS_KEY] == 1.0 and data["actor/mismatch/n_nonfinite"] == 0
        # one mini-batch per update here: the figure covers every response token of the step
        assert data["actor/mismatch/n_tokens"] == pytest.approx(data["response_length/mean"] * BATCH, abs=1e-6)
    assert all(BYPASS_KEY not in data for data in twin.metrics.values())  # outside bypass mode: unchanged

    k3, twin_k3 = series(run.metrics, "actor/mismatch/k3"), series(twin.metrics, "actor/mismatch/k3")
    assert min(k3.values()) > 10 * FP32_K3_MAX, k3  # not 0 by construction any more
    mean, twin_mean = sum(k3.values()) / len(k3), sum(twin_k3.values()) / len(twin_k3)
    assert 0.2 < mean / twin_mean < 5, (k3, twin_k3)  # the same order as with the recompute

    # Step 1: same weights, same sampled tokens; the update's forward (train mode) and verl's
    # recompute (eval mode) of the same fp32 model agree to float rounding.
    first, twin_first = run.metrics[1], twin.metrics[1]
    assert first["actor/mismatch/n_tokens"] == twin_first["actor/mismatch/n_tokens"]
    for key in ("k1", "k3", "seq_k3", "max_abs_diff"):
        assert first[f"actor/mismatch/{key}"] == pytest.approx(twin_first[f"actor/mismatch/{key}"], rel=1e-6), key


def test_verls_ppo_kl_equals_k1_with_one_mini_and_micro_batch(main_ppo):
    # verl's ppo_kl is the token mean of old - new log-probs per micro-batch, averaged over
    # micro- and mini-batches; with old := rollout and one of each, that is exactly k1.
    run = bypass_run(main_ppo)
    k1, ppo_kl = series(run.metrics, "actor/mismatch/k1"), series(run.metrics, "actor/ppo_kl")
    assert set(k1) == set(ppo_kl)
    for step in k1:
        assert ppo_kl[step] == pytest.approx(k1[step], rel=1e-4, abs=1e-9), step


def test_the_mismatch_trigger_fires_in_bypass_mode(main_ppo):
    run = bypass_run(main_ppo)
    trigger = series(run.metrics, "actor/lrstab/trigger_step")
    fired = [s for s in sorted(trigger) if trigger[s] >= 0]
    assert fired, f"budget {BUDGET} is below every k3 {series(run.metrics, 'actor/mismatch/k3')}: must fire"
    assert series(run.metrics, "actor/lrstab/mismatch_budget")[fired[0]] == pytest.approx(BUDGET)
    lr = series(run.metrics, "actor/lr")
    assert lr[BF16_STEPS] < lr[1], "the decay started by the mismatch trigger must lower the LR"


@pytest.mark.slow  # the step-1 equality above already ties the update's forward to the recompute
def test_fp32_sampling_in_bypass_mode_gives_near_zero(main_ppo):
    run = bypass_run(main_ppo, dtype="float32", steps=FP32_STEPS)
    k3 = series(run.metrics, "actor/mismatch/k3")
    assert sorted(k3) == list(range(1, FP32_STEPS + 1))
    assert all(0.0 <= v <= FP32_K3_MAX for v in k3.values()), k3
    assert set(series(run.metrics, BYPASS_KEY).values()) == {1.0}


@pytest.mark.slow
def test_bypass_mode_with_the_v1_trainer(main_ppo):
    run = bypass_run(main_ppo, trainer="v1", steps=FP32_STEPS)
    for step, data in run.metrics.items():
        assert data.get(BYPASS_KEY) == 1.0, step
        assert data["actor/mismatch/k3"] > 10 * FP32_K3_MAX and data["actor/mismatch/n_tokens"] > 0, step


# -- verl's actor worker directly: 2 DP ranks, 2 mini-batches per update -------------------------------
TESTS = Path(__file__).resolve().parents[1]
ENGINE_STEPS = 5


def run_ranks(script: Path, model_dir: Path, out_dir: Path, world_size: int, *args: str) -> list[dict]:
    """``script`` in one process per rank (gloo, no Ray); the ranks' JSON outputs."""
    sys.path.insert(0, str(TESTS))
    import engine_harness as h

    port, procs = str(h.free_port()), []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        out, log = out_dir / f"rank{rank}.json", out_dir / f"rank{rank}.log"
        with open(log, "w") as log_file:
            cmd = [sys.executable, str(script), "--model", str(model_dir), "--out", str(out), *args]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT), out, log))
    try:
        for proc, _, log in procs:
            if proc.wait(timeout=240) != 0:
                pytest.fail(f"{script.name} failed (log {log}):\n" + "\n".join(log.read_text().splitlines()[-30:]))
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return [json.loads(out.read_text()) for _, out, _ in procs]


def _global(records, key):
    """:func:`finalize` of the ranks' stats summed (max for the max), as the DP all-reduce gives."""
    stats = torch.stack([torch.tensor(r[key], dtype=torch.float64) for r in records])
    return finalize(torch.cat([stats[:, :-1].sum(0), stats[:, -1:].max(0).values]))


@pytest.mark.timeout(400)
def test_verl_actor_worker_two_ranks_two_mini_batches(tmp_path):
    """The logged figure is the first mini-batch's (not the whole batch's), all-reduced over 2 ranks,
    and reaches the mismatch trigger before the LR steps on every update."""
    sys.path.insert(0, str(TESTS))
    import engine_harness as h

    model = h.build_tiny_model(tmp_path / "model")
    ranks = run_ranks(TESTS / "bypass_engine_check.py", Path(model), tmp_path, 2, "--steps", str(ENGINE_STEPS))
    for step in range(ENGINE_STEPS):
        per_rank = [r["records"][step] for r in ranks]
        logged = per_rank[0]["logged"]
        assert all(p["logged"] == logged for p in per_rank), "the ranks must log the same global figures"
        first, whole = _global(per_rank, "expected_first_stats"), _global(per_rank, "whole_batch_stats")
        assert logged["mismatch/bypass_mode"] == 1.0
        assert logged["mismatch/n_tokens"] == first["mismatch/n_tokens"] < whole["mismatch/n_tokens"]
        for key in ("k1", "k3", "seq_k3", "max_abs_diff", "frac_over_thr"):
            assert logged[f"mismatch/{key}"] == pytest.approx(first[f"mismatch/{key}"], rel=1e-5, abs=1e-9), key
        assert logged["mismatch/k3"] != pytest.approx(whole["mismatch/k3"], rel=1e-3)  # not the whole batch
        trigger = [p["trigger"] for p in per_rank]
        assert all(t["num_skipped"] == 0 and t["last_step"] == step + 1 for t in trigger), trigger
    # budget 1e-9, skip_first_steps 2, patience 2 (engine_harness): fires at update 4 when every update's
    # figure reached the scheduler before it stepped
    assert [r["records"][-1]["trigger"]["fired_step"] for r in ranks] == [4, 4]
