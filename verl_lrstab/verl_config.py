"""verl's FSDP optimizer config, extended to accept ``lr_scheduler_type: length_surge``.

The plugin puts this class in place of ``verl.workers.config.FSDPOptimizerConfig`` (the
``_target_`` of verl's ``optim/fsdp.yaml``), so the name alone selects the scheduler.
Naming it explicitly also works where plugins are disabled
(``VERL_USE_EXTERNAL_PLUGINS=none``)::

    actor_rollout_ref.actor.optim._target_=verl_lrstab.verl_config.LengthSurgeOptimizerConfig
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config.optimizer import FSDPOptimizerConfig, OptimizerConfig

from verl_lrstab._hooks import check_usable
from verl_lrstab.config import SCHEDULER_NAME, LengthSurgeConfig

STOCK_SCHEDULERS = ("constant", "cosine")
SCHEDULERS = STOCK_SCHEDULERS + (SCHEDULER_NAME,)


@dataclass
class LengthSurgeOptimizerConfig(FSDPOptimizerConfig):
    """``FSDPOptimizerConfig`` plus the ``length_surge`` scheduler.

    Args:
        lr_scheduler_type (str): ``"constant"``, ``"cosine"`` (verl's) or ``"length_surge"``.
        length_surge (dict | None): options of the ``length_surge`` scheduler, see
            :class:`verl_lrstab.config.LengthSurgeConfig`; unset keys take the paper's defaults.
    """

    length_surge: Optional[Any] = None

    def __post_init__(self):
        # verl's own __post_init__ asserts the name is constant|cosine: replace that check
        # with one that names the key and the allowed values, keep the rest of it.
        if self.warmup_style is not None:
            warnings.warn("`warmup_style` is deprecated, use `lr_scheduler_type` instead.", DeprecationWarning,
                          stacklevel=2)
            object.__setattr__(self, "lr_scheduler_type", self.warmup_style)
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"actor_rollout_ref.actor.optim.lr_scheduler_type={self.lr_scheduler_type!r} is not "
                             f"supported: allowed values are {list(SCHEDULERS)}")
        if self.lr_scheduler_type == SCHEDULER_NAME:
            check_usable()  # the glue failed to wrap verl in this process: fail now, with the cause
            object.__setattr__(self, "length_surge", LengthSurgeConfig.from_dict(_plain(self.length_surge)))
        elif self.length_surge:
            warnings.warn(f"actor_rollout_ref.actor.optim.length_surge is set but lr_scheduler_type="
                          f"{self.lr_scheduler_type!r}: the length_surge options are ignored", stacklevel=2)
        OptimizerConfig.__post_init__(self)


LengthSurgeOptimizerConfig._lrstab_original = FSDPOptimizerConfig  # verl's own class (patches/check_verl.py)


def _plain(options):
    """OmegaConf nodes and BaseConfig mappings to a plain dict (None stays None)."""
    if options is None or isinstance(options, LengthSurgeConfig):
        return options
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(options, DictConfig):
            return OmegaConf.to_container(options, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    return dict(options) if hasattr(options, "keys") else options


# Naming the class as a Hydra _target_ must bring the engine glue along in that process.
from verl_lrstab import verl_plugin as _verl_plugin  # noqa: E402

_verl_plugin.install()
