"""A verl release that renames or reshapes a wrapped target must not break runs that do not use us.

Each case runs in a fresh interpreter: a post-import hook registered *before* ``import verl``
renames (or replaces) the target right after verl's module defines it, before the plugin's
own hook sees it. Then: the imports work, verl's stock optimizer config works, verl's
original is still in place, one ERROR names verl's version and the target, and a config
naming ``length_surge`` fails at config time with that cause.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from verl_lrstab.glue import failsafe, registry, wraps, worker

pytestmark = pytest.mark.timeout(300)

SCRIPT = r'''
import json, logging, sys
from verl_lrstab.glue.imports import when_imported

MODULE, OWNER, ATTR, MODE = {module!r}, {owner!r}, {attr!r}, {mode!r}

def sabotage(module):
    owner = module
    for part in (OWNER.split(".") if OWNER else []):
        owner = getattr(owner, part)
    original = getattr(owner, ATTR)
    if MODE == "rename":
        setattr(owner, ATTR + "_v2", original)
        delattr(owner, ATTR)
    else:  # a new required parameter
        def changed(self, data, new_required_arg):
            return original(self, data)
        setattr(owner, ATTR, changed)

when_imported(MODULE, sabotage)  # registered before verl's plugin: runs first

import verl  # loads the plugin through verl's entry point
import verl.workers.config
if ATTR != "FSDPOptimizerConfig":  # verl's own modules import that name: a real rename changes them too
    import verl.workers.engine.fsdp.transformer_impl as impl
    import verl.workers.engine_workers as workers
else:
    impl = workers = None
from verl.workers.config.optimizer import FSDPOptimizerConfig as VerlOwn
from verl.workers.config import optimizer as verl_optimizer

out = {{"imports": True}}
# verl's own optimizer-config classes are never patched after a failure (only when the glue itself is absent)
out["verl_classes_patched"] = [n for n, c in vars(verl_optimizer).items() if isinstance(c, type)
                               and getattr(c.__dict__.get("__init__"), "_lrstab_guard", False)]
out["stock_ok"] = VerlOwn(lr=1e-6, lr_scheduler_type="cosine").lr_scheduler_type == "cosine"
cls = getattr(verl.workers.config, "FSDPOptimizerConfig", VerlOwn)
out["stock_via_verl_name_ok"] = cls(lr=1e-6).lr_scheduler_type == "constant"
out["engine_wrapped"] = impl and getattr(getattr(impl.FSDPEngine, "_build_lr_scheduler", None), "_lrstab_original", None) is not None
out["worker_wrapped"] = workers and getattr(getattr(workers.TrainingWorker, "train_mini_batch", None), "_lrstab_original", None) is not None
for name, make in (("verl_name", lambda: cls(lr=1e-6, lr_scheduler_type="length_surge")),
                   ("verl_own", lambda: VerlOwn(lr=1e-6, lr_scheduler_type="length_surge"))):
    try:
        make()
        out[name] = "no error"
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
        out[name + "_is_runtime_error"] = isinstance(exc, RuntimeError)
print("RESULT " + json.dumps(out))
'''

CASES = {
    "rename train_mini_batch": ("verl.workers.engine_workers", "TrainingWorker", "train_mini_batch", "rename"),
    "rename _build_lr_scheduler": ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine", "_build_lr_scheduler",
                                   "rename"),
    "rename FSDPOptimizerConfig": ("verl.workers.config", None, "FSDPOptimizerConfig", "rename"),
    "signature of train_mini_batch": ("verl.workers.engine_workers", "TrainingWorker", "train_mini_batch",
                                      "signature"),
}
#: a refusal's target reshaped: that refusal is disabled with one ERROR, length_surge stays usable
REFUSAL_CASE = ("verl.workers.config.critic", "CriticConfig", "__post_init__", "signature")


def run_case(module, owner, attr, mode):
    code = SCRIPT.format(module=module, owner=owner, attr=attr, mode=mode)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"verl's import broke:\n{proc.stderr[-3000:]}"
    return json.loads(lines[0][len("RESULT "):]), proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_a_renamed_or_reshaped_target_leaves_verl_working_and_refuses_length_surge(case):
    module, owner, attr, mode = CASES[case]
    result, stderr = run_case(module, owner, attr, mode)
    target = ".".join(p for p in (module, owner, attr) if p)

    assert result["imports"] and result["stock_ok"] and result["stock_via_verl_name_ok"], result
    assert result["verl_classes_patched"] == [], result  # verl's own classes stay as verl wrote them
    # one loud error naming the target and verl's version
    errors = [line for line in stderr.splitlines() if "verl-lrstab: cannot use" in line]
    assert len(errors) == 1, stderr[-3000:]
    assert f"cannot use {target} with verl 0.9.1: " in errors[0], errors
    if attr == "FSDPOptimizerConfig":  # no class of ours in place: verl's own refuses the name (its assertion)
        assert result["verl_own"].startswith("AssertionError") and result["verl_name"].startswith("AssertionError")
        return
    # a length_surge config fails at config time with that cause, through either class name
    for name in ("verl_name", "verl_own"):
        message = result[name]
        assert message.startswith("GlueUnavailable: actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge "
                                  "cannot be used"), (name, message)
        assert result[name + "_is_runtime_error"], (name, message)
        assert target in message and "verl 0.9.1" in message, message
    # the targets that were not touched are still wrapped; the broken one is verl's own
    if attr == "train_mini_batch" and mode == "signature":
        assert result["engine_wrapped"] and not result["worker_wrapped"]
    if attr == "_build_lr_scheduler":
        assert result["worker_wrapped"] and not result["engine_wrapped"]


def test_a_refusal_that_cannot_be_installed_disables_that_refusal_not_length_surge():
    result, stderr = run_case(*REFUSAL_CASE)
    assert result["imports"] and result["stock_ok"], result
    errors = [line for line in stderr.splitlines() if "verl-lrstab: cannot" in line]
    assert len(errors) == 1, stderr[-3000:]
    assert ("cannot install the refusal of length_surge at verl.workers.config.critic.CriticConfig.__post_init__ "
            "with verl 0.9.1") in errors[0] and "critic.optim.lr_scheduler_type for the critic" in errors[0], errors
    assert result["verl_name"] == result["verl_own"] == "no error", result  # the FSDP actor still takes it
    assert result["verl_classes_patched"] == [], result


def test_untouched_verl_has_no_error_and_accepts_length_surge():
    code = "import verl, json\nfrom verl.workers.config import FSDPOptimizerConfig as C\n" \
           "print('RESULT', C(lr=1e-6, lr_scheduler_type='length_surge').lr_scheduler_type)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert "RESULT length_surge" in proc.stdout, proc.stderr[-2000:]
    assert "verl-lrstab: cannot use" not in proc.stderr


def test_a_plugin_that_cannot_even_load_its_failsafe_says_so_and_verl_runs():
    # a broken install: the one import the entry point makes before anything can be reported fails
    code = ("import sys; sys.modules['verl_lrstab.glue.failsafe'] = None\n"
            "import verl\nfrom verl.workers.config import FSDPOptimizerConfig as C\n"
            "print('RESULT', type(C(lr=1e-6, lr_scheduler_type='cosine')).__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert "RESULT verl.workers.config.optimizer" in proc.stdout, proc.stderr[-2000:]  # verl's own, untouched
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR verl-lrstab: the plugin cannot load")]
    assert len(errors) == 1 and "verl_lrstab.glue.failsafe" in errors[0], proc.stderr[-2000:]


def test_an_exception_inside_a_wrapper_factory_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(failsafe, "FAILURES", [])
    monkeypatch.setattr(failsafe, "_guard_armed", True)  # do not guard this test process's config classes

    class Target:
        def method(self, data):
            return "verl's"

    def broken_factory(original):
        raise ZeroDivisionError("inside our factory")

    wrap = wraps.Wrap("tests", "Target", "method", ("self", "data"), broken_factory)
    module = type(sys)("tests")
    module.Target = Target
    assert wraps.apply(wrap, module) is False
    assert Target().method(1) == "verl's"
    assert [t for t, _ in failsafe.FAILURES] == ["tests.Target.method"]
    with pytest.raises(failsafe.GlueUnavailable, match="tests.Target.method: ZeroDivisionError"):
        failsafe.check_usable()


def test_an_exception_in_an_import_hook_does_not_break_the_import(tmp_path, monkeypatch):
    from verl_lrstab.glue import imports

    (tmp_path / "lrstab_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    imports.when_imported("lrstab_probe_mod", lambda m: 1 / 0, on_error=lambda name, exc: seen.append((name, exc)))
    import lrstab_probe_mod

    assert lrstab_probe_mod.VALUE == 42
    assert seen and seen[0][0] == "lrstab_probe_mod" and isinstance(seen[0][1], ZeroDivisionError)


def test_wrappers_pass_new_verl_keywords_through():
    # a new optional verl parameter is accepted by the signature check and reaches verl's function
    class Worker:
        engine = None

        def train_mini_batch(self, data, new_flag=False):
            return ("verl's", data, new_flag)

    wrap = wraps.Wrap("m", "Worker", "train_mini_batch", ("self", "data"), worker.make_train_mini_batch)
    module = type(sys)("m")
    module.Worker = Worker
    assert wraps.apply(wrap, module)
    assert getattr(Worker.train_mini_batch, "_lrstab_original", None) is not None
    assert Worker().train_mini_batch("batch", new_flag=True) == ("verl's", "batch", True)
    assert Worker().train_mini_batch(data="batch") == ("verl's", "batch", False)


@pytest.mark.parametrize("wrap", registry.WRAPS, ids=lambda w: w.target)
def test_every_registered_wrap_is_fail_safe_when_its_target_is_gone(wrap, monkeypatch, caplog):
    # Each target of the registry, missing: apply() reports it and raises nothing; a refusal's only
    # disables that refusal (one ERROR), a required one refuses length_surge.
    monkeypatch.setattr(failsafe, "FAILURES", [])
    monkeypatch.setattr(failsafe, "_guard_armed", True)  # do not guard this test process's config classes
    module = type(sys)(wrap.module)
    if wrap.owner:  # the owner exists, the attribute does not
        owner = module
        for part in wrap.owner.split("."):
            setattr(owner, part, type(part, (), {}))
            owner = getattr(owner, part)
        if wrap.attribute.startswith("__"):  # every class has __init__/__post_init__ of some kind: not verl's
            setattr(owner, wrap.attribute, None)
    caplog.set_level(logging.ERROR, logger="verl_lrstab")
    assert wraps.apply(wrap, module) is False
    if not wrap.required:
        assert failsafe.FAILURES == []
        failsafe.check_usable()  # length_surge stays usable
        if wrap.fallback:  # an async trainer's run checks: its runs are refused at their first update
            assert caplog.text.count("is refused at its first actor update") == 1 and wrap.target in caplog.text
        else:
            assert caplog.text.count("cannot install the refusal") == 1 and wrap.target in caplog.text
        return
    assert [target for target, _ in failsafe.FAILURES] == [wrap.target]
    with pytest.raises(failsafe.GlueUnavailable, match="length_surge cannot be used"):
        failsafe.check_usable()
