"""The glue's guarantees on verl's real classes: stock runs reach verl's own code untouched,
and a ``length_surge`` run that cannot work is refused with the key to set, never trained at a
constant LR. The end-to-end forms (a real ``main_ppo``) are in ``tests/e2e/test_failsafe_e2e.py``.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from hydra import compose, initialize_config_module

import verl  # noqa: F401 - loads the plugin through verl's entry point
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import rollout_corr_helper
from verl.utils import tensordict_utils as tu
from verl.workers.config import optimizer as verl_optimizer
from verl.workers.utils.padding import left_right_2_no_padding

from verl_lrstab.glue import driver, steps, worker, wraps
from verl_lrstab.glue.steps import MAX_UNMEASURED_STEPS, STEP_POSITION_KEY, GlueError
from verl_lrstab.scheduler import LengthSurgeLR

OPTIM = "actor_rollout_ref.actor.optim"


def trainer_config(*overrides):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[f"{OPTIM}.lr_scheduler_type=length_surge", *overrides])


def require_nothing(engine, trainer=None):  # check_run's registry check, tested on its own in test_failsafe.py
    return None


# -- the run's checks (the trainers' __init__ wraps, in the TaskRunner) ------------------------------
@pytest.mark.parametrize("trigger", ["mismatch", "either"])
def test_mismatch_trigger_without_rollout_log_probs_is_refused_naming_the_key(trigger):
    config = trainer_config(f"+{OPTIM}.length_surge.trigger={trigger}",
                            "actor_rollout_ref.rollout.calculate_log_probs=false")
    with pytest.raises(GlueError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=true"):
        driver.check_run(config, require_nothing)


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_mismatch_trigger_in_an_async_mode_is_refused_with_the_reason(mode):
    config = trainer_config(f"+{OPTIM}.length_surge.trigger=mismatch", "actor_rollout_ref.rollout.calculate_log_probs=true",
                            "trainer.use_v1=true", f"trainer.v1.trainer_mode={mode}")
    with pytest.raises(GlueError, match=f"trainer_mode='{mode}'.*staleness"):
        driver.check_run(config, require_nothing)
    # the length trigger is fine there (the figures are logged, but never fed: see the worker tests)
    driver.check_run(trainer_config("trainer.use_v1=true", f"trainer.v1.trainer_mode={mode}"), require_nothing)


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_v1_trainer_init_runs_the_checks_before_verls_init(mode):
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    assert getattr(PPOTrainer.__init__, "_lrstab_original", None) is not None, "the glue wraps PPOTrainer.__init__"
    config = trainer_config(f"+{OPTIM}.length_surge.trigger=mismatch", "actor_rollout_ref.rollout.calculate_log_probs=false",
                            f"trainer.v1.trainer_mode={mode}")
    with pytest.raises(GlueError, match="calculate_log_probs"):
        get_trainer_cls(mode)(config=config)  # raised by the wrap: verl's own __init__ would need Ray and TransferQueue


def test_v0_trainer_init_runs_the_checks_before_verls_init():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    config = trainer_config(f"+{OPTIM}.length_surge.trigger=either", "actor_rollout_ref.rollout.calculate_log_probs=false")
    with pytest.raises(GlueError, match="calculate_log_probs"):
        RayPPOTrainer(config, None, {}, None)


# -- rollout correction: no pass, no stash on a run that does not need it ----------------------------
def rollout_batch():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 8, generator=gen)
    return DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": old + 0.05 * torch.randn(4, 8, generator=gen),
                                        "response_mask": torch.ones(4, 8, dtype=torch.int64)})


@pytest.mark.parametrize("length_surge_runs,rollout_rs,stashed", [
    (0, "token_k3", False),  # a stock run: verl's function only, whatever rollout_correction says
    (1, None, False),  # no rejection: the mask the worker gets is the whole one, nothing to carry
    (1, "token_k3", True),
])
def test_rollout_correction_measures_only_for_a_length_surge_run_with_rejection(request, monkeypatch, length_surge_runs,
                                                                                 rollout_rs, stashed):
    if length_surge_runs:
        request.getfixturevalue("length_surge_trainer")  # a live length_surge trainer in this process
    else:
        monkeypatch.setattr(driver, "_checked", weakref.WeakKeyDictionary())
    monkeypatch.setattr(driver._run, "pre_rs", None, raising=False)
    wrapped = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    assert getattr(wrapped, "_lrstab_original", None) is not None
    config = RolloutCorrectionConfig(rollout_is="token", rollout_rs=rollout_rs, rollout_rs_threshold=1e-3)
    ours_batch, ours = wrapped(rollout_batch(), config)
    verl_batch, verls = wrapped._lrstab_original(rollout_batch(), config)
    assert ours.keys() == verls.keys() and all(ours[k] == pytest.approx(verls[k]) for k in ours)
    assert torch.equal(ours_batch.batch["response_mask"], verl_batch.batch["response_mask"])
    assert (driver._pop_pre_rs_stats() is not None) == stashed


def test_a_predicate_that_fails_runs_verls_function_and_says_so(caplog):
    def verls(x):
        return f"verl's {x}"

    def broken_predicate(x):
        raise AttributeError("verl renamed something")

    wrapper = wraps.dispatch(verls, broken_predicate, lambda original, x: "ours")
    caplog.set_level(logging.ERROR, logger="verl_lrstab")
    assert wrapper(1) == "verl's 1" and wrapper(2) == "verl's 2"
    assert caplog.text.count("could not tell whether the run names length_surge") == 1


# -- the worker: the step tag, the unmeasurable length, the missing rollout log-probs -----------------
class Engine:
    """What the worker glue reads of verl's engine (a real ``LengthSurgeLR`` on a real optimizer)."""

    def __init__(self, options=None):
        self.lr_scheduler = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), options)

    def get_data_parallel_group(self):
        return None


class Worker:
    def __init__(self, options=None):
        self.engine = Engine(options)


def v0_batch(lengths=(3, 5), rollout=True, tag=(0, 1, 0), bypass=False):
    rows, width = len(lengths), 8
    response_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, 2, dtype=torch.int64), response_mask], 1)
    tensors = {"attention_mask": attention_mask, "input_ids": torch.randint(3, 50, (rows, 2 + width)),
               "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "prompts": torch.randint(3, 50, (rows, 2)),
               "responses": torch.randint(3, 50, (rows, width)),
               "response_mask": response_mask, "old_log_probs": -torch.ones(rows, width),
               "token_level_scores": torch.ones(rows, width) * response_mask}
    if rollout:  # bypass mode: verl's old_log_probs are the rollout's
        tensors["rollout_log_probs"] = tensors["old_log_probs"] - (0.0 if bypass else 0.01) * response_mask
    td = left_right_2_no_padding(DataProto.from_dict(tensors=tensors).to_tensordict())
    if tag is not None:
        tu.assign_non_tensor_data(td, STEP_POSITION_KEY, list(tag))
    return td


def run_update(w, data):
    """The glue's update with verl's work replaced by what verl's engine does at the end: step the scheduler."""

    def verls_update(self, data):
        self.engine.lr_scheduler.step()
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"lr": [1e-3]}})

    return worker._train_mini_batch(verls_update, w, data)


def test_a_batch_without_the_step_tag_is_an_error_not_a_guess():
    with pytest.raises(GlueError, match="no trainer-step tag"):
        run_update(Worker(), v0_batch(tag=None))


def test_mismatch_trigger_without_rollout_log_probs_fails_the_first_update():
    with pytest.raises(GlueError, match="calculate_log_probs=true"):
        run_update(Worker({"trigger": "mismatch"}), v0_batch(rollout=False))


def test_a_length_unmeasurable_for_n_steps_fails_the_run_and_an_empty_batch_does_not_count():
    w = Worker()
    unmeasurable = lambda: tu.get_tensordict({"foo": torch.zeros(2, 3)}, non_tensor_dict={STEP_POSITION_KEY: [0, 1, 0]})  # noqa: E731
    for _ in range(MAX_UNMEASURED_STEPS - 1):
        run_update(w, unmeasurable())
    run_update(w, v0_batch())  # a measured step resets the count
    assert w.engine.lr_scheduler.schedule.response_length == 4.0
    for _ in range(MAX_UNMEASURED_STEPS - 1):
        run_update(w, unmeasurable())
    with pytest.raises(GlueError, match=f"could not be measured on {MAX_UNMEASURED_STEPS} consecutive"):
        run_update(w, unmeasurable())


@pytest.mark.parametrize("is_async", [0, 1])
def test_async_steps_log_the_mismatch_but_never_feed_it(is_async):
    w = Worker({"detector": "cusum"})
    output = run_update(w, v0_batch(tag=(0, 1, is_async)))
    metrics = tu.get(output, "metrics")
    assert metrics["mismatch/k3"][0] > 0  # logged in every mode
    fed = w.engine.lr_scheduler.schedule.mismatch_kl
    assert (math.isnan(fed) if is_async else fed == pytest.approx(metrics["mismatch/k3"][0])), fed


@pytest.mark.parametrize("optimizer_steps", [True, False])
def test_bypass_mode_feeds_the_first_mini_batchs_mismatch_at_its_optimizer_step(optimizer_steps, monkeypatch):
    from verl_lrstab import mismatch
    from verl_lrstab.glue import steps

    monkeypatch.setattr(steps, "micro_batch_view", lambda model_output, data: (
        model_output["log_probs"], data["rollout_log_probs"], data["response_mask"], data["n"]))
    w = Worker({"detector": "cusum", "trigger": "either"})
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    w.engine.optimizer = torch.optim.SGD([param], lr=1e-3)
    w.loss_fn = lambda **kwargs: (torch.tensor(0.0), {})
    data = v0_batch(lengths=(3, 5, 4, 6), bypass=True)
    tu.assign_non_tensor(data, num_mini_batch=2)
    mask = (torch.arange(8)[None] < torch.tensor([3, 5, 4, 6])[:, None]).long()
    rollout = -torch.ones(4, 8)
    trainer = rollout + 0.05 * torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * mask
    fed = []

    def verls_update(self, data):  # two mini-batches, an optimizer step after each, then the scheduler's step
        for rows in (slice(0, 2), slice(2, 4)):
            self.loss_fn(model_output={"log_probs": trainer[rows]},
                         data={"rollout_log_probs": rollout[rows], "response_mask": mask[rows], "n": 2})
            if optimizer_steps:
                self.engine.optimizer.step()
        self.engine.lr_scheduler.step()
        fed.append(self.engine.lr_scheduler.schedule.mismatch_kl)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"lr": [1e-3]}})

    metrics = tu.get(worker._train_mini_batch(verls_update, w, data), "metrics")
    expected = mismatch.mismatch_metrics(trainer[:2], rollout[:2], mask[:2])
    assert metrics[mismatch.BYPASS_KEY] == [1.0] and metrics["mismatch/n_tokens"] == [8.0]
    assert metrics["mismatch/k3"] == [pytest.approx(expected["mismatch/k3"])]
    if optimizer_steps:  # reduced at the first optimizer step: fed before the scheduler's step
        assert fed == [pytest.approx(expected["mismatch/k3"])]
    else:  # no step seen: reduced after the update, logged but too late for this step's LR
        assert math.isnan(fed[0])


def test_bypass_mode_says_so_when_the_first_mini_batchs_log_probs_cannot_be_read(monkeypatch, caplog):
    from verl_lrstab import mismatch

    monkeypatch.setattr(mismatch, "_warned", set())
    w = Worker()
    w.engine.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    w.loss_fn = lambda **kwargs: (torch.tensor(0.0), {})

    def verls_update(self, data):  # a verl whose update no longer goes through worker.loss_fn: nothing captured
        self.engine.lr_scheduler.step()
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"lr": [1e-3]}})

    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    metrics = tu.get(worker._train_mini_batch(verls_update, w, v0_batch(lengths=(3, 5, 4, 6), bypass=True)),
                     "metrics")
    assert not [k for k in metrics if k.startswith("mismatch/")]
    assert mismatch.WARNINGS["bypass_failed"] in caplog.text


def test_the_lr_is_held_within_a_trainer_step_on_our_scheduler_not_on_verls_engine():
    w = Worker()
    engine_attrs = set(vars(w.engine))
    run_update(w, v0_batch(tag=(0, 2, 0)))
    assert w.engine.lr_scheduler.last_epoch == 0  # the step's first update: held
    run_update(w, v0_batch(tag=(1, 2, 0)))
    assert w.engine.lr_scheduler.last_epoch == 1  # stepped once, on the step's last update
    assert set(vars(w.engine)) == engine_attrs  # nothing of ours left on verl's object
    assert w.engine.lr_scheduler.updates_per_step == 2


# -- resume across a change ---------------------------------------------------------------------------
def test_resuming_a_constant_checkpoint_starts_the_detector_fresh_with_a_warning(caplog):
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    stock = get_constant_schedule_with_warmup(opt, num_warmup_steps=0)
    for _ in range(7):
        opt.step()
        stock.step()
    ours = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3))
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    ours.load_state_dict(stock.state_dict())
    assert "checkpoint at update 7 was saved by another LR schedule" in caplog.text
    assert ours.last_epoch == 7 and ours.surge_step is None and ours.get_last_lr() == [pytest.approx(1e-3)]
    ours.step(10.0)  # and it trains on
    assert ours.last_epoch == 8


def test_resuming_a_stock_checkpoint_keeps_its_lr_over_a_changed_optim_lr_and_says_both(caplog):
    # the documented rule (docs/integration.md, Checkpoints and resume), for verl's own checkpoints too
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    saved_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    stock = get_constant_schedule_with_warmup(saved_opt, num_warmup_steps=0)
    for _ in range(5):
        saved_opt.step()
        stock.step()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=4e-3)  # the run now says optim.lr=4e-3
    ours = LengthSurgeLR(opt)  # verl's engine builds both, then its checkpoint manager loads the
    opt.load_state_dict(saved_opt.state_dict())  # optimizer, then the scheduler
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    ours.load_state_dict(stock.state_dict())
    assert "checkpoint's initial LR [0.001]; the configured optim.lr [0.004] is ignored" in caplog.text
    assert ours.get_last_lr() == [pytest.approx(1e-3)] and opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    ours.step(10.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # and it stays: no surge, no decay


def test_an_option_changed_since_the_checkpoint_is_named_in_a_warning(caplog):
    saved = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), {"period_factor": 1.8})
    for length in (10.0, 11.0, 10.5):
        saved.step(length)
    resumed = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), {"period_factor": 1.2})
    caplog.set_level(logging.WARNING, logger="verl_lrstab")
    resumed.load_state_dict(saved.state_dict())
    assert "options changed since the checkpoint at update 3" in caplog.text
    assert "'period_factor': (1.8, 1.2)" in caplog.text
    unchanged = LengthSurgeLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), {"period_factor": 1.8})
    caplog.clear()
    unchanged.load_state_dict(saved.state_dict())
    assert "options changed" not in caplog.text


# -- configs: verl's own logic delegated to; what length_surge does not read is refused ----------------
def test_verls_own_post_init_runs_for_stock_and_length_surge_configs(monkeypatch):
    from verl.workers.config import FSDPOptimizerConfig

    verls = FSDPOptimizerConfig._lrstab_original
    assert FSDPOptimizerConfig is not verls and issubclass(FSDPOptimizerConfig, verls)
    seen = []
    original = verls.__post_init__

    def patched(self):  # what a verl 0.9.x patch might add to its own __post_init__
        seen.append(self.lr_scheduler_type)
        return original(self)

    monkeypatch.setattr(verls, "__post_init__", patched)
    FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="cosine")
    made = FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge")
    assert seen == ["cosine", "constant"]  # verl's checks see a name they know for length_surge
    assert made.lr_scheduler_type == "length_surge"


@pytest.mark.parametrize("kwargs,message", [
    ({"warmup_style": "length_surge"}, r"warmup_style='length_surge' is not supported.*lr_scheduler_type=length_surge"),
    ({"num_cycles": 1.0}, r"optim\.num_cycles=1\.0 is not read by lr_scheduler_type=length_surge"),
    ({"min_lr_ratio": 0.2}, r"optim\.min_lr_ratio=0\.2 is not read"),
    ({"zero_indexed_step": False}, r"optim\.zero_indexed_step=False is not read"),
    ({"length_surge": {"max_surges": 2}}, r"length_surge\.max_surges=2 is invalid in training"),
    ({"length_surge": {"patience": 5}}, r"length_surge\.patience=5 is invalid.*detector='cusum' and trigger='length'"),
    ({"length_surge": {"mismatch_budget": 1e-3}}, r"length_surge\.mismatch_budget=0\.001 is invalid.*trigger='length'"),
    # beside a fixed decay_period, and under monitor_only
    ({"length_surge": {"decay_period": 20, "period_factor": 1.2}},
     r"length_surge\.period_factor=1\.2 is invalid in training.*not read: a fixed decay_period=20"),
    ({"length_surge": {"monitor_only": True, "decay_period": 20}},
     r"length_surge\.decay_period=20 is invalid in training: allowed values are its default None.*monitor_only"),
    ({"length_surge": {"decay_period": 20, "origin": "surge"}},
     r"length_surge\.origin='surge' is invalid beside a fixed decay_period=20: allowed values are 'start' or leaving"),
])
def test_what_length_surge_does_not_read_is_refused_naming_it(kwargs, message):
    from verl.workers.config import FSDPOptimizerConfig

    with pytest.raises(ValueError, match=message):
        FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge", **kwargs)


def test_verls_defaults_for_the_unread_options_are_accepted():
    from verl.workers.config import FSDPOptimizerConfig

    # verl's YAML (optim/fsdp.yaml) sets min_lr_ratio 0.0, its dataclass None; num_cycles 0.5; zero_indexed_step true
    for min_lr_ratio in (None, 0.0):
        FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge", min_lr_ratio=min_lr_ratio, num_cycles=0.5)
    FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge", length_surge={"patience": 5, "trigger": "either"})
    # what is read stays accepted: the paper's second run (a base YAML names the defaults), the guard's
    # rollback (its period came from period_factor), a monitor naming the defaults
    for options in ({"decay_period": 198, "period_factor": 1.8, "gamma": 0.5},
                    {"decay_period": 198, "origin": "start"},
                    {"decay_period": 27, "decay_from_step": 8, "period_factor": 1.2},
                    {"monitor_only": True, "gamma": 0.7, "period_factor": 0.5, "origin": "start"}):  # lrstab guard's
        FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge", length_surge=options)


def test_verls_class_keeps_verls_stock_behaviour_for_unknown_names():
    from verl.workers.config import FSDPOptimizerConfig

    with pytest.raises(ValueError, match=r"lr_scheduler_type='lenght_surge' is not supported: allowed values"):
        FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="lenght_surge")  # a misspelt length_surge: named
    with pytest.raises(AssertionError):  # any other name: verl's own check decides, as without the plugin
        FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="wsd")
    assert verl_optimizer.FSDPOptimizerConfig is FSDPOptimizerConfig


@pytest.mark.parametrize("name, kwargs", [("FSDPOptimizerConfig", {"lr_scheduler_type": "cosine"}),
                                          ("FSDPOptimizerConfig", {}),
                                          ("McoreOptimizerConfig", {"lr_decay_style": "cosine"}),
                                          ("McoreOptimizerConfig", {})])
def test_a_stock_config_is_verls_own_class_and_reaches_a_process_without_the_package(name, kwargs):
    from ray import cloudpickle  # what Ray sends a worker's config with (a critic's optim, too)
    import verl.workers.config as verl_config

    made = getattr(verl_config, name)(lr=1e-6, **kwargs)
    assert type(made) is getattr(verl_optimizer, name)._lrstab_original  # verl's class, built by verl's checks
    blob = cloudpickle.dumps(made)
    assert b"verl_lrstab" not in blob
    # a worker node without verl-lrstab: its import fails there, and the plugin does not load
    proc = subprocess.run([sys.executable, "-c", "import pickle, sys; sys.modules['verl_lrstab'] = None; "
                           "print(repr(pickle.loads(sys.stdin.buffer.read())))"], input=blob, capture_output=True,
                          timeout=240, env={"VERL_USE_EXTERNAL_PLUGINS": "none", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert repr(made) in proc.stdout.decode()


def test_length_surge_options_beside_a_stock_scheduler_are_warned_and_left_out():
    from verl.workers.config import FSDPOptimizerConfig

    with pytest.warns(UserWarning, match=r"optim\.length_surge is set but lr_scheduler_type='cosine': the length_surge "
                                         "options are ignored"):
        made = FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="cosine", length_surge={"patience": 3})
    assert type(made) is verl_optimizer.FSDPOptimizerConfig._lrstab_original and not hasattr(made, "length_surge")


# -- imports: no side effects; a broken module is named --------------------------------------------------
def run_python(code: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)


def test_importing_the_package_imports_neither_verl_nor_torch():
    proc = run_python("""
        import sys
        import verl_lrstab, verl_lrstab.glue
        print("LOADED", sorted(m for m in ("verl", "torch", "verl_lrstab.glue.registry", "verl_lrstab.config")
                                 if m in sys.modules))
        from verl_lrstab import LengthSurgeConfig  # the names still load, on first use
        print("NAME", LengthSurgeConfig.__module__)
    """)
    assert "LOADED []" in proc.stdout and "NAME verl_lrstab.config" in proc.stdout, proc.stderr[-2000:]


def test_a_broken_module_is_logged_at_error_by_name_and_refuses_length_surge():
    proc = run_python("""
        import importlib.abc, sys

        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "verl_lrstab.cusum":
                    raise RuntimeError("simulated: the module raises at import")

        sys.meta_path.insert(0, Broken())
        import verl
        from verl.workers.config import FSDPOptimizerConfig
        print("STOCK", FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="cosine").lr_scheduler_type)
        try:
            FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="length_surge")
        except Exception as exc:
            print("REFUSED", type(exc).__name__, exc)
    """)
    assert "STOCK cosine" in proc.stdout, proc.stderr[-3000:]
    assert "REFUSED GlueUnavailable" in proc.stdout and "the package module verl_lrstab.cusum" in proc.stdout
    assert "simulated: the module raises at import" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "verl-lrstab: cannot use the package module verl_lrstab.cusum" in line]
    assert len(errors) == 1 and "verl 0.9.1" in errors[0], proc.stderr[-3000:]
