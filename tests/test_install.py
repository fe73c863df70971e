"""Installing the wheel into an existing verl environment replaces nothing, and the plugin says whether it serves it.

The environment (``tests/install_env.py``) already holds a verl reporting ``0.10.0.dev0`` (this
environment's verl code under a version the package does not pin, as a build of verl's main
branch reports), with torch, transformers and verl's requirements. The product's wheel, built
from this checkout, is installed with pip (not editable) without an index. Then, in that
environment and with the checkout off the path: pip kept verl, torch and transformers; the
plugin warns at load that this verl is untested and that the checks decide; ``lrstab
check-verl`` finds every target and says it serves it; no string of the installed package names
a path the wheel does not ship; and once a target verl's code changes shape, ``length_surge`` is
refused where verl builds the actor's optimizer config (before any training), naming the target,
while a stock scheduler still builds. verl's real ``main_ppo`` on that broken verl:
``test_a_length_surge_run_on_a_verl_it_cannot_serve_fails_before_it_trains`` (``slow``).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
from pathlib import Path

import pytest

from install_env import FAKE_VERL_VERSION, build_wheel, make_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)
KEPT = ("verl", "torch", "transformers")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(env, before, pip_output)``: the environment after the wheel's install, and the versions before it."""
    root = tmp_path_factory.mktemp("install")
    env = make_env(root)
    before = env.versions(*KEPT, "verl-lrstab")
    wheel = build_wheel(ROOT, root / "dist")
    proc = env.run(env.python, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", wheel)
    return env, before, proc.stdout + proc.stderr


def test_the_environment_holds_a_verl_the_package_does_not_pin(installed):
    env, before, _ = installed
    assert before == {"verl": FAKE_VERL_VERSION, "torch": md.version("torch"),
                      "transformers": md.version("transformers"), "verl-lrstab": None}
    # the environment would catch a pin: pip, without an index, cannot satisfy one this verl misses
    proc = env.run(env.python, "-m", "pip", "install", "--no-index", "--dry-run", "--disable-pip-version-check",
                   "verl>=0.9,<0.10", check=False)
    assert proc.returncode != 0 and "verl" in proc.stderr, proc.stdout + proc.stderr


def test_installing_the_wheel_keeps_the_users_verl_torch_and_transformers(installed):
    env, before, pip_output = installed
    after = env.versions(*KEPT, "verl-lrstab")
    assert {k: after[k] for k in KEPT} == {k: before[k] for k in KEPT}, pip_output
    assert after["verl-lrstab"] == md.version("verl-lrstab")
    assert "Successfully installed verl-lrstab-" in pip_output and "Uninstalling" not in pip_output, pip_output
    # the wheel is imported, not the checkout; one version source
    proc = env.run(env.python, "-c", "import importlib.metadata as m, verl_lrstab; "
                   "print(verl_lrstab.__file__); print(verl_lrstab.__version__ == m.version('verl-lrstab'))")
    path, same = proc.stdout.split()
    assert Path(path).is_relative_to(env.site) and same == "True", proc.stdout


def test_the_plugin_says_at_load_that_this_verl_is_untested_and_the_checks_decide(installed):
    env, _, _ = installed
    proc = env.run(env.python, "-c", "import verl; print(verl.__version__)")
    assert proc.stdout.strip() == FAKE_VERL_VERSION
    assert f"verl {FAKE_VERL_VERSION} is not a release this package was tested on (verl 0.9.x)" in proc.stderr
    assert "`lrstab check-verl` runs every check now" in proc.stderr, proc.stderr


def test_lrstab_check_verl_serves_a_verl_whose_targets_match(installed):
    env, _, _ = installed
    proc = env.run(env.bin / "lrstab", "check-verl", check=False)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[0].startswith(f"note verl {FAKE_VERL_VERSION} is not a tested release"), lines[0]
    assert not [line for line in lines if line.startswith("FAIL")]
    assert any("TrainingWorker.train_mini_batch" in line and line.startswith("ok") for line in lines)
    if importlib.util.find_spec("megatron") is None:  # the view holds this environment's packages: no megatron-core
        assert lines[-1].startswith("verl-lrstab serves this verl only where it could check it: 1 check(s)"), lines[-1]
    else:
        assert lines[-1] == "verl-lrstab serves this verl: every check passed"
    # the installed console script and `python -m verl_lrstab` are one command
    helps = [env.run(*command, "--help").stdout for command in ([env.bin / "lrstab"], [env.python, "-m", "verl_lrstab"])]
    assert helps[0] == helps[1] and "check-verl" in helps[0]


# A path of the repository that the wheel does not ship, as a message could name it.
REPO_PATH = re.compile(r"(?<![\w.])(?:patches|scripts|configs|docs|tests|cpu_backend)/[\w./-]*|\bcheck_verl\.py\b"
                       r"|\bmake (?:install|demo|test|gpu-check|bench|repro)\b|\bverl_lrstab_cpu\b")


def shipped_strings(package: Path):
    """``(file, line, text)`` of every string constant of the installed package's code, docstrings left out."""
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                yield path.relative_to(package.parent), node.lineno, node.value


def test_no_installed_string_names_a_path_the_wheel_does_not_ship(installed):
    env, _, _ = installed
    strings = list(shipped_strings(env.site / "verl_lrstab"))
    assert len(strings) > 500, "the scan found the installed package's strings"
    assert any("lrstab check-verl" in text for _, _, text in strings), "the messages name the command"
    found = [f"{path}:{line}: {text!r}" for path, line, text in strings if REPO_PATH.search(text)]
    assert not found, "messages naming what the wheel does not ship:\n" + "\n".join(found)


def test_the_scan_catches_a_repository_path():
    caught = ("run `python patches/check_verl.py`", "see docs/integration.md#trainers", "make install-vllm",
              "scripts/research/repro/README.md", "verl_lrstab_cpu.real_model")
    passed = ("lrstab check-verl", "verl.workers.config", "actor_rollout_ref.actor.optim.length_surge",
              "a/b", "response_length/mean", "actor/lrstab/trigger_step")
    assert all(REPO_PATH.search(text) for text in caught) and not any(REPO_PATH.search(t) for t in passed)


def break_train_mini_batch(env) -> None:
    """Give the verl copy's ``TrainingWorker.train_mini_batch`` a new required parameter (a reshaped target)."""
    path = env.verl_file("workers/engine_workers.py")
    shutil.copy2(path, path.with_suffix(".py.orig"))
    text = path.read_text()
    old = "def train_mini_batch(self, data: TensorDict) -> TensorDict:"
    assert text.count(old) == 1, "verl's train_mini_batch changed: update this test's sabotage"
    path.write_text(text.replace(old, "def train_mini_batch(self, data: TensorDict, new_required) -> TensorDict:"))


def restore_train_mini_batch(env) -> None:
    path = env.verl_file("workers/engine_workers.py")
    os.replace(path.with_suffix(".py.orig"), path)


@pytest.fixture
def broken_verl(installed):
    env = installed[0]
    break_train_mini_batch(env)
    try:
        yield env
    finally:
        restore_train_mini_batch(env)


BUILD_CONFIGS = """
from verl.workers.config import FSDPOptimizerConfig
print("stock", FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="cosine").lr_scheduler_type, flush=True)
FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge")
print("length_surge built")
"""


def test_a_verl_it_cannot_serve_refuses_length_surge_where_verl_builds_the_config(broken_verl):
    env = broken_verl
    check = env.run(env.bin / "lrstab", "check-verl", check=False)
    assert check.returncode == 1, check.stdout
    assert [line for line in check.stdout.splitlines() if line.startswith("FAIL")] == [
        "FAIL verl.workers.engine_workers.TrainingWorker.train_mini_batch('self', 'data') "
        "(verl has (self, data: tensordict._td.TensorDict, new_required) -> tensordict._td.TensorDict)"], check.stdout
    assert "verl-lrstab cannot serve this verl: 1 check(s) failed" in check.stdout

    proc = env.run(env.python, "-c", BUILD_CONFIGS, check=False)
    assert proc.returncode != 0 and "stock cosine" in proc.stdout and "length_surge built" not in proc.stdout
    assert "GlueUnavailable" in proc.stderr and "TrainingWorker.train_mini_batch" in proc.stderr, proc.stderr
    assert "`lrstab check-verl` lists what in this verl no longer matches" in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.slow  # CI's form: the config refusal above, where main_ppo builds the actor's config
def test_a_length_surge_run_on_a_verl_it_cannot_serve_fails_before_it_trains(broken_verl, tmp_path):
    from verl_lrstab_cpu.assets import build_assets
    from verl_lrstab_cpu.launch import CONFIG_DIR, cpu_env, read_metrics

    env = broken_verl
    assets = build_assets(Path(os.environ.get("LRSTAB_ASSETS", ROOT / ".assets")))["root"]
    metrics = tmp_path / "metrics.jsonl"
    run_env = cpu_env(assets, metrics, tmp_path, {"PYTHONPATH": str(ROOT / "cpu_backend")})
    proc = env.run(env.python, "-m", "verl.trainer.main_ppo", "--config-path", CONFIG_DIR, "--config-name",
                   "cpu_demo", f"hydra.run.dir={tmp_path / 'hydra'}", "trainer.total_training_steps=2",
                   check=False, timeout=600, env={k: v for k, v in run_env.items() if k != "VIRTUAL_ENV"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "GlueUnavailable" in output and "TrainingWorker.train_mini_batch" in output, output[-3000:]
    assert not read_metrics(metrics), "a step was trained"
