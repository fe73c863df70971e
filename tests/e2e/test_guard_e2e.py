"""End-to-end: ``lrstab guard`` around verl's real ``main_ppo`` on CPU (V1, the tiny model).

The CPU demo's reward pays for length, so the length surges (the default detector fires at
step 14-15 with configs/cpu_demo.yaml, measured): a provoked trouble. The guard must roll back
to the newest checkpoint at or before the onset (minus its margin), resume with verl's own
``resume_mode=resume_path`` and the LR decay started there, keep the abandoned segment, and
finish with a continuous trajectory; with ``--max-rollbacks 0`` it must stop with status 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl_lrstab_cpu.launch import CONFIG_DIR, REPO_ROOT, cpu_env
from verl_lrstab.runs import read_metrics

pytestmark = pytest.mark.e2e

STEPS, SAVE_FREQ, LR0, MARGIN = 20, 4, 5e-4, 2
# the run itself only watches (monitor_only): the LR stays constant until the guard starts the decay
RUN = ["trainer.use_v1=true", f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}",
       f"actor_rollout_ref.actor.optim.lr={LR0}", "++actor_rollout_ref.actor.optim.length_surge.monitor_only=true"]


def guard(tmp_path: Path, assets_dir: Path, *options: str, overrides=RUN, timeout=1500):
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    env = cpu_env(assets_dir, run_dir / "unused.jsonl", run_dir)
    cmd = [sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run_dir / "guard"), *options, "--",
           sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR), "--config-name",
           "cpu_demo", f"hydra.run.dir={run_dir / 'hydra'}", *overrides]
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=timeout)
    events = [json.loads(line) for line in (run_dir / "guard" / "lrstab_events.jsonl").read_text().splitlines()]
    return proc, events, run_dir


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, assets_dir):
    """``make demo-guard``'s own script in a small form, which is this module's run (V1, STEPS steps, saved every
    SAVE_FREQ, the demo config's LR = LR0, monitor_only): the demo users run is what CI checks."""
    run_dir = tmp_path_factory.mktemp("guard") / "run"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "demo_guard.py"), "--steps", str(STEPS),
           "--save-freq", str(SAVE_FREQ), "--out", str(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env={**os.environ, "LRSTAB_ASSETS": str(assets_dir)},
                          capture_output=True, text=True, timeout=1500)
    events_file = run_dir / "guard" / "lrstab_events.jsonl"
    assert events_file.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    return proc, events, run_dir


def test_the_demo_reports_the_rollback_and_draws_the_trajectory(guarded):
    proc, events, run_dir = guarded
    assert proc.returncode == 0, proc.stderr[-3000:]
    rb = next(e for e in events if e["event"] == "rollback")
    assert f"rollback at step {rb['step']}" in proc.stdout and "guard status 0" in proc.stdout
    # lrstab compare's figure of the final trajectory (the abandoned segment greyed, the rollback marked)
    assert [p for p in (run_dir / "guard" / "compare").glob("*.png") if p.stat().st_size > 10_000]


def test_the_guard_rolls_back_to_a_checkpoint_before_the_onset_and_finishes(guarded):
    proc, events, run_dir = guarded
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(run_dir / "guard")  # the run directory, last
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("rollback") == 1, kinds
    surge = next(e for e in events if e["event"] == "surge")
    rb = next(e for e in events if e["event"] == "rollback")
    assert rb["reason"] == "surge" and rb["onset_step"] == surge["onset_step"] <= surge["step"]
    # the newest checkpoint at or before onset - margin (verl saved every SAVE_FREQ steps)
    assert rb["checkpoint_step"] == max(s for s in range(SAVE_FREQ, STEPS + 1, SAVE_FREQ)
                                        if s <= rb["onset_step"] - MARGIN)
    # the calibrated period: the run's period_factor (configs/cpu_demo.yaml) x the surge step
    factor = OmegaConf.load(CONFIG_DIR / "cpu_demo.yaml").actor_rollout_ref.actor.optim.length_surge.period_factor
    assert rb["attempt"] == 1 and rb["decay_period"] == max(1, int(factor * surge["step"] + 0.5))
    # the abandoned segment is kept: its metrics (past the rollback point) and its later checkpoints
    abandoned = read_metrics(Path(rb["abandoned_metrics"]))
    assert max(abandoned) >= surge["step"] > rb["checkpoint_step"]
    kept = {p.name for p in Path(rb["abandoned_metrics"]).parent.glob("global_step_*")}
    assert kept == {f"global_step_{s}" for s in range(SAVE_FREQ, max(abandoned) + 1, SAVE_FREQ) if s > rb["checkpoint_step"]}


def test_the_final_trajectory_is_continuous_and_follows_the_guards_rule(guarded):
    proc, events, _ = guarded
    rb = next(e for e in events if e["event"] == "rollback")
    done = events[-1]
    final = read_metrics(Path(done["metrics"]))
    assert sorted(final) == list(range(1, STEPS + 1))
    c, period = rb["checkpoint_step"], rb["decay_period"]
    abandoned = read_metrics(Path(rb["abandoned_metrics"]))
    for step in range(1, c + 1):  # before the rollback point: the first segment, as it ran
        assert final[step]["response_length/mean"] == abandoned[step]["response_length/mean"]
        assert final[step]["actor/lr"] == pytest.approx(LR0)
    for step in range(c + 1, STEPS + 1):
        # verl logs the LR after stepping: the LR of update step + 1; halved on the first update after
        # the checkpoint, then every `period` updates (the guard's rule), the checkpoint's state notwithstanding
        update = step + 1
        n = 1 + (update - c - 1) // period
        assert final[step]["actor/lr"] == pytest.approx(LR0 * max(0.1, 0.5**n)), step
        assert final[step]["actor/lrstab/rollbacks"] == 1
        assert final[step]["actor/lrstab/trigger_step"] == c


@pytest.mark.slow  # 87 s measured; make test-e2e runs it (CI keeps the rollback itself: the guarded fixture)
def test_max_rollbacks_is_respected(tmp_path, assets_dir):
    proc, events, _ = guard(tmp_path, assets_dir, "--max-rollbacks", "0")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert [e["event"] for e in events][-2:] == ["surge", "gave_up"]
    assert "after 0 rollback(s)" in proc.stderr


def test_a_save_freq_that_can_never_serve_is_refused_before_verl_starts(tmp_path, assets_dir):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "verl_lrstab.cli", "guard", "--", sys.executable, "-m", "verl.trainer.main_ppo",
           "--config-path", str(CONFIG_DIR), "--config-name", "cpu_demo", "trainer.save_freq=-1"]
    proc = subprocess.run(cmd, cwd=run_dir, env=cpu_env(assets_dir, run_dir / "m.jsonl", run_dir),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trainer.save_freq=-1" in proc.stderr
    assert not (run_dir / "checkpoints").exists()


def test_the_guarded_run_before_its_trouble_is_the_unguarded_run(guarded, main_ppo):
    # Until the trouble the guard only watches: the demo's first segment (monitor_only, saved every
    # SAVE_FREQ steps, 20 planned) is bit for bit test_main_ppo_cpu's unguarded 5-step V1 run on those
    # steps (cpu_demo.yaml samples with per-request seeds; checkpoints change nothing). This pair is
    # also CI's check that two V1 runs are bit-identical. (The trouble-free guard's whole run, events
    # included: the slow test below; its events: tests/test_guard_supervisor.py's stand-in runs.)
    from test_main_ppo_cpu import SURGE, TRAINER, assert_bit_identical

    _, events, _ = guarded
    rb = next(e for e in events if e["event"] == "rollback")
    first_segment = read_metrics(Path(rb["abandoned_metrics"]))
    plain = main_ppo("short-v1", SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]).metrics
    # the first segment ran past step 5 unchanged: the guard acts only when it sees the trouble (step > 5)
    assert sorted(plain) == [1, 2, 3, 4, 5] and rb["step"] > 5 and set(plain) <= set(first_segment)
    assert_bit_identical({s: first_segment[s] for s in plain}, plain)


@pytest.mark.slow  # one guarded run more; CI keeps the bit-for-bit pair above (the demo's first segment)
def test_a_run_without_trouble_is_the_unguarded_run(tmp_path, assets_dir, main_ppo):
    # 5 steps, no surge yet (the detector needs its baseline first): the guard only watches, and
    # verl's run is bit for bit the run without it (cpu_demo.yaml samples with per-request seeds;
    # checkpoints change nothing). The unguarded twin is test_main_ppo_cpu's 5-step V1 run (shared).
    from test_main_ppo_cpu import SURGE, TRAINER, assert_bit_identical

    short = SURGE + TRAINER["v1"] + ["trainer.total_training_steps=5"]
    proc, events, _ = guard(tmp_path, assets_dir, overrides=short + ["trainer.save_freq=2"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [e["event"] for e in events] == ["start", "done"]
    guarded = read_metrics(Path(events[-1]["metrics"]))
    plain = main_ppo("short-v1", short).metrics
    assert sorted(plain) == [1, 2, 3, 4, 5]
    assert_bit_identical(guarded, plain)


@pytest.mark.slow
def test_killing_the_guard_stops_verl_and_loses_nothing(tmp_path, assets_dir, main_ppo):
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = cpu_env(assets_dir, run_dir / "unused.jsonl", run_dir)
    cmd = [sys.executable, "-m", "verl_lrstab.cli", "guard", "--run-dir", str(run_dir / "guard"), "--",
           sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR), "--config-name",
           "cpu_demo", f"hydra.run.dir={run_dir / 'hydra'}", *RUN]
    proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 900
    while not (latest.exists() and int(latest.read_text()) >= 2 * SAVE_FREQ) and time.monotonic() < deadline:
        time.sleep(2)
    # everything the guard started: verl's driver and Ray's local daemons (gcs_server, raylet, its workers),
    # found by descent, so another Ray cluster on the machine is not counted
    spawned = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(p.name() for p in spawned)
    assert "raylet" in names and "gcs_server" in names, names
    proc.send_signal(signal.SIGKILL)  # no handler runs: the watchdog must stop them
    assert proc.wait(timeout=120) != 0
    _, alive = psutil.wait_procs(spawned, timeout=60)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"outlived the guard: {[(p.pid, p.name()) for p in alive]}"
    leftover = subprocess.run(["pgrep", "-f", f"hydra.run.dir={run_dir / 'hydra'}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "verl outlived the guard"
    saved = int(latest.read_text())
    # resume by hand with verl's own resume: it continues from the guard's last checkpoint
    resumed = main_ppo("guard-killed-resumed", RUN + ["trainer.resume_mode=auto",
                                                      f"trainer.default_local_dir={run_dir / 'checkpoints'}"])
    assert min(resumed.metrics) == saved + 1 and max(resumed.metrics) == STEPS
    assert os.path.isdir(run_dir / "checkpoints" / f"global_step_{STEPS}")


CRASHING_REWARD = '''
"""The CPU demo's length reward, which after the guard's first rollback (its state file says attempt 1)
pays 0 from the 5th step of the process on: a provoked reward crash, the guard's second trouble."""
import json

from verl_lrstab_cpu.rewards import longer_is_better

CALLS = [0]
PER_STEP = {per_step}
STATE = {state!r}


def crash_after_rollback_1(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    CALLS[0] += 1
    try:
        attempt = json.load(open(STATE))["attempt"]
    except (OSError, ValueError, KeyError):
        attempt = 0
    if attempt == 1 and CALLS[0] > 4 * PER_STEP:
        return 0.0
    return longer_is_better(data_source, solution_str, ground_truth, extra_info, **kwargs)
'''


# three main_ppo launches: slow (400 s beside a real-model run). The crash is keyed on the guard's state
# file: keyed on the launch's VERL_FILE_LOGGER_PATH, no crash came (the guard finished with one rollback).
@pytest.mark.slow
def test_two_rollbacks_in_one_run_each_lowers_the_lr(tmp_path, assets_dir):
    """Rollback 1 on the demo's surge; in the resumed segment the reward falls to 0 (a provoked crash),
    rollback 2; the LR after each: x gamma of the LR in force at its checkpoint (verl's logged actor/lr)."""
    reward = tmp_path / "crash_reward.py"
    cfg = OmegaConf.load(CONFIG_DIR / "cpu_demo.yaml")
    per_step = int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
    # the reward reads the guard's state file (the environment of verl's reward worker is not the launch's)
    reward.write_text(CRASHING_REWARD.format(per_step=per_step, state=str(tmp_path / "run" / "guard" / "guard_state.json")))
    overrides = RUN + [f"reward.custom_reward_function.path={reward}",
                       "reward.custom_reward_function.name=crash_after_rollback_1"]
    proc, events, run_dir = guard(tmp_path, assets_dir, overrides=overrides, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = [e for e in events if e["event"] == "rollback"]
    assert first["reason"] == "surge" and second["reason"] == "reward_crash", events
    final = read_metrics(Path(events[-1]["metrics"]))
    assert sorted(final) == list(range(1, STEPS + 1))
    c1, c2 = first["checkpoint_step"], second["checkpoint_step"]

    def scale(update, rb):
        start, period = rb["decay_from_step"], rb["decay_period"]
        n = 0 if update <= start else 1 + (update - start - 1) // period
        return 1.0 if n == 0 else max(0.1, 0.5 ** n)

    # verl logs the LR after stepping: step s shows the LR of update s + 1
    for s in range(c1 + 1, c2):
        assert final[s]["actor/lr"] == pytest.approx(LR0 * scale(s + 1, first)), s
    for s in range(c2 + 1, STEPS + 1):
        assert final[s]["actor/lr"] == pytest.approx(LR0 * scale(s + 1, second)), s
    assert scale(c1 + 1, first) == 0.5  # rollback 1: x gamma of the undecayed LR at its checkpoint
    in_force = scale(c2, first) if c2 > c1 else 1.0  # the LR of update c2 in the kept trajectory
    assert scale(c2 + 1, second) <= 0.5 * in_force  # rollback 2 compounds
    assert scale(c2 + 1, second) < scale(c2 + 1, first)  # below the rule of the segment that crashed


# two main_ppo runs and a guarded one per trainer (~4 min each on 2 cores): slow. CI keeps the recorded
# lines of these runs (tests/standin/verl_logs/, read by the failed-load tests of tests/test_guard_faults.py and
# tests/test_guard.py).
@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["v1", "v0"])
def test_a_checkpoint_whose_model_shard_is_damaged_is_recognised_and_the_older_one_used(tmp_path, assets_dir,
                                                                                       trainer):
    from verl_lrstab_cpu.launch import run_main_ppo

    base = [f"trainer.use_v1={'true' if trainer == 'v1' else 'false'}", "trainer.save_freq=2",
            f"actor_rollout_ref.actor.optim.lr={LR0}", "++actor_rollout_ref.actor.optim.length_surge.monitor_only=true"]
    run_dir = tmp_path / "run"
    plain = run_main_ppo(run_dir, base + ["trainer.total_training_steps=4"], assets_dir=assets_dir,
                         metrics_name="plain.jsonl", timeout_s=900).check()
    assert sorted(plain.metrics) == [1, 2, 3, 4]
    ckpt = run_dir / "checkpoints"
    shard = next((ckpt / "global_step_4" / "actor").glob("model_world_size_*_rank_0.pt"))
    shard.write_bytes(b"damaged" * 10)  # a torch.load of it fails in verl's worker
    proc, events, _ = guard(tmp_path, assets_dir, overrides=base + ["trainer.total_training_steps=6",
                                                                    "trainer.resume_mode=auto"], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (failed,) = [e for e in events if e["event"] == "resume_failed"]
    assert failed["checkpoint_step"] == 4 and failed["next_checkpoint"] == 2
    log = Path(failed["log"]).read_text(errors="replace")
    # what the guard reads: the driver's Ray traceback through the trainer's _load_checkpoint (the lines
    # the trainer printed before the load come through Ray's log forwarding, which may lose them at exit)
    assert "in _load_checkpoint" in log and "UnpicklingError" in log and "Training Progress" not in log
    final = read_metrics(Path(events[-1]["metrics"]))
    assert sorted(final) == [3, 4, 5, 6]  # resumed from step 2
    # the damaged folder was moved aside before verl saved step 4 again: kept as it was, not overwritten
    moved = next(Path(e["moved"]["global_step_4"]) for e in events if e["event"] == "set_aside")
    assert next((moved / "actor").glob("model_world_size_*_rank_0.pt")).read_bytes() == b"damaged" * 10
    assert (ckpt / "global_step_6").is_dir()
