"""The runtime wraps of patches/README.md still apply to the installed verl."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("check_verl", Path(__file__).parents[1] / "patches" / "check_verl.py")
check_verl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_verl)


@pytest.mark.parametrize("name,ok,detail", list(check_verl.checks()), ids=lambda v: v if isinstance(v, str) else "")
def test_verl_target_has_expected_shape(name, ok, detail):
    assert ok, f"{name}: {detail}"


def test_wrappers_are_installed_by_the_plugin():
    from verl.workers import engine_workers
    from verl.workers.config import FSDPOptimizerConfig
    from verl.workers.engine.fsdp import transformer_impl

    assert FSDPOptimizerConfig.__name__ == "LengthSurgeOptimizerConfig"
    assert transformer_impl.FSDPEngine._build_lr_scheduler._lrstab_wrapped
    assert engine_workers.TrainingWorker.train_mini_batch._lrstab_wrapped
