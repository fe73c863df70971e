"""Engines, roles and trainers where ``length_surge`` would never be fed: refused by name.

Each refusal wraps the function where verl first sees the config there and raises
:class:`LengthSurgeNotSupported` naming the key, the place and what is supported; any other
value goes to verl's function untouched. A refusal that cannot be installed is one ERROR and
disables that refusal only: it does not block the supported paths (its :class:`~.wraps.Wrap`
is not required).
"""

from __future__ import annotations

from typing import Callable

from verl_lrstab.glue.failsafe import OPTIM, OPTIM_KEY, SCHEDULER_NAME
from verl_lrstab.glue.wraps import Wrap, dispatch

SUPPORTED = (f"the actor ({OPTIM}) of the FSDP engine (strategy fsdp/fsdp2) and of the "
             "Megatron engine (strategy megatron, lr_decay_style) in verl's main_ppo, V0 and V1 (sync, "
             "colocate_async, separate_async), and in verl's one-step-off-policy and fully-async trainers")


class LengthSurgeNotSupported(ValueError):
    """``length_surge`` named where it would have no effect."""


def refuse(key: str, where: str) -> LengthSurgeNotSupported:
    return LengthSurgeNotSupported(f"{key}={SCHEDULER_NAME} is not supported for {where}: it would never be fed "
                                   f"and do nothing. Supported: {SUPPORTED}; elsewhere use constant or cosine.")


def refusal(key: str, where: str, get: Callable) -> Callable:
    """A wrap factory: ``get(*args, **kwargs)`` reads the scheduler name from verl's arguments."""

    def make(original_fn):
        def raise_refusal(original, *args, **kwargs):
            raise refuse(key, where)

        def named(*args, **kwargs) -> bool:
            try:
                return get(*args, **kwargs) == SCHEDULER_NAME
            except Exception:  # noqa: BLE001 - the key is absent there: nothing to refuse
                return False

        return dispatch(original_fn, named, raise_refusal)

    return make


def _self_field(self, *args, **kwargs):
    return getattr(self, "lr_scheduler_type", None)


def _kwarg(self, *args, **kwargs):
    return kwargs.get("lr_scheduler_type")


def _critic(self, *args, **kwargs):
    optim = getattr(self, "optim", None)
    return optim.get("lr_scheduler_type") if hasattr(optim, "get") else getattr(optim, "lr_scheduler_type", None)


def _config_optim(self, *args, **kwargs):
    config = args[0] if args else kwargs.get("config", getattr(self, "config", None))
    return config.optim.get("lr_scheduler_type") if config is not None else None


def _config_actor_optim(self, *args, **kwargs):
    """The actor's scheduler name under either of verl's keys (FSDP's, Megatron's ``lr_decay_style``)."""
    config = args[0] if args else kwargs.get("config")
    optim = config.actor_rollout_ref.actor.optim
    names = (optim.get("lr_scheduler_type"), optim.get("lr_decay_style"))
    return SCHEDULER_NAME if SCHEDULER_NAME in names else names[0]


ACTOR_KEY = OPTIM_KEY

def refusal_wrap(module: str, owner: str, attribute: str, parameters: tuple, key: str, where: str,
                 get: Callable) -> Wrap:
    """The (not required) wrap of verl's ``module.owner.attribute`` refusing ``key=length_surge`` for ``where``."""
    return Wrap(module, owner, attribute, parameters, refusal(key, where, get), required=False,
                where=f"{key} for {where}")


WRAPS = [
    refusal_wrap("verl.workers.config.optimizer", "VeOmniOptimizerConfig", "__post_init__", ("self",), ACTOR_KEY,
                 "the VeOmni engine (VeOmniOptimizerConfig)", _self_field),
    refusal_wrap("verl.workers.config.optimizer", "TorchtitanOptimizerConfig", "__init__", ("self",), ACTOR_KEY,
                 "the TorchTitan engine (TorchtitanOptimizerConfig has no lr_scheduler_type)", _kwarg),
    refusal_wrap("verl.workers.config.critic", "CriticConfig", "__post_init__", ("self",),
                 "critic.optim.lr_scheduler_type", "the critic (role critic, any engine)", _critic),
    refusal_wrap("verl.trainer.sft_trainer", "SFTTrainer", "_build_config", ("self",), "optim.lr_scheduler_type",
                 "the SFT trainer (verl.trainer.sft_trainer)", _config_optim),
    refusal_wrap("verl.trainer.sft_trainer_ray", "SFTTrainer", "_build_config", ("self",), "optim.lr_scheduler_type",
                 "the SFT trainer (verl.trainer.sft_trainer_ray)", _config_optim),
]
