"""The engines build our scheduler: ``FSDPEngine._build_lr_scheduler`` and ``MegatronEngine._build_lr_scheduler``.

verl's builders are an ``if/elif`` over their own names (FSDP raises ``NotImplementedError``
for others; megatron-core's scheduler raises at the first update after warmup), and the
result is handed to verl's checkpoint manager inside ``initialize()``, so ours must be built
there. Any other scheduler name goes to verl's builder untouched.
"""

from __future__ import annotations

from verl_lrstab.config import SCHEDULER_NAME
from verl_lrstab.glue.batch_figures import check_assumptions_once
from verl_lrstab.glue.failsafe import check_usable
from verl_lrstab.glue.wraps import argument, dispatch, source_contains


def _optim_names(key: str):
    def names(self, *args, **kwargs) -> bool:
        return getattr(getattr(self, "optimizer_config", None), key, None) == SCHEDULER_NAME

    return names


# -- FSDP ------------------------------------------------------------------------------------------
def make_fsdp_build(original_fn):
    def build(original, self, *args, **kwargs):
        check_usable()  # a wrap failed in this process: refuse rather than run a scheduler nobody feeds
        check_assumptions_once()
        optimizer = argument((self,) + args, kwargs, 1, "optimizer")
        return build_length_surge_scheduler(optimizer, self.optimizer_config, verbose=getattr(self, "rank", 0) == 0)

    return dispatch(original_fn, _optim_names("lr_scheduler_type"), build)


def fsdp_engine_checks(module, build):
    engine = module.FSDPEngine
    yield "FSDPEngine._build_lr_scheduler reads self.optimizer_config and raises NotImplementedError for unknown " \
          "names", *source_contains(build, "self.optimizer_config", "NotImplementedError")
    yield "FSDPEngine.initialize() hands the scheduler to FSDPCheckpointManager", *source_contains(
        engine.initialize, "lr_scheduler=self.lr_scheduler")
    yield "FSDPEngine.lr_scheduler_step() calls step() with no argument", *source_contains(
        engine.lr_scheduler_step, "self.lr_scheduler.step()")


def build_length_surge_scheduler(optimizer, optim_config, verbose: bool = False):
    """Build :class:`LengthSurgeLR` from verl's optimizer config, resolving warmup as verl does."""
    from verl_lrstab.scheduler import LengthSurgeLR

    warmup = optim_config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim_config.lr_warmup_steps_ratio * optim_config.total_training_steps)
    warmup = max(0, warmup)
    scheduler = LengthSurgeLR(optimizer, getattr(optim_config, "length_surge", None), warmup_steps=warmup)
    if verbose:
        print(f"verl_lrstab: length_surge scheduler, warmup {warmup} steps, options {scheduler.config.to_dict()}")
    return scheduler


# -- Megatron (the module imports only where megatron-core is installed) ----------------------------
def make_megatron_build(original_fn):
    def build(original, self, *args, **kwargs):
        from verl_lrstab.megatron import build_length_surge_param_scheduler

        check_usable()
        check_assumptions_once()
        return build_length_surge_param_scheduler(self.optimizer, self.optimizer_config, verbose=_is_rank0())

    return dispatch(original_fn, _optim_names("lr_decay_style"), build)


def megatron_engine_checks(module, build):
    engine = module.MegatronEngine
    yield "MegatronEngine._build_lr_scheduler uses get_megatron_optimizer_param_scheduler(self.optimizer) with " \
          "self.optimizer_config", *source_contains(build, "get_megatron_optimizer_param_scheduler",
                                                    "optimizer=self.optimizer", "self.optimizer_config")
    yield "MegatronEngine.initialize() builds the optimizer before the scheduler and hands it to the checkpoint " \
          "manager with use_checkpoint_opt_param_scheduler", *source_contains(
              engine.initialize, "self.lr_scheduler = self._build_lr_scheduler()",
              "optimizer_scheduler=self.lr_scheduler",
              "use_checkpoint_opt_param_scheduler=self.optimizer_config.use_checkpoint_opt_param_scheduler")
    yield "MegatronEngine.lr_scheduler_step() calls step(1)", *source_contains(
        engine.lr_scheduler_step, "self.lr_scheduler.step(1)")


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
