"""verl's real actor worker on CPU (FSDP2 engine, ppo_loss, FSDPCheckpointManager) with our scheduler.

Each scenario runs ``tests/engine_harness.py`` in fresh processes (gloo, no Ray); see
that file for what is real and what is made up. The scenario: lr 1e-3, warmup 2, the
last rank's responses triple from update 7, small detector windows (surge seen at
update 8), period factor 1.25 (P = 10), halving, floor 0.3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import engine_harness as h  # noqa: E402

HARNESS = Path(__file__).parent / "engine_harness.py"
STEPS = 20
SURGE_STEP = 8  # two long batches in a row (patience 2) after the onset at update 7
PERIOD = 10  # round(1.25 * 8)
SAVE_AT = SURGE_STEP  # the surge is in the checkpoint, the first decay (update 10) is not yet applied
PROCESS_TIMEOUT = 240  # seconds; one process takes ~10 s alone on 2 cores

pytestmark = pytest.mark.timeout(600)


# -- running the harness ------------------------------------------------------------------------------
def run_jobs(model_dir, out_dir: Path, jobs: dict) -> dict:
    """Run harness jobs at the same time; return ``{name: [rank 0 JSON, rank 1 JSON, ...]}``.

    Args:
        jobs: ``{name: (harness args, world_size, extra env or None)}``.
    """
    procs = []  # (name, rank, process, out, log)
    for name, (args, world_size, env) in jobs.items():
        port = str(h.free_port())
        for rank in range(world_size):
            out, log = out_dir / f"{name}_rank{rank}.json", out_dir / f"{name}_rank{rank}.log"
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            cmd = [sys.executable, str(HARNESS), "--model", str(model_dir), "--out", str(out), *args]
            with open(log, "w") as log_file:
                proc = subprocess.Popen(cmd, env=rank_env, stdout=log_file, stderr=subprocess.STDOUT)
            procs.append((name, rank, proc, out, log))
    # A rank that dies leaves its peers blocked in a collective: then stop everything at once.
    deadline = time.monotonic() + PROCESS_TIMEOUT
    while any(p.poll() is None for _, _, p, _, _ in procs):
        if any(p.returncode not in (None, 0) for _, _, p, _, _ in procs) or time.monotonic() > deadline:
            for _, _, p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    results = {}
    for name, rank, proc, out, log in procs:
        proc.wait()
        if proc.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-40:])
            pytest.fail(f"{name} rank {rank} exited with {proc.returncode} (log {log}):\n{tail}")
        results.setdefault(name, []).append(json.loads(out.read_text()))
    return results


def run_one(model_dir, out_dir: Path, name: str, *args: str) -> dict:
    """One single-rank harness job; its JSON."""
    return run_jobs(model_dir, out_dir, {name: (args, 1, None)})[name][0]


def canonical(state) -> str:
    """A state_dict as text (NaN-safe equality)."""
    return json.dumps(state, sort_keys=True)


def expected_lr(step: int, surge_step: int | None) -> float:
    """The LR logged after update ``step`` (the next update's), from the paper's rule written out.

    ``lr0 * warmup * max(floor, gamma ** ((step + 1) // P))`` once the surge has been seen.
    """
    warmup = min(1.0, step / h.WARMUP_STEPS)
    decay = 1.0
    if surge_step is not None and step >= surge_step:
        period = round(h.SURGE_OPTIONS["period_factor"] * surge_step)
        decay = max(h.SURGE_OPTIONS["min_lr_ratio"], h.SURGE_OPTIONS["gamma"] ** ((step + 1) // period))
    return h.LR * warmup * decay


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return h.build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_runs")


@pytest.fixture(scope="module")
def surge_run(model_dir, work_dir):
    """An uninterrupted run of STEPS updates with ``lr_scheduler_type=length_surge``.

    It saves a checkpoint after update SAVE_AT on the way, as verl's trainer does; the tests
    below check its whole trajectory against the rule, so a save that disturbed it would show.
    """
    ckpt = work_dir / f"ckpt/global_step_{SAVE_AT}/actor"
    run = run_one(model_dir, work_dir, "surge", "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--ckpt", str(ckpt))
    run["ckpt"] = str(ckpt)
    return run


# -- 1. the engine holds LengthSurgeLR and feeds it what verl logs ------------------------------------
def test_verl_engine_builds_length_surge_lr_through_the_plugin(surge_run):
    head = surge_run["header"]
    assert head["is_fsdp_engine"] and head["strategy"] == "fsdp2", head
    assert head["scheduler_class"] == "verl_lrstab.scheduler.LengthSurgeLR", head
    assert "torch.optim.lr_scheduler.LRScheduler" in head["scheduler_mro"]
    assert head["optimizer_config_class"] == "LengthSurgeOptimizerConfig"
    # verl's own loss, as ActorRolloutRefWorker.init_model sets it
    assert (head["loss_fn_module"], head["loss_fn"]) == ("verl.workers.utils.losses", "ppo_loss")
    # the harness never imports the glue: verl's entry-point loading did
    assert head["plugin_loaded"] and head["worker_wrapped"] and head["engine_wrapped"]


def test_response_length_metric_is_verls_response_length_mean(surge_run):
    for rec in surge_run["records"]:
        m, lengths = rec["metrics"], rec["lengths"]
        assert m["lrstab/response_length"] == [pytest.approx(rec["logged_mean"])], rec["step"]
        assert rec["logged_mean"] == pytest.approx(sum(lengths) / len(lengths))
        # two optimizer steps per update, one scheduler step: the whole batch, not a mini-batch
        assert len(m["loss"]) == h.MINI_BATCHES and rec["scheduler_state"]["last_epoch"] == rec["step"]
        first_mini = lengths[: len(lengths) // h.MINI_BATCHES]
        assert m["lrstab/response_length"][0] != pytest.approx(sum(first_mini) / len(first_mini))


def test_lr_metric_is_the_optimizers_and_follows_the_schedule(surge_run):
    for rec in surge_run["records"]:
        m, step = rec["metrics"], rec["step"]
        assert m["lr"] == [rec["optimizer_lr"]] == rec["last_lr"], step
        assert m["lrstab/lr_scale"] == [pytest.approx(rec["optimizer_lr"] / h.LR, rel=1e-12)]
        surge = SURGE_STEP if step >= SURGE_STEP else None
        assert rec["optimizer_lr"] == pytest.approx(expected_lr(step, surge), rel=1e-12), step


def test_length_jump_provokes_a_surge_and_the_lr_decays(surge_run):
    by_step = {rec["step"]: rec for rec in surge_run["records"]}
    for step, rec in by_step.items():
        seen = step >= SURGE_STEP
        assert rec["metrics"]["lrstab/surge_step"] == [SURGE_STEP if seen else -1], step
        assert rec["metrics"]["lrstab/decay_period"] == [PERIOD if seen else -1], step
    lrs = {step: rec["optimizer_lr"] for step, rec in by_step.items()}
    # logged after update u = LR of update u + 1: halvings at updates 10 and 20, floor 0.3
    assert lrs[1] == pytest.approx(h.LR / 2)  # warmup
    assert lrs[SURGE_STEP] == pytest.approx(h.LR)  # seen, not yet applied
    assert lrs[PERIOD - 2] == pytest.approx(h.LR) and lrs[PERIOD - 1] == pytest.approx(h.LR / 2)
    assert lrs[2 * PERIOD - 2] == pytest.approx(h.LR / 2)
    assert lrs[2 * PERIOD - 1] == pytest.approx(h.LR * h.SURGE_OPTIONS["min_lr_ratio"])


# -- 2. FSDPCheckpointManager round trip -----------------------------------------------------------------
def test_checkpoint_resume_continues_the_exact_lr_trajectory(model_dir, work_dir, surge_run):
    # a fresh process and engine, loaded through verl's FSDPCheckpointManager
    resumed = run_one(model_dir, work_dir, "resume", "--first", str(SAVE_AT + 1), "--steps", str(STEPS),
                      "--resume-from", surge_run["ckpt"])
    reference = {rec["step"]: rec for rec in surge_run["records"]}

    # what verl wrote after update SAVE_AT: the scheduler's state_dict, surge included
    extra = surge_run["checkpoint"]
    assert extra["file"] == "extra_state_world_size_1_rank_0.pt"
    assert {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"} <= set(extra["files"])
    assert canonical(extra["lr_scheduler"]) == canonical(surge_run["saved_state"])
    assert canonical(surge_run["saved_state"]) == canonical(reference[SAVE_AT]["scheduler_state"])
    assert extra["lr_scheduler"]["schedule"]["trigger_step"] == SURGE_STEP
    assert extra["lr_scheduler"]["schedule"]["detector"]["surge_steps"] == [SURGE_STEP]
    assert extra["weights_only_ok"] is True, extra["weights_only_ok"]

    # same state after loading, then the same future
    assert resumed["header"]["scheduler_class"] == "verl_lrstab.scheduler.LengthSurgeLR"
    assert canonical(resumed["loaded_state"]) == canonical(surge_run["saved_state"])
    assert [rec["step"] for rec in resumed["records"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for rec in resumed["records"]:
        ref = reference[rec["step"]]
        assert rec["optimizer_lr"] == ref["optimizer_lr"] and rec["metrics"]["lr"] == ref["metrics"]["lr"], rec["step"]
        assert canonical(rec["scheduler_state"]) == canonical(ref["scheduler_state"]), rec["step"]
        assert rec["metrics"]["lrstab/surge_step"] == [SURGE_STEP]
        # model and optimizer came back too: the same losses (one process, one thread each)
        assert rec["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5, abs=1e-7), rec["step"]
    assert resumed["records"][-1]["optimizer_lr"] == pytest.approx(h.LR * h.SURGE_OPTIONS["min_lr_ratio"])


# -- 3. the stock scheduler is untouched ------------------------------------------------------------------
def test_constant_scheduler_runs_as_in_stock_verl(model_dir, work_dir):
    steps = ("--steps", "6", "--scheduler", "constant")
    runs = run_jobs(model_dir, work_dir, {"constant_plugin": (steps, 1, None),
                                          "constant_stock": ((*steps, "--no-plugin"), 1, None)})
    (ours,), (stock,) = runs["constant_plugin"], runs["constant_stock"]

    assert ours["header"]["plugin_loaded"] and ours["header"]["worker_wrapped"] and ours["header"]["engine_wrapped"]
    assert not (stock["header"]["plugin_loaded"] or stock["header"]["worker_wrapped"])
    assert stock["header"]["optimizer_config_class"] == "FSDPOptimizerConfig"
    for run in (ours, stock):
        assert run["header"]["scheduler_class"] == "torch.optim.lr_scheduler.LambdaLR"
    for a, b in zip(ours["records"], stock["records"], strict=True):
        assert not any(k.startswith("lrstab/") for k in a["metrics"]), a["metrics"]
        assert a["metrics"] == b["metrics"], a["step"]  # loss, grad_norm, lr: bit for bit
        assert canonical(a["scheduler_state"]) == canonical(b["scheduler_state"])
        assert a["optimizer_lr"] == pytest.approx(h.LR * min(1.0, a["step"] / h.WARMUP_STEPS), rel=1e-12)


# -- 4. two data-parallel ranks with different local batches ----------------------------------------------
def test_two_ranks_feed_the_global_mean_and_keep_identical_state(model_dir, work_dir):
    steps = 12
    runs = run_jobs(model_dir, work_dir, {"dp2": (("--steps", str(steps)), 2, None)})["dp2"]
    for rank, run in enumerate(runs):
        assert run["header"]["dp_size"] == 2 and run["header"]["dp_rank"] == rank
        assert run["header"]["scheduler_class"] == "verl_lrstab.scheduler.LengthSurgeLR"
    surge_steps = set()
    for r0, r1 in zip(runs[0]["records"], runs[1]["records"], strict=True):
        step = r0["step"]
        both = r0["lengths"] + r1["lengths"]
        global_mean = sum(both) / len(both)
        if step >= h.SURGE_ONSET:  # the local batches really differ
            assert r0["logged_mean"] != r1["logged_mean"]
        assert global_mean == pytest.approx((r0["logged_mean"] + r1["logged_mean"]) / 2)
        for rec in (r0, r1):
            assert rec["metrics"]["lrstab/response_length"] == [pytest.approx(global_mean)], step
        assert canonical(r0["scheduler_state"]) == canonical(r1["scheduler_state"]), step
        assert r0["metrics"]["lr"] == r1["metrics"]["lr"] == [r0["optimizer_lr"]] == [r1["optimizer_lr"]], step
        surge_steps.add(r0["metrics"]["lrstab/surge_step"][0])
    # rank 0's own batches never grow, so it sees the surge only through the global mean
    assert len({rec["logged_mean"] for rec in runs[0]["records"]}) == 1
    assert surge_steps == {-1, SURGE_STEP}
    assert runs[0]["records"][PERIOD - 2]["optimizer_lr"] == pytest.approx(h.LR / 2)  # after update 9


# -- 5. one rank's mismatch computation fails: every rank takes the same decision ----------------------
FAIL_AT = (3, 4)  # the last rank cannot compute its mismatch figures at these updates
MISMATCH_TRIGGER_STEP = 6  # skip 2, then patience 2 over valid steps 5, 6 (3 and 4 are skipped on BOTH ranks)


def test_one_rank_failing_its_mismatch_keeps_every_rank_on_one_lr(model_dir, work_dir):
    steps = 9
    args = ("--steps", str(steps), "--mismatch", "--fail-mismatch-at", ",".join(map(str, FAIL_AT)))
    runs = run_jobs(model_dir, work_dir, {"dp2_fail": (args, 2, None)})["dp2_fail"]
    for r0, r1 in zip(runs[0]["records"], runs[1]["records"], strict=True):
        step = r0["step"]
        assert canonical(r0["scheduler_state"]) == canonical(r1["scheduler_state"]), step
        assert r0["optimizer_lr"] == r1["optimizer_lr"] and r0["metrics"]["lr"] == r1["metrics"]["lr"], step
        for rec in (r0, r1):
            has_mismatch = "mismatch/k3" in rec["metrics"]
            assert has_mismatch == (step not in FAIL_AT), (step, rec["metrics"])
            expected_trigger = MISMATCH_TRIGGER_STEP if step >= MISMATCH_TRIGGER_STEP else -1
            assert rec["metrics"]["lrstab/trigger_step"] == [expected_trigger], step
        if step not in FAIL_AT:
            assert r0["metrics"]["mismatch/k3"] == r1["metrics"]["mismatch/k3"]
            assert r0["metrics"]["mismatch/k3"][0] > 1e-4  # a real mismatch, far above the 1e-9 budget
    period = round(1.25 * MISMATCH_TRIGGER_STEP + 1e-9)  # 7.5 -> 8 (half up)
    lrs = {rec["step"]: rec["optimizer_lr"] for rec in runs[0]["records"]}
    assert lrs[period - 2] == pytest.approx(h.LR) and lrs[period - 1] == pytest.approx(h.LR / 2)


# -- 6. several actor updates per trainer step (V1 separate_async) -----------------------------------------
# 2 updates per trainer step, 8 trainer steps; trainer-step means 4, 4, 4, 12, ...: the detector's
# windows count trainer steps, so it sees the jump at trainer step 7 (`replay` of the same means).
SURGE_STEP_PER_TRAINER_STEP = 7
def test_several_updates_per_trainer_step_feed_the_scheduler_once_per_trainer_step(model_dir, work_dir):
    from verl_lrstab.log_replay import replay

    k, updates = 2, 16
    run = run_one(model_dir, work_dir, "per_step2", "--steps", str(updates), "--updates-per-step", str(k))
    records = run["records"]
    trainer_means, scales = [], []
    for first, second in zip(records[0::2], records[1::2]):
        t = second["step"] // k
        # the LR holds within the trainer step; the scheduler has stepped once per trainer step
        assert first["scheduler_state"]["last_epoch"] == t - 1 and second["scheduler_state"]["last_epoch"] == t
        assert not any(key.startswith("lrstab/") for key in first["metrics"]), first["metrics"]
        both = first["lengths"] + second["lengths"]
        trainer_means.append(sum(both) / len(both))
        assert second["metrics"]["lrstab/response_length"] == [pytest.approx(trainer_means[-1])]
        scales.append(second["metrics"]["lrstab/lr_scale"][0])
        assert first["metrics"]["lr"] == [first["optimizer_lr"]]
    # warmup: verl resolved 2 updates = 1 trainer step (0 during trainer step 1, full from step 2)
    assert records[0]["optimizer_lr"] == 0.0 and records[1]["optimizer_lr"] == pytest.approx(h.LR)
    # `lrstab replay` over the trainer-step means (what verl logs as response_length/mean) decides the same
    steps = list(range(1, len(trainer_means) + 1))
    options = {**h.SURGE_OPTIONS}
    ref = replay(steps, trainer_means, options, warmup_steps=1)
    surge = [rec["metrics"]["lrstab/surge_step"][0] for rec in records[1::2]]
    assert ref.surge_step == SURGE_STEP_PER_TRAINER_STEP and surge[-1] == SURGE_STEP_PER_TRAINER_STEP
    assert ref.lr_scale[1:] == pytest.approx(scales[:-1], rel=1e-12)

    # verl's V1 trainer reduces each update's actor metrics, then its MetricsAggregator combines the
    # updates of a trainer step (weighted by samples): the logged integers come out exactly.
    from verl.trainer.ppo.v1.utils import MetricsAggregator
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    for first, second in zip(records[0::2], records[1::2]):
        aggregator = MetricsAggregator()
        for rec in (first, second):
            aggregator.add_step_metrics(reduce_metrics(rename_dict(dict(rec["metrics"]), "actor/")), sample_count=6)
        logged = aggregator.get_aggregated_metrics()
        for key in ("surge_step", "trigger_step", "decay_period", "skipped_steps"):
            assert logged[f"actor/lrstab/{key}"] == second["metrics"][f"lrstab/{key}"][0], (second["step"], key)
        # a float comes back as (v * w) / w: within one rounding
        assert logged["actor/lrstab/lr_scale"] == pytest.approx(second["metrics"]["lrstab/lr_scale"][0], rel=1e-15)
        assert logged["actor/lr"] == second["metrics"]["lr"][0]
