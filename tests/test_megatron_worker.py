"""verl's real actor worker on its Megatron engine on CPU, with our scheduler: a few PPO updates,
surge, decay, save through ``MegatronCheckpointManager`` and resume in a fresh process.

Each run is ``tests/megatron_harness.py`` in a fresh process (gloo, no Ray); see that file for
what is real, and ``tests/megatron_cpu.py`` for the test-only CUDA stand-ins. The scenario is
``tests/test_engine.py``'s (lr 1e-3, warmup 2, lengths triple from update 7, surge seen at
update 8, P = 10, halving, floor 0.3), so both engines are held to the same trajectory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (make install-megatron)")
pytest.importorskip("mbridge", reason="needs mbridge (make install-megatron)")

sys.path.insert(0, str(Path(__file__).parent))
import engine_harness as h  # noqa: E402
from test_engine import PERIOD, SURGE_STEP, expected_lr  # noqa: E402 - the FSDP engine's scenario

HARNESS = Path(__file__).parent / "megatron_harness.py"
STEPS, SAVE_AT = 12, SURGE_STEP

pytestmark = pytest.mark.timeout(600)


def run(model_dir, out_dir: Path, name: str, *args: str) -> dict:
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    with open(log, "w") as log_file:
        proc = subprocess.run([sys.executable, str(HARNESS), "--model", str(model_dir), "--out", str(out), *args],
                              stdout=log_file, stderr=subprocess.STDOUT, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"{name} exited with {proc.returncode}:\n" + "\n".join(log.read_text().splitlines()[-40:]))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return h.build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_runs")


@pytest.fixture(scope="module")
def surge_run(model_dir, work_dir):
    ckpt = work_dir / f"ckpt/global_step_{SAVE_AT}/actor"
    result = run(model_dir, work_dir, "surge", "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--ckpt", str(ckpt))
    result["ckpt"] = str(ckpt)
    return result


def test_megatron_engine_builds_our_scheduler_through_the_plugin(surge_run):
    d = surge_run["describe"]
    assert d["is_megatron_engine"] and d["engine_wrapped"] and d["optimizer_class"] == "ChainedOptimizer"
    assert d["optimizer_config_class"] == "LengthSurgeMcoreOptimizerConfig"
    assert d["scheduler_class"] == "verl_lrstab.megatron.LengthSurgeParamScheduler"
    assert "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler" in d["scheduler_mro"]
    assert d["use_checkpoint_opt_param_scheduler"] is True  # turned on by length_surge (verl's YAML: false)
    # megatron-core's no-decay group (biases, norms) gets weight decay 0 from the scheduler
    assert sorted((g["wd_mult"], g["weight_decay"]) for g in d["param_groups"]) == [(0.0, 0.0), (1.0, 0.01)]


def test_surge_and_decay_follow_the_rule_and_verls_logged_length(surge_run):
    records = surge_run["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        m = r["metrics"]
        assert m["lrstab/response_length"] == [pytest.approx(r["logged_mean"])], r["step"]
        surge = SURGE_STEP if r["step"] >= SURGE_STEP else None
        assert m["lrstab/surge_step"] == [surge or -1] and m["lrstab/decay_period"] == [PERIOD if surge else -1]
        # verl's actor/lr (MegatronEngine.lr_scheduler_step: param_groups[0]["lr"]) after update u
        assert m["lr"] == [pytest.approx(expected_lr(r["step"], surge), rel=1e-12)], r["step"]
        assert r["optimizer_lr"] == m["lr"][0]
    assert [r["metrics"]["lr"][0] for r in records] == [5e-4] + [1e-3] * 7 + [5e-4] * 4


def test_resume_in_a_fresh_process_continues_exactly(model_dir, work_dir, surge_run):
    assert "optimizer/dist_ckpt/common.pt" in surge_run["checkpoint_files"]
    resumed = run(model_dir, work_dir, "resumed", "--first", str(SAVE_AT + 1), "--steps", str(STEPS),
                  "--resume-from", surge_run["ckpt"])
    assert resumed["resumed_lr"] == surge_run["records"][SAVE_AT - 1]["optimizer_lr"]
    tail = surge_run["records"][SAVE_AT:]
    for a, b in zip(tail, resumed["records"], strict=True):
        assert a["step"] == b["step"]
        assert a["metrics"] == b["metrics"], a["step"]  # lr, lrstab/*, loss: bit for bit
        assert json.dumps(a["scheduler_state"], sort_keys=True) == json.dumps(b["scheduler_state"], sort_keys=True)


def test_a_guard_rollback_on_megatron_keeps_the_lr_rule_under_verls_defaults(model_dir, work_dir, surge_run):
    # lrstab guard's resume: verl's checkpoint, its overrides (decay from the checkpoint's step, every 3), and
    # verl's YAML default use_checkpoint_opt_param_scheduler=false left as it is (length_surge turns it on)
    rolled = run(model_dir, work_dir, "rollback", "--first", str(SAVE_AT + 1), "--steps", str(STEPS),
                 "--resume-from", surge_run["ckpt"], "--option", f"decay_from_step={SAVE_AT}",
                 "--option", "decay_period=3")
    assert rolled["describe"]["use_checkpoint_opt_param_scheduler"] is True
    lr0 = 1e-3  # the rule written out: the first halving on update SAVE_AT + 1, one more every 3, floor 0.3
    assert rolled["resumed_lr"] == pytest.approx(0.5 * lr0, rel=1e-12)  # in force on the first update after it
    logged = [r["metrics"]["lr"][0] for r in rolled["records"]]  # the LR of the next update, after 9..12
    assert logged == [pytest.approx(x * lr0, rel=1e-12) for x in (0.5, 0.5, 0.3, 0.3)], logged
    assert [r["step"] for r in rolled["records"]] == list(range(SAVE_AT + 1, STEPS + 1))


def test_constant_megatron_run_is_stock(model_dir, work_dir):
    stock = run(model_dir, work_dir, "constant", "--scheduler", "constant", "--steps", "4")
    d = stock["describe"]
    assert d["scheduler_class"] == "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler"
    assert d["use_checkpoint_opt_param_scheduler"] is False  # verl's default, untouched
    assert [r["metrics"]["lr"][0] for r in stock["records"]] == [5e-4, 1e-3, 1e-3, 1e-3]
    assert not any(k.startswith("lrstab/") for r in stock["records"] for k in r["metrics"])
