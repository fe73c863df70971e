"""End-to-end (small form): ``lrstab admit`` on verl's real main_ppo, CPU transformers rollout.

Three candidates, two launched for 6 no-update steps each, against the float32 trainer (the tiny model): a
float32 sampler, and a bfloat16 sampler whose weights get a noise that doubles at every weight sync
(the injected drifting sampler: ``engine_kwargs.transformers.weight_noise_growth``), and one whose
override does not exist: the bad one is reported by name and the others still run; the drifting
bf16's k3 is above fp32's (near zero) and grows at LR 0; a budget between the two admits fp32 and
rejects the drifting one, for both reasons. The fp32 candidate also
saves verl's HF checkpoint after its last step: at LR 0 every weight must equal the model it started
from. (The four-candidate vLLM demo, ``make demo-admit``, is ``scripts/demo_admit.py``.)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from verl_lrstab_cpu.launch import CONFIG_DIR, cpu_env
from verl_lrstab.mismatch import TAIL_LABELS

pytestmark = pytest.mark.e2e
NOISE = "actor_rollout_ref.rollout.engine_kwargs.transformers"


def test_admit_ranks_two_samplers_and_reports_a_bad_candidate(tmp_path, assets_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "verl_lrstab.cli", "admit", "--steps", "6", "--budget", "1e-6", "--out",
           str(run_dir / "admit"),
           "--candidate", f"fp32=actor_rollout_ref.rollout.dtype=float32 trainer.save_freq=6 "
                          f"trainer.default_local_dir={run_dir / 'ckpt'} "
                          "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
           "--candidate", f"bf16=actor_rollout_ref.rollout.dtype=bfloat16 {NOISE}.weight_noise=0.002 "
                          f"{NOISE}.weight_noise_growth=2",
           "--candidate", "typo=actor_rollout_ref.rollout.no_such_key=1",
           "--", sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR), "--config-name",
           "cpu_demo", f"hydra.run.dir={run_dir / 'hydra'}", "trainer.use_v1=true"]
    proc = subprocess.run(cmd, cwd=run_dir, env=cpu_env(assets_dir, run_dir / "unused.jsonl", run_dir),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report_path = proc.stdout.strip().splitlines()[-1]
    data = json.loads(open(report_path).read())
    by = {c["name"]: c for c in data["candidates"]}
    assert data["budget"] == {"value": 1e-6, "source": "fixed", "reference": None, "factor": None}
    assert by["fp32"]["steps"] == by["bf16"]["steps"] == 6
    assert by["fp32"]["k3"] < 1e-6 < by["bf16"]["k3"]
    assert (by["fp32"]["verdict"], by["bf16"]["verdict"], by["typo"]["verdict"]) == ("admit", "reject", "failed")
    assert "no_such_key" in by["typo"]["error"] and by["typo"]["k3"] is None
    # drift at LR 0 is found on the drifting sampler only: a system mismatch, named as such
    assert by["bf16"]["drift_ratio"] >= 1.5 > by["fp32"]["drift_ratio"]
    assert any("grows at LR 0" in r for r in by["bf16"]["reasons"]) and not any(
        "grows at LR 0" in r for r in by["fp32"]["reasons"])
    # LR 0: the trainer computed gradients and applied none
    rows = [json.loads(line)["data"] for line in (run_dir / "admit" / "bf16.jsonl").read_text().splitlines()]
    assert all(r["actor/lr"] == 0.0 and r["actor/grad_norm"] > 0 for r in rows)
    # the figures admit judges are verl's own where both exist (verl computes in float32)
    assert all("rollout_corr/k3_kl" in r for r in rows)
    for r in rows:
        assert r["actor/mismatch/k3"] == pytest.approx(r["rollout_corr/k3_kl"], rel=2e-2, abs=5e-8)
    assert by["bf16"]["k3"] == statistics.median(r["actor/mismatch/k3"] for r in rows)  # the verdict's figure
    # ... and no weight moved: the checkpoint after 6 steps is the model it started from, bit for bit
    before = load_file(assets_dir / "model" / "model.safetensors")
    after = load_file(run_dir / "ckpt" / "global_step_6" / "actor" / "huggingface" / "model.safetensors")
    assert set(after) <= set(before) and len(after) >= len(before) - 1  # tied lm_head may be left out
    changed = [k for k in after if not torch.equal(after[k].to(before[k].dtype), before[k])]
    assert not changed, changed
    # the per-token |d| distribution: bf16's tail lies above fp32's at every decade, and is drawn
    assert set(by["bf16"]["tail"]) == set(TAIL_LABELS)
    assert all(by["bf16"]["tail"][e] >= by["fp32"]["tail"][e] for e in TAIL_LABELS)
    assert by["bf16"]["tail"]["1e-4"] > by["fp32"]["tail"]["1e-4"]
    assert data["figure"] and (run_dir / "admit" / "admit.png").stat().st_size > 10_000
