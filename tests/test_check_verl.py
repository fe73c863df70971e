"""``lrstab check-verl``'s verdict, and the run-time refusal behind a check that could not run.

A runtime extra of verl (uvicorn, cachetools, TransferQueue, megatron-core: verl imports them without
requiring them) is made missing in a fresh interpreter by ``sys.modules[name] = None``, the way
Python itself marks a module that must not import. Then: ``check-verl`` names each check it skipped
with the reason, counts it, and never says "every check passed"; and a ``length_surge`` run whose
wraps sit in a module that cannot import is refused before it trains, naming the missing module.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap

import pytest

from verl_lrstab.cli.check_verl import verdict

pytestmark = pytest.mark.timeout(300)

#: What verl 0.9.1's main_ppo imports without requiring (the Makefile's VERL line), and megatron-core.
EXTRAS = ("uvicorn", "cachetools", "transfer_queue", "megatron")
#: The checks that cannot run without them: V0's and V1's trainer, the worker's update, Megatron's engine.
NEEDED = ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._update_actor exists",
          "verl.trainer.ppo.v1.trainer_base.PPOTrainer._update_actor exists",
          "verl.workers.engine_workers.TrainingWorker.train_mini_batch exists",
          "verl.workers.engine.megatron.transformer_impl.MegatronEngine._build_lr_scheduler exists")


def python(code: str, missing=()) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where each module of ``missing`` does not import."""
    head = f"import sys\nfor _name in {tuple(missing)!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240)


CHECK_VERL = "from verl_lrstab.cli import main\nsys.exit(main(['check-verl']))\n"


def test_a_missing_runtime_extra_is_skipped_counted_named_and_never_called_a_pass():
    proc = python(CHECK_VERL, missing=EXTRAS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # nothing failed
    lines = proc.stdout.splitlines()
    skips = [line[len("skip "):] for line in lines if line.startswith("skip ")]
    for check in NEEDED:
        assert any(s.startswith(check + " (not checked: ") for s in skips), (check, skips)
    for extra in EXTRAS:
        assert any(re.search(rf"not checked: {extra}(\.\w+)* is not installed", s) for s in skips), (extra, skips)
    passed = sum(line.startswith("ok ") for line in lines)
    assert f"checks: {passed} passed, {len(skips)} skipped, 0 failed" in lines, lines[-20:]
    assert [line[len("skipped: "):] for line in lines if line.startswith("skipped: ")] == skips  # each, with its reason
    assert "every check passed" not in proc.stdout
    assert lines[-1].startswith("verl-lrstab serves this verl only where it could check it: "
                                f"{len(skips)} check(s) could not run"), lines[-1]
    assert "refused before it trains" in lines[-1]


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in EXTRAS),
                    reason="the all-present path needs every runtime extra (make install install-megatron)")
def test_with_every_extra_present_every_check_runs_and_passes():
    proc = python(CHECK_VERL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("skip", "FAIL"))], lines
    passed = sum(line.startswith("ok ") for line in lines)
    assert passed > 40 and lines[-2:] == [f"checks: {passed} passed, 0 skipped, 0 failed",
                                          "verl-lrstab serves this verl: every check passed"]


@pytest.mark.parametrize("results,last", [
    ([("a", True, ""), ("b", True, "")], "verl-lrstab serves this verl: every check passed"),
    ([("a", True, ""), ("b", None, "why")], "verl-lrstab serves this verl only where it could check it: 1 check(s)"),
    ([("a", False, "x"), ("b", None, "why")], "verl-lrstab cannot serve this verl: 1 check(s) failed"),
    ([("v", "note", "n"), ("a", True, "")], "verl-lrstab serves this verl: every check passed"),
])
def test_the_verdict_counts_each_kind_and_passes_only_when_nothing_was_skipped(results, last):
    lines = verdict(results)
    counts = [sum(ok is kind for _, ok, _ in results) for kind in (True, None, False)]
    assert lines[0] == "checks: {} passed, {} skipped, {} failed".format(*counts)
    assert lines[1:-1] == [f"skipped: {name} ({detail})" for name, ok, detail in results if ok is None]
    assert lines[-1].startswith(last), lines


# -- the run-time path: the same skip refuses a length_surge run before it trains ------------------------
REFUSAL = """
import json
import re
import verl  # loads the plugin through verl's entry point
from verl.workers.config import FSDPOptimizerConfig
from verl_lrstab.glue import registry

out = {"stock": FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="cosine").lr_scheduler_type}
def attempt(key, call):
    try:
        call()
        out[key] = "accepted"
    except Exception as exc:
        out[key] = f"{type(exc).__name__}: {exc}"
attempt("config", lambda: FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge"))
attempt("v0", lambda: registry.require("fsdp", "v0"))
attempt("v1", lambda: registry.require("fsdp", "v1"))
print("RESULT " + json.dumps(out))
"""


def refusal(missing) -> dict:
    proc = python(REFUSAL, missing=missing)
    (result,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")] or [None]
    assert result, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(result[len("RESULT "):])


def test_a_worker_module_that_needs_a_missing_package_refuses_length_surge_naming_it():
    # uvicorn: verl's engine_workers (the actor's update) does not import, so the wraps there cannot run
    out = refusal(["uvicorn"])
    assert out["stock"] == "cosine"  # stock schedulers are unaffected
    for key in ("config", "v0", "v1"):
        assert out[key].startswith("GlueUnavailable: actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge "
                                   "cannot be used"), out
        assert "verl.workers.engine_workers needs the module uvicorn, which is not installed here" in out[key], out


def test_a_trainer_module_that_needs_a_missing_package_refuses_that_trainers_runs_only():
    # TransferQueue: V1's trainer does not import; a V0 run does not need it, a V1 run is refused by the run's check
    out = refusal(["transfer_queue"])
    assert out["stock"] == "cosine" and out["config"] == "accepted" and out["v0"] == "accepted", out
    assert out["v1"].startswith("GlueUnavailable: ") and \
        "verl.trainer.ppo.v1.trainer_base needs the module transfer_queue, which is not installed here" in out["v1"], out


def test_every_extra_present_accepts_length_surge():
    out = refusal([])
    assert out == {"stock": "cosine", "config": "accepted", "v0": "accepted", "v1": "accepted"}, out
