"""Fixtures for the end-to-end tests: verl's real ``main_ppo`` on CPU, each run under a hard timeout.

Runs are memoised per session (:func:`main_ppo`), so one run feeds several tests.
Assets are built once into ``$LRSTAB_ASSETS`` (default ``<repo>/.assets``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from verl_lrstab.cpu.assets import build_assets
from verl_lrstab.cpu.launch import REPO_ROOT, RunResult, run_main_ppo

# Every run stops here at the latest; the tests' runs take 30-90 s on 2 cores.
RUN_TIMEOUT_S = float(os.environ.get("LRSTAB_E2E_TIMEOUT_S", 420))
WALL_TIMES: dict[str, float] = {}


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    root = Path(os.environ.get("LRSTAB_ASSETS", REPO_ROOT / ".assets"))
    return Path(build_assets(root)["root"])


@pytest.fixture(scope="session")
def main_ppo(tmp_path_factory, assets_dir):
    """``main_ppo(name, overrides, metrics_name=..., env=...)`` -> a checked :class:`RunResult`.

    ``name`` is the run directory (checkpoints live there, so segments of one resumed run
    share it); a run already made with the same name and metrics file is returned as is.
    """
    root = tmp_path_factory.mktemp("e2e")
    cache: dict[tuple[str, str], RunResult] = {}

    def run(name: str, overrides, metrics_name: str = "metrics.jsonl", env=None) -> RunResult:
        key = (name, metrics_name)
        if key not in cache:
            result = run_main_ppo(
                root / name,
                list(overrides),
                assets_dir=assets_dir,
                metrics_name=metrics_name,
                timeout_s=RUN_TIMEOUT_S,
                env=env,
            )
            WALL_TIMES[f"{name}/{metrics_name}"] = result.wall_s
            cache[key] = result.check()
        return cache[key]

    return run


def pytest_terminal_summary(terminalreporter):
    if WALL_TIMES:
        terminalreporter.write_sep("-", "main_ppo wall times (s)")
        for key, wall in WALL_TIMES.items():
            terminalreporter.write_line(f"{wall:7.1f}  {key}")
