"""Run verl's real ``python -m verl.trainer.main_ppo`` on CPU under a hard timeout.

Used by ``scripts/demo.py`` and the end-to-end tests. Two misconfigurations of
verl on CPU hang instead of failing (Ray waiting for resources it will never get,
TransferQueue start-up), so every run is a subprocess in its own process group
that is killed, Ray children included, when the deadline passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from verl_lrstab.runs import read_metrics  # noqa: F401  (here since the CPU launcher came first)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"


#: verl's one-step-off-policy trainer on configs/cpu_demo.yaml: what verl's one_step_off_ppo_trainer.yaml adds to
#: ppo_trainer (a rollout pool of its own, weights kept in place between syncs), with the CPU backend's gloo
#: checkpoint engine for the weight sync between the pools (verl ships nccl there) and a fake GPU slot per pool.
#: (cpu_demo.yaml sets hydra.searchpath, so it can only be the primary config: these travel as overrides.)
ONE_STEP_OFF_MODULE = "verl.experimental.one_step_off_policy.main_ppo"
ONE_STEP_OFF = [
    "+rollout.nnodes=1", "+rollout.n_gpus_per_node=1",
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "trainer.use_v1=false",  # the one-step-off trainer is V0-shaped (DataProto batches)
    "ray_kwargs.ray_init.num_cpus=16",  # OneStepTaskRunner asks for 10 CPU slots
    "ray_kwargs.ray_init.num_gpus=2",
]


#: verl's fully-async trainer (a FullyAsyncTrainer and a FullyAsyncRollouter, Ray actors, fed through a message
#: queue) on configs/cpu_demo.yaml: what verl's fully_async_ppo_trainer.yaml adds to ppo_trainer, the gloo engine for
#: the weight sync, 4 prompts a trainer step (16 samples), one update a sync cycle; ``+rollout.total_rollout_steps``
#: (prompts) sets the run's length. The trainer and the rollouter ask for 10 CPU slots each.
FULLY_ASYNC_MODULE = "verl.experimental.fully_async_policy.fully_async_main"
FULLY_ASYNC = [
    "+rollout.nnodes=1", "+rollout.n_gpus_per_node=1", "+rollout.n=4",
    "data.train_batch_size=0", "+data.gen_batch_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    # a trainer step's 16 samples must divide into micro-batches (cpu_demo's are 32)
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.hybrid_engine=false",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
    "trainer.use_v1=false",
    "+async_training.staleness_threshold=1", "+async_training.trigger_parameter_sync_step=1",
    "+async_training.require_batches=1", "+async_training.partial_rollout=true",
    "+async_training.use_trainer_do_validate=false", "+async_training.use_dynamic_resource_scheduling=false",
    "+async_training.dynamic_schedule_policy=default", "+async_training.dynamic_schedule_deactivate_ratio=0.3",
    "+async_training.dynamic_schedule_enable_rebalance=true", "+async_training.concurrent_samples_per_replica=16",
    "ray_kwargs.ray_init.num_cpus=32",
    "ray_kwargs.ray_init.num_gpus=2",
]


def cpu_env(assets_dir: os.PathLike, metrics_path: os.PathLike, run_dir: os.PathLike, extra: Optional[dict] = None):
    """Environment for a CPU run: opt into the CPU platform and load the backend in every process.

    Args:
        assets_dir: the tiny assets (``LRSTAB_ASSETS``).
        metrics_path: where verl's ``file`` logger writes (``VERL_FILE_LOGGER_PATH``).
        run_dir: checkpoints go to ``<run_dir>/checkpoints`` (``LRSTAB_RUN_DIR``, used by the configs).
        extra: more variables (override the above).

    Returns:
        A copy of ``os.environ`` with the variables set.
    """
    env = dict(os.environ)
    env.update(
        {
            "VERL_PLATFORM": "cpu",
            "VERL_USE_EXTERNAL_MODULES": "verl_lrstab_cpu",
            "LRSTAB_ASSETS": str(Path(assets_dir).resolve()),
            "VERL_FILE_LOGGER_PATH": str(Path(metrics_path).resolve()),
            "LRSTAB_RUN_DIR": str(Path(run_dir).resolve()),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def print_new_steps(total: int, describe: Callable[[dict], str]) -> Callable[[dict], None]:
    """An ``on_progress`` for :func:`run_main_ppo`: one line per step not shown yet.

    Args:
        total: the run's step count, shown as ``step k/total``.
        describe: the rest of the line, from that step's logged metrics.
    """
    shown, start = [0], time.monotonic()

    def show(metrics: dict) -> None:
        for step in sorted(s for s in metrics if s > shown[0]):
            print(f"[{time.monotonic() - start:5.0f}s] step {step:3d}/{total}{describe(metrics[step])}", flush=True)
            shown[0] = step

    return show


@dataclass
class RunResult:
    """Outcome of one ``main_ppo`` run."""

    returncode: int
    wall_s: float
    metrics_path: Path
    log_path: Path
    timed_out: bool = False
    metrics: dict = field(default_factory=dict)

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check(self) -> "RunResult":
        """Raise with the end of the log if the run failed or timed out."""
        if self.timed_out or self.returncode != 0:
            why = "timed out" if self.timed_out else f"exited with {self.returncode}"
            raise RuntimeError(f"main_ppo {why} after {self.wall_s:.0f}s; log {self.log_path}:\n{self.log_tail()}")
        return self


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def run_main_ppo(
    run_dir: os.PathLike,
    overrides: Sequence[str] = (),
    *,
    assets_dir: os.PathLike,
    config_name: str = "cpu_demo",
    config_dir: os.PathLike = CONFIG_DIR,
    metrics_name: str = "metrics.jsonl",
    timeout_s: float = 600,
    env: Optional[dict] = None,
    on_progress: Optional[Callable[[dict[int, dict]], None]] = None,
    poll_s: float = 1.0,
    module: str = "verl.trainer.main_ppo",
) -> RunResult:
    """Run ``python -m verl.trainer.main_ppo --config-path <config_dir> --config-name <config_name> ...``.

    Args:
        run_dir: working directory; holds the log, the metrics and the checkpoints.
        overrides: Hydra overrides.
        assets_dir: the tiny assets directory.
        config_name: the config in ``config_dir``.
        config_dir: absolute config directory (default: this repository's ``configs/``).
        metrics_name: file-logger output under ``run_dir`` (verl opens it with "wb": use a new
            name for each segment of a resumed run).
        timeout_s: hard limit; the process group is killed when it passes.
        env: extra environment variables.
        on_progress: called with the metrics read so far, every ``poll_s`` seconds while it runs.
        poll_s: progress polling period.
        module: verl's entry point (``verl.experimental.one_step_off_policy.main_ppo``,
            ``verl.experimental.fully_async_policy.fully_async_main`` run other trainers).

    Returns:
        :class:`RunResult` (call ``.check()`` to raise on failure).
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, log_path = run_dir / metrics_name, run_dir / (Path(metrics_name).stem + ".log")
    if metrics_path.exists():
        metrics_path.unlink()
    cmd = [
        sys.executable, "-m", module,
        "--config-path", str(Path(config_dir).resolve()), "--config-name", config_name,
        f"hydra.run.dir={run_dir / 'hydra'}",
        *overrides,
    ]  # fmt: skip
    full_env = cpu_env(assets_dir, metrics_path, run_dir, env)
    start = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=run_dir, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                try:
                    proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    if on_progress is not None:
                        on_progress(read_metrics(metrics_path))
                    if time.monotonic() - start > timeout_s:
                        timed_out = True
                        _kill_group(proc)
                        break
        except BaseException:
            _kill_group(proc)
            raise
        # Ray daemons of this run share the process group: make sure none outlives it.
        if proc.returncode is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    metrics = read_metrics(metrics_path)
    if on_progress is not None:
        on_progress(metrics)
    return RunResult(
        returncode=proc.returncode if proc.returncode is not None else -9,
        wall_s=time.monotonic() - start,
        metrics_path=metrics_path,
        log_path=log_path,
        timed_out=timed_out,
        metrics=metrics,
    )
