"""verl 0.9.1's trainer classes: which serve ``length_surge``, and whether their rollout is async.

Decided by class, never by the mode name a class is registered under: a trainer is judged by the
nearest of verl's own classes in its MRO (a user's subclass of ``PPOTrainerSync`` is sync, of
``PPOTrainerColocateAsync`` async). What a class is (docs/integration.md, "Trainers"):

- sync: the rollout samples with the weights the trainer scores with; the mismatch figures are
  the engine's and may feed the detector (``trigger: mismatch|either``, cusum's KL co-signal).
- async: the rollout may sample with older weights; the mismatch figures are split by version lag
  (only the fresh samples' may feed the detector, the stale ones are logged apart), and
  ``trigger: mismatch|either`` is refused.

A V1 trainer under any mode name but ``sync`` is async whatever its class: verl's ``PPOTrainer``
builds the asynchronous replay buffer (``ReplayBufferAsync``) for every other name. A V1 class
deriving from none of verl's modes (``PPOTrainer`` itself) is async: nothing says it is not.
The one-step-off and fully-async trainers skip verl's ``__init__`` that runs the run's checks;
their own wraps run them.
"""

from __future__ import annotations

SYNC, ASYNC = "sync", "async"

#: (module, class) of verl's trainers -> what they are. Checked against the wheel by
#: tests/test_glue_trainers.py (every trainer class verl ships is listed here or refused).
VERL_TRAINERS = {
    ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer"): SYNC,  # V0 (main_ppo with trainer.use_v1=false)
    ("verl.experimental.separation.ray_trainer", "SeparateRayPPOTrainer"): SYNC,  # V0 base of the two below
    ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer"): ASYNC,  # served (versions.py)
    ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer"): ASYNC,  # a step is a sync cycle
    ("verl.trainer.ppo.v1.trainer_sync", "PPOTrainerSync"): SYNC,  # V1 trainer_mode sync
    ("verl.trainer.ppo.v1.trainer_colocate_async", "PPOTrainerColocateAsync"): ASYNC,
    ("verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync"): ASYNC,
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer"): ASYNC,  # a custom mode deriving from the base alone
}
V1_BASE = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")


def verl_class(cls: type) -> tuple | None:
    """The nearest of verl's trainer classes in ``cls``'s MRO, as ``(module, name)``; None if none."""
    for klass in cls.__mro__:
        key = (klass.__module__, klass.__name__)
        if key in VERL_TRAINERS:
            return key
    return None


def is_async(cls: type, trainer_mode: str | None = None) -> bool:
    """Whether trainer class ``cls`` (run under V1 ``trainer_mode``, None for V0) may sample with older weights."""
    key = verl_class(cls)
    if key is None:
        return True  # not a verl trainer: nothing says the rollout is in step with the trainer
    if trainer_mode is not None and trainer_mode != "sync" and _is_v1(cls):
        return True  # verl's PPOTrainer builds ReplayBufferAsync for any mode name but "sync"
    return VERL_TRAINERS[key] == ASYNC


def _is_v1(cls: type) -> bool:
    return any((k.__module__, k.__name__) == V1_BASE for k in cls.__mro__)


def describe(cls: type) -> str:
    """``module.Class`` of a trainer class, for messages (a Ray actor's: the class it was made from)."""
    cls = getattr(cls, "__ray_actor_class__", cls)
    return f"{cls.__module__}.{cls.__qualname__}"
