"""Every trainer class verl 0.9.1 ships is served or refused, decided by class, not mode name.

Each case builds verl's real trainer class with a config composed by verl's Hydra configs; the
glue's checks run in the wrapped ``__init__`` before verl's own (V0's then stops at verl's first
assertion on the empty worker mapping, after the checks: what is asserted is what the checks found).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_module

import verl  # noqa: F401 - loads the plugin through verl's entry point
from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1 import PPOTrainer, get_trainer_cls
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl_lrstab.glue import driver, trainers
from verl_lrstab.glue.refusals import LengthSurgeNotSupported
from verl_lrstab.glue.steps import STEP_POSITION_KEY, GlueError

OPTIM = "actor_rollout_ref.actor.optim"
MISMATCH = (f"+{OPTIM}.length_surge.trigger=mismatch", "actor_rollout_ref.rollout.calculate_log_probs=true")
SEPARATE_ASYNC = ("trainer.v1.trainer_mode=separate_async", "data.train_batch_size=4",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.v1.separate_async.parameter_sync_step=2",
                  "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                  "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")  # what verl's class asserts


def config(*overrides):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[f"{OPTIM}.lr_scheduler_type=length_surge", *overrides])


def build(cls, cfg):
    """Build ``cls`` with ``cfg`` as verl's main_ppo would (V0: stops after the checks, see the docstring)."""
    trainer = cls.__new__(cls)
    if issubclass(cls, PPOTrainer):
        trainer.__init__(cfg)
    else:
        with pytest.raises(AssertionError, match="role_worker_mapping"):  # verl's own, after ours
            trainer.__init__(cfg, None, {}, None)
    return trainer


# -- every class in the wheel --------------------------------------------------------------------------
NOT_TRAINERS = {  # classes named like trainers that never update the actor
    ("verl.experimental.fully_async_policy.fully_async_rollouter", "FullyAsyncRollouter"),  # the rollout side
}
REFUSED = {  # (module, class): refused where verl first sees the config (tests/test_refusals.py, below)
    ("verl.trainer.sft_trainer", "SFTTrainer"), ("verl.trainer.sft_trainer_ray", "SFTTrainer"),
}


def wheel_trainer_classes():
    """``(module, class)`` of every class in verl's wheel named ``*Trainer*`` or deriving from one."""
    root = Path(verl.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if "tests" in path.parts:
            continue
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if "Trainer" in node.name or any("Trainer" in b for b in bases):
                    found.add((module, node.name))
    return found


def test_every_trainer_class_verl_ships_is_judged_or_refused():
    found = wheel_trainer_classes()
    assert ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer") in found and len(found) >= 10, found
    unlisted = found - set(trainers.VERL_TRAINERS) - REFUSED - NOT_TRAINERS
    assert not unlisted, f"trainer classes in verl's wheel neither judged (glue/trainers.py) nor refused: {unlisted}"
    stale = (set(trainers.VERL_TRAINERS) | REFUSED) - found
    assert not stale, f"listed but not in verl's wheel: {stale}"


def test_docs_list_every_trainer_class():
    page = (Path(__file__).parents[1] / "docs" / "integration.md").read_text()
    for _, name in set(trainers.VERL_TRAINERS) | REFUSED | NOT_TRAINERS:
        assert f"`{name}`" in page, f"docs/integration.md does not list {name}"


# -- served: what each class is, from its class ---------------------------------------------------------
@pytest.mark.parametrize("cls,overrides,is_async", [
    (RayPPOTrainer, ("trainer.use_v1=false",), False),
    (SeparateRayPPOTrainer, ("trainer.use_v1=false",), False),
    (get_trainer_cls("sync"), (), False),
    (get_trainer_cls("colocate_async"), ("trainer.v1.trainer_mode=colocate_async",), True),
    (get_trainer_cls("separate_async"), SEPARATE_ASYNC, True),
], ids=lambda v: getattr(v, "__name__", None))
def test_each_served_trainer_runs_the_checks_and_is_judged_by_class(cls, overrides, is_async):
    trainer = build(cls, config(*overrides))
    assert driver.checked_async(trainer) is is_async
    if is_async:
        with pytest.raises(GlueError, match=f"trainer {cls.__module__}.{cls.__name__}.*staleness"):
            build(cls, config(*overrides, *MISMATCH))
    else:
        assert driver.checked_async(build(cls, config(*overrides, *MISMATCH))) is False


@pytest.fixture
def custom_modes():
    """Trainer classes registered under mode names of verl's registry (removed afterwards)."""
    added = []

    def register(name, base):
        cls = type(f"Custom{name.title().replace('_', '')}", (base,), {"__module__": __name__})
        TRAINER_REGISTRY[name] = cls
        added.append(name)
        return cls

    yield register
    for name in added:
        TRAINER_REGISTRY.pop(name, None)


@pytest.mark.parametrize("base,is_async", [
    (PPOTrainerColocateAsync, True),  # a custom async subclass: async whatever its mode's name
    (PPOTrainerSync, True),  # verl builds the async replay buffer for any mode name but "sync"
    (PPOTrainer, True),  # derives from none of verl's modes: nothing says it is sync
])
def test_a_custom_mode_name_does_not_make_a_trainer_sync(custom_modes, base, is_async):
    cls = custom_modes("lrstab_custom", base)
    overrides = ("trainer.v1.trainer_mode=lrstab_custom",)
    if base is PPOTrainer:  # abstract: the class is judged as main_ppo would build it, by check_run's lookup
        assert driver.check_run(config(*overrides), lambda engine, trainer=None: None) is is_async
        return
    trainer = build(cls, config(*overrides))
    assert driver.checked_async(trainer) is is_async
    with pytest.raises(GlueError, match=f"trainer {__name__}.{cls.__name__}"):
        build(cls, config(*overrides, *MISMATCH))


def test_a_user_subclass_of_v0_is_judged_by_verls_class_it_derives_from():
    class MyTrainer(RayPPOTrainer):
        pass

    assert not trainers.is_async(MyTrainer)
    assert trainers.verl_class(MyTrainer) == ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer")
    assert trainers.is_async(type("Unrelated", (), {}))  # not a verl trainer at all: never judged sync


# -- the one-step-off trainer: served, async; its own __init__ runs the checks ----------------------------
ONE_STEP_OFF = ("trainer.use_v1=true",)  # its shape decides the wraps it needs, not use_v1 (it is V0-shaped)


def build_one_step_off(cfg):
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

    trainer = OneStepOffRayTrainer.__new__(OneStepOffRayTrainer)
    with pytest.raises(AssertionError):  # verl's own `assert not self.hybrid_engine`, after ours
        trainer.__init__(cfg, None, {}, None)
    return trainer


@pytest.mark.parametrize("trigger", ["mismatch", "either"])
def test_one_step_off_runs_the_checks_at_its_own_init_and_is_async(trigger):
    trainer = build_one_step_off(config(*ONE_STEP_OFF))
    assert driver.checked_async(trainer) is True
    with pytest.raises(GlueError, match=rf"trigger='{trigger}' .*trainer verl.experimental.one_step_off_policy."
                                        r"ray_trainer.OneStepOffRayTrainer.*staleness"):
        build_one_step_off(config(*ONE_STEP_OFF, *MISMATCH, f"{OPTIM}.length_surge.trigger={trigger}"))


def test_one_step_off_maps_its_versions_to_lags_as_its_syncs_happen():
    """fit syncs the loaded weights under the step before the first; step G syncs under G before its update:
    the first step trains on the start's sync (lag 0), every later step on the previous step's (lag 1)."""
    import numpy as np

    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl_lrstab.glue import versions

    trainer = OneStepOffRayTrainer.__new__(OneStepOffRayTrainer)

    def batch(lo, hi):
        return SimpleNamespace(non_tensor_batch={"min_global_steps": np.array(lo, dtype=object),
                                                 "max_global_steps": np.array(hi, dtype=object)})

    trainer.global_steps = 5  # resumed from step 4: fit synced under 4, the first batch was sampled on it
    assert versions.v0_lags(trainer, batch([4, 4], [4, 4])) == {4: 0}
    trainer.global_steps = 6  # sampled after step 5's sync (under 5: the weights before step 5's update)
    assert versions.v0_lags(trainer, batch([5, 4], [5, 5])) == {5: 1, 4: 1}
    trainer.global_steps = 7
    assert versions.v0_lags(trainer, batch([6], [6])) == {6: 1}


# -- the fully-async trainer: served, async; its __init__ (a Ray actor class's) runs the checks --------------
def build_fully_async(cfg):
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer

    cls = FullyAsyncTrainer.__ray_metadata__.modified_class  # what Ray builds the actor from
    trainer = cls.__new__(cls)
    with pytest.raises(AssertionError):  # verl's own `assert not self.hybrid_engine`, after ours
        trainer.__init__(cfg, None, {}, None)
    return trainer


@pytest.mark.parametrize("trigger", ["mismatch", "either"])
def test_fully_async_runs_the_checks_at_its_init_and_is_async(trigger):
    trainer = build_fully_async(config("trainer.use_v1=true"))
    assert driver.checked_async(trainer) is True
    with pytest.raises(GlueError, match=rf"trigger='{trigger}' .*trainer verl.experimental.fully_async_policy."
                                        r"fully_async_trainer.FullyAsyncTrainer.*staleness"):
        build_fully_async(config(*MISMATCH, f"{OPTIM}.length_surge.trigger={trigger}"))


def test_fully_async_feeds_once_a_sync_cycle_and_counts_lags_from_the_old_log_prob_weights():
    import numpy as np

    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl_lrstab.glue import versions

    cls = FullyAsyncTrainer.__ray_actor_class__
    trainer = cls.__new__(cls)
    trainer.trigger_parameter_sync_step, trainer.current_param_version = 3, 7
    batch = SimpleNamespace(non_tensor_batch={"min_global_steps": np.array([7, 6, 5], dtype=object),
                                              "max_global_steps": np.array([7, 7, 6], dtype=object)})
    for local, index in ((1, 0), (2, 1), (3, 2)):  # local_trigger_step counts the cycle's updates from 1
        trainer.local_trigger_step = local
        assert versions.v0_position(trainer) == (index, 3)
        assert versions.v0_lags(trainer, batch) == {7: 0, 6: 1, 5: 2}  # the cycle's first weights: version 7
    assert versions.v0_position(RayPPOTrainer.__new__(RayPPOTrainer)) == (0, 1)


@pytest.mark.parametrize("base,update", [(RayPPOTrainer, lambda t: t._update_actor(SimpleNamespace(meta_info={}))),
                                         (PPOTrainerSync, lambda t: t._update_actor(SimpleNamespace(extra_info={}),
                                                                                    {}))])
def test_a_trainer_whose_checks_never_ran_is_refused_at_its_first_update_naming_the_class(base, update):
    class SkipsVerlsInit(base):  # as OneStepOffRayTrainer does: its own __init__, no super().__init__
        def __init__(self, cfg):
            self.config = cfg

    trainer = SkipsVerlsInit(config())
    with pytest.raises(GlueError, match=r"with the trainer .*SkipsVerlsInit: its __init__ does not run verl's"):
        update(trainer)
    # a stock run's trainer is untouched (verl's own _update_actor runs; here it fails on the stub batch)
    trainer.config.actor_rollout_ref.actor.optim.lr_scheduler_type = "constant"
    with pytest.raises(Exception) as err:
        update(trainer)
    assert not isinstance(err.value, GlueError)


# -- a scheduler never fed: an overridden step() that does not advance local_trigger_step -------------
def test_a_scheduler_not_fed_for_a_trainer_steps_worth_of_updates_fails_naming_the_cause():
    from test_glue_guarantees import Worker, run_update, v0_batch

    sent = []
    update_actor = driver.make_v1_update_actor(lambda self, batch, metrics: sent.append(
        list(batch.extra_info[STEP_POSITION_KEY])))  # verl's _update_actor hands extra_info to the worker

    class OverriddenStep(PPOTrainerSync):
        def step(self, metrics, timing_raw):  # loops over the updates but never sets local_trigger_step
            for _ in range(self.parameter_sync_step):
                update_actor(self, SimpleNamespace(extra_info={}), metrics)

    trainer = build(OverriddenStep, config())
    trainer.parameter_sync_step = 2  # as from trainer.v1.<mode>.parameter_sync_step
    worker = Worker()
    trainer.step({}, {})
    assert sent == [[0, 2, 0, trainer.config.actor_rollout_ref.rollout.response_length]] * 2  # never index 1
    run_update(worker, v0_batch(tag=sent[0]))
    with pytest.raises(GlueError, match=r"not fed for 2 consecutive actor updates.*local_trigger_step"):
        run_update(worker, v0_batch(tag=sent[1]))
    assert worker.engine.lr_scheduler.last_epoch == 0  # it never stepped: the failure is what says so

    # verl's own loop (local_trigger_step = 0, 1) feeds once per step and never fails
    worker = Worker()
    for _ in range(4):
        for index in range(2):
            run_update(worker, v0_batch(tag=(index, 2, 0)))
    assert worker.engine.lr_scheduler.last_epoch == 4


def test_a_scheduler_verls_engine_never_steps_fails_the_run():
    from test_glue_guarantees import Worker, v0_batch

    from verl_lrstab.glue import worker as worker_glue
    from verl_lrstab.glue.steps import MAX_UNSTEPPED_STEPS
    from verl.utils import tensordict_utils as tu

    def update_without_stepping(self, data):  # an engine that no longer calls lr_scheduler_step()
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}})

    w = Worker()
    for _ in range(MAX_UNSTEPPED_STEPS):
        worker_glue._train_mini_batch(update_without_stepping, w, v0_batch())
    with pytest.raises(GlueError, match=f"did not step the length_surge scheduler on {MAX_UNSTEPPED_STEPS} "
                                        "consecutive trainer steps"):
        worker_glue._train_mini_batch(update_without_stepping, w, v0_batch())
