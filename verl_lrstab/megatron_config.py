"""verl's Megatron optimizer config, extended to accept ``lr_decay_style: length_surge``.

The plugin puts :class:`LengthSurgeMcoreOptimizerConfig` in place of
``verl.workers.config.McoreOptimizerConfig`` (the ``_target_`` of verl's ``optim/megatron.yaml``).
Megatron's own key selects the scheduler::

    actor_rollout_ref.actor.optim.lr_decay_style=length_surge

``lr_scheduler_type: length_surge`` (the FSDP key) is accepted too, so one ``length_surge``
snippet serves both engines. No megatron-core import here: every verl process loads this.

The class derives from the ``McoreOptimizerConfig`` the plugin finds (:func:`make_config`) and is
built on first use, so that importing this module never imports ``verl.workers.config``, whose
import runs the plugin's hook, which needs this module complete.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from verl_lrstab.config import SCHEDULER_NAME, LengthSurgeConfig

logger = logging.getLogger("verl_lrstab")

OPTIM = "actor_rollout_ref.actor.optim"
# megatron-core's OptimizerParamScheduler.get_lr (0.16, 0.19); anything else raises there at run time.
MEGATRON_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
STYLES = MEGATRON_STYLES + (SCHEDULER_NAME,)
# Styles that `lr_scheduler_type: length_surge` may override: the YAML and dataclass defaults.
_DEFAULT_STYLES = ("constant", "linear")


def _build(base: type) -> type:
    """``LengthSurgeMcoreOptimizerConfig``, derived from verl's ``McoreOptimizerConfig`` ``base``."""

    @dataclass
    class LengthSurgeMcoreOptimizerConfig(base):
        """``McoreOptimizerConfig`` plus the ``length_surge`` LR schedule.

        Args:
            lr_decay_style (str): Megatron's styles or ``"length_surge"``.
            lr_scheduler_type (str | None): null (default), or ``"length_surge"``, the FSDP key, as
                an alias of ``lr_decay_style: length_surge``.
            length_surge (dict | None): options of the ``length_surge`` schedule, see
                :class:`verl_lrstab.config.LengthSurgeConfig`; unset keys take the paper's defaults.

        With ``length_surge``, ``use_checkpoint_opt_param_scheduler`` is turned on: verl loads the
        scheduler's state (LR step, surge, detector) on resume only with it, so a resumed run
        continues the exact trajectory instead of restarting at step 0.
        """

        lr_scheduler_type: Optional[str] = None
        length_surge: Optional[Any] = None

        def __post_init__(self):
            if self.lr_scheduler_type is not None:
                if self.lr_scheduler_type != SCHEDULER_NAME:
                    raise ValueError(f"{OPTIM}.lr_scheduler_type={self.lr_scheduler_type!r} is not supported on "
                                     f"Megatron: allowed values are [None, '{SCHEDULER_NAME}'] (Megatron's schedule "
                                     f"is {OPTIM}.lr_decay_style, one of {list(STYLES)})")
                if self.lr_decay_style not in _DEFAULT_STYLES + (SCHEDULER_NAME,):
                    raise ValueError(f"{OPTIM}.lr_scheduler_type={SCHEDULER_NAME!r} conflicts with "
                                     f"{OPTIM}.lr_decay_style={self.lr_decay_style!r}: set one of them (allowed: "
                                     f"lr_decay_style in {list(_DEFAULT_STYLES + (SCHEDULER_NAME,))} with "
                                     f"lr_scheduler_type={SCHEDULER_NAME!r})")
                object.__setattr__(self, "lr_decay_style", SCHEDULER_NAME)
            if self.lr_decay_style == SCHEDULER_NAME:
                from verl_lrstab import _hooks

                _hooks.check_usable()  # the glue failed in this process: refuse now, not at the first update
                from verl_lrstab.verl_config import _plain

                object.__setattr__(self, "length_surge", LengthSurgeConfig.from_dict(_plain(self.length_surge)))
                if not self.use_checkpoint_opt_param_scheduler:
                    logger.warning("verl_lrstab: %s.use_checkpoint_opt_param_scheduler set to true for length_surge, "
                                   "so that a resumed run continues its LR schedule and surge detector exactly", OPTIM)
                    object.__setattr__(self, "use_checkpoint_opt_param_scheduler", True)
            else:
                close = difflib.get_close_matches(str(self.lr_decay_style), [SCHEDULER_NAME], n=1, cutoff=0.75)
                if close:
                    raise ValueError(f"{OPTIM}.lr_decay_style={self.lr_decay_style!r} is not supported: allowed "
                                     f"values are {list(STYLES)}")
                if self.lr_decay_style not in MEGATRON_STYLES:
                    # Not ours to refuse (a later megatron-core may add styles); megatron-core raises at run time.
                    warnings.warn(f"{OPTIM}.lr_decay_style={self.lr_decay_style!r} is not one of megatron-core's "
                                  f"{list(MEGATRON_STYLES)} (or {SCHEDULER_NAME!r})", stacklevel=2)
                if self.length_surge:
                    warnings.warn(f"{OPTIM}.length_surge is set but lr_decay_style={self.lr_decay_style!r}: the "
                                  "length_surge options are ignored", stacklevel=2)
            super().__post_init__()

    # Pickled by name (Ray sends configs to the workers), found through the module's __getattr__.
    LengthSurgeMcoreOptimizerConfig.__module__ = __name__
    LengthSurgeMcoreOptimizerConfig.__qualname__ = "LengthSurgeMcoreOptimizerConfig"
    return LengthSurgeMcoreOptimizerConfig


_class: Optional[type] = None


def make_config(original_cls: type) -> type:
    """The plugin's wrap factory: our subclass in place of verl's ``McoreOptimizerConfig``."""
    global _class
    if _class is None:
        _class = _build(original_cls)
    elif not issubclass(_class, original_cls):
        raise TypeError(f"LengthSurgeMcoreOptimizerConfig does not derive from {original_cls!r}")
    return _class


def __getattr__(name: str):
    """``LengthSurgeMcoreOptimizerConfig`` (also as a Hydra ``_target_``), built on first use."""
    if name != "LengthSurgeMcoreOptimizerConfig":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _class is None:
        from verl.workers.config import optimizer  # with the plugin active, its hook calls make_config here

        if _class is None:
            make_config(optimizer.McoreOptimizerConfig)
    return _class


def config_checks(module, cls):
    """The fields the Megatron scheduler reads, as ``(assumption, ok, detail)``."""
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    needed = {"lr", "lr_warmup_init", "lr_warmup_steps", "lr_warmup_steps_ratio", "lr_decay_steps", "lr_decay_style",
              "min_lr", "weight_decay", "weight_decay_incr_style", "total_training_steps",
              "use_checkpoint_opt_param_scheduler"}
    yield "McoreOptimizerConfig has the fields the scheduler reads", needed <= fields, sorted(needed - fields)
