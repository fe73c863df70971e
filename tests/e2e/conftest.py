"""Fixtures for the end-to-end tests: verl's real ``main_ppo`` on CPU, each run under a hard timeout.

Runs are memoised per session (:func:`main_ppo`), so one run feeds several tests.
Assets are built once into ``$LRSTAB_ASSETS`` (default ``<repo>/.assets``).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from verl_lrstab_cpu.assets import build_assets
from verl_lrstab_cpu.launch import REPO_ROOT, RunResult, run_main_ppo

# Every run stops here at the latest; the tests' runs take 30-90 s on 2 cores.
RUN_TIMEOUT_S = float(os.environ.get("LRSTAB_E2E_TIMEOUT_S", 420))
WALL_TIMES: dict[str, float] = {}


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    root = Path(os.environ.get("LRSTAB_ASSETS", REPO_ROOT / ".assets"))
    return Path(build_assets(root)["root"])


@pytest.fixture(scope="session")
def main_ppo(tmp_path_factory, assets_dir):
    """``main_ppo(name, overrides, metrics_name=..., env=..., module=...)`` -> a checked :class:`RunResult`
    (``module``: verl's entry point, ``verl.trainer.main_ppo`` unless another trainer's).

    ``name`` is the run directory (checkpoints live there, so segments of one resumed run
    share it); a run already made with the same name and metrics file is returned as is.
    """
    root = tmp_path_factory.mktemp("e2e")
    cache: dict[tuple[str, str], RunResult] = {}

    def run(name: str, overrides, metrics_name: str = "metrics.jsonl", env=None,
            module: str = "verl.trainer.main_ppo") -> RunResult:
        key = (name, metrics_name)
        if key not in cache:
            result = run_main_ppo(
                root / name,
                list(overrides),
                assets_dir=assets_dir,
                metrics_name=metrics_name,
                timeout_s=RUN_TIMEOUT_S,
                env=env,
                module=module,
            )
            WALL_TIMES[f"{name}/{metrics_name}"] = result.wall_s
            cache[key] = result.check()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def main_ppo_raw(tmp_path_factory, assets_dir):
    """``main_ppo_raw(name, overrides, env=...)`` -> the :class:`RunResult` unchecked (runs meant to fail)."""
    root = tmp_path_factory.mktemp("e2e-raw")

    def run(name: str, overrides, env=None) -> RunResult:
        result = run_main_ppo(root / name, list(overrides), assets_dir=assets_dir, timeout_s=RUN_TIMEOUT_S, env=env)
        WALL_TIMES[f"{name} (raw)"] = result.wall_s
        return result

    return run


SITECUSTOMIZE = textwrap.dedent(r'''
    """Test-only start-up code of every process of an e2e run (driver, TaskRunner, workers)."""
    import json, os, sys

    MODE, WHERE = os.environ.get("LRSTAB_TEST_BREAK", ""), os.environ.get("LRSTAB_TEST_BREAK_WHERE", "all")
    PROBES = os.environ.get("LRSTAB_TEST_PROBES", "")
    IN_RAY = "default_worker.py" in " ".join(sys.argv)

    if PROBES:  # one record per process that installs the plugin's glue, written at that moment
        from verl_lrstab.glue.imports import when_imported

        def record(module):
            with open(os.path.join(PROBES, f"{os.getpid()}.json"), "w") as out:
                json.dump({"pid": os.getpid(), "ray": IN_RAY, "argv": " ".join(sys.argv)[:300]}, out)

        when_imported("verl_lrstab.glue.registry", record)

    RANK_PROBES = os.environ.get("LRSTAB_TEST_RANK_PROBES", "")
    if RANK_PROBES:  # after every scheduler step: this rank's LR and a hash of the scheduler's whole state
        from verl_lrstab.glue.imports import when_imported

        def probe_steps(module):
            import hashlib
            step = module.LengthSurgeLR.step

            def recorded_step(self, *args, **kwargs):
                step(self, *args, **kwargs)
                if self._held or self._is_initial:
                    return
                import torch.distributed as dist
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                state = json.dumps(self.state_dict(), sort_keys=True)
                record = {"rank": rank, "pid": os.getpid(), "update": self.last_epoch, "lr": self.get_last_lr()[0],
                          "state_sha1": hashlib.sha1(state.encode()).hexdigest()}
                with open(os.path.join(RANK_PROBES, f"lr_rank{rank}_{os.getpid()}.jsonl"), "a") as out:
                    out.write(json.dumps(record) + "\n")

            module.LengthSurgeLR.step = recorded_step

        when_imported("verl_lrstab.scheduler", probe_steps)

    if MODE and (WHERE == "all" or IN_RAY):
        if MODE == "driver_signature":
            from verl_lrstab.glue.imports import when_imported

            def rename_parameter(owner_name):
                def hook(module):
                    owner = getattr(module, owner_name)
                    verl_own = owner._update_actor
                    if owner_name == "PPOTrainer":
                        def _update_actor(self, data_batch, metrics):
                            return verl_own(self, data_batch, metrics)
                    else:
                        def _update_actor(self, data_batch):
                            return verl_own(self, data_batch)
                    owner._update_actor = _update_actor
                return hook

            # registered before verl loads the plugin: runs before the plugin's own hook
            when_imported("verl.trainer.ppo.v1.trainer_base", rename_parameter("PPOTrainer"))
            when_imported("verl.trainer.ppo.ray_trainer", rename_parameter("RayPPOTrainer"))
        elif MODE == "module_import":
            import importlib.abc

            class BrokenModule(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name == "verl_lrstab.cusum":
                        raise ImportError("simulated: verl_lrstab.cusum is broken")
                    return None

            sys.meta_path.insert(0, BrokenModule())
''')


@pytest.fixture(scope="session")
def sitecustomize(tmp_path_factory):
    """``sitecustomize(break_mode="", break_where="all", probes=None)`` -> env for :func:`main_ppo` / ``main_ppo_raw``.

    Puts :data:`SITECUSTOMIZE` on ``PYTHONPATH`` (Ray's processes inherit it): ``break_mode``
    ``driver_signature`` renames a parameter of ``_update_actor`` (V0 and V1; verl's calls still
    work), ``module_import`` makes ``verl_lrstab.cusum`` fail to import, in every process
    (``break_where="all"``) or in Ray's only (``"ray"``); ``probes`` (a directory) gets one JSON
    file per process that installed the plugin's glue; ``rank_probes`` one JSONL per rank: the LR
    and a hash of ``LengthSurgeLR``'s state after each of its steps.
    """
    directory = tmp_path_factory.mktemp("sitecustomize")
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def env(break_mode: str = "", break_where: str = "all", probes=None, rank_probes=None) -> dict:
        path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
        out = {"PYTHONPATH": path, "LRSTAB_TEST_BREAK": break_mode, "LRSTAB_TEST_BREAK_WHERE": break_where}
        if probes is not None:
            Path(probes).mkdir(parents=True, exist_ok=True)
            out["LRSTAB_TEST_PROBES"] = str(probes)
        if rank_probes is not None:
            Path(rank_probes).mkdir(parents=True, exist_ok=True)
            out["LRSTAB_TEST_RANK_PROBES"] = str(rank_probes)
        return out

    return env


def pytest_terminal_summary(terminalreporter):
    if WALL_TIMES:
        terminalreporter.write_sep("-", "main_ppo wall times (s)")
        for key, wall in WALL_TIMES.items():
            terminalreporter.write_line(f"{wall:7.1f}  {key}")
