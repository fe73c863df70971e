"""verl's optimizer configs extended to accept ``length_surge``: how the classes are built.

The registry builds them (:func:`make_config`) when it wraps verl's config module; users name them
through :mod:`verl_lrstab.glue.configs` (their public module, a Hydra ``_target_``, which imports
the entry point). This module imports neither, so the registry's import of it closes no circle.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from verl_lrstab.config import OPTIM_KEY, SCHEDULER_NAME, LengthSurgeConfig

logger = logging.getLogger("verl_lrstab")

OPTIM = OPTIM_KEY
STOCK_SCHEDULERS = ("constant", "cosine")
SCHEDULERS = STOCK_SCHEDULERS + (SCHEDULER_NAME,)
# megatron-core's OptimizerParamScheduler.get_lr (0.16, 0.19); anything else raises there at run time.
MEGATRON_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
STYLES = MEGATRON_STYLES + (SCHEDULER_NAME,)
_DEFAULT_STYLES = ("constant", "linear")  # styles that `lr_scheduler_type: length_surge` may override
# verl's FSDP options that length_surge does not read, with the values that mean "not set" (YAML, dataclass).
_UNREAD_FSDP = {"min_lr_ratio": (None, 0.0), "num_cycles": (0.5,), "zero_indexed_step": (True,)}


def plain(options):
    """OmegaConf nodes and mappings to a plain dict (None and LengthSurgeConfig stay as they are)."""
    if options is None or isinstance(options, LengthSurgeConfig):
        return options
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(options, DictConfig):
            return OmegaConf.to_container(options, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    return dict(options) if hasattr(options, "keys") else options


def length_surge_options(options) -> LengthSurgeConfig:
    """The ``length_surge`` node as :class:`LengthSurgeConfig`, refusing what training never reads
    (:meth:`~verl_lrstab.config.LengthSurgeConfig.check_training`), naming the key."""
    return LengthSurgeConfig.from_dict(plain(options)).check_training()


def _no_registry(engine: str) -> None:
    from verl_lrstab.glue.failsafe import check_usable

    check_usable()


def _build_fsdp(base: type, require) -> type:
    @dataclass
    class LengthSurgeOptimizerConfig(base):
        """``FSDPOptimizerConfig`` plus the ``length_surge`` scheduler.

        Args:
            lr_scheduler_type (str): ``"constant"``, ``"cosine"`` (verl's) or ``"length_surge"``.
            length_surge (dict | None): options of the ``length_surge`` scheduler, see
                :class:`verl_lrstab.config.LengthSurgeConfig`; unset keys take the paper's defaults.
        """

        length_surge: Optional[Any] = None

        def __new__(cls, *args, **kwargs):
            name = kwargs.get("lr_scheduler_type", "constant")
            if args or not kwargs or SCHEDULER_NAME in (name, kwargs.get("warmup_style")) or _misspelt(name):
                return super().__new__(cls)
            return _verl_own(base, kwargs, "lr_scheduler_type", name, ("length_surge",))

        def __post_init__(self):
            if self.warmup_style == SCHEDULER_NAME:
                raise ValueError(f"{OPTIM}.warmup_style={SCHEDULER_NAME!r} is not supported: warmup_style is verl's "
                                 f"deprecated alias of lr_scheduler_type; set {OPTIM}.lr_scheduler_type="
                                 f"{SCHEDULER_NAME} and warmup_style=null")
            if self.lr_scheduler_type != SCHEDULER_NAME:
                if self.warmup_style is None and self.lr_scheduler_type not in SCHEDULERS:
                    raise ValueError(f"{OPTIM}.lr_scheduler_type={self.lr_scheduler_type!r} is not supported: "
                                     f"allowed values are {list(SCHEDULERS)}")
                _warn_ignored(self.length_surge, "lr_scheduler_type", self.lr_scheduler_type)
                return super().__post_init__()  # verl's own, unchanged
            require("fsdp")  # the glue usable in this process, driver-side wraps included
            for key, unset in _UNREAD_FSDP.items():
                if getattr(self, key) not in unset:
                    raise ValueError(f"{OPTIM}.{key}={getattr(self, key)!r} is not read by lr_scheduler_type="
                                     f"{SCHEDULER_NAME}: allowed values are {list(unset)} (length_surge reads "
                                     f"its own options under {OPTIM}.length_surge; its floor is min_lr_ratio there)")
            object.__setattr__(self, "length_surge", length_surge_options(self.length_surge))
            object.__setattr__(self, "lr_scheduler_type", "constant")  # the name verl's own checks accept
            try:
                super().__post_init__()
            finally:
                object.__setattr__(self, "lr_scheduler_type", SCHEDULER_NAME)

    return _named(LengthSurgeOptimizerConfig)


def _build_mcore(base: type, require) -> type:
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

        def __new__(cls, *args, **kwargs):
            style = kwargs.get("lr_decay_style", "linear")
            if (args or not kwargs or kwargs.get("lr_scheduler_type") is not None or style == SCHEDULER_NAME
                    or _misspelt(style)):
                return super().__new__(cls)
            return _verl_own(base, kwargs, "lr_decay_style", style, ("length_surge", "lr_scheduler_type"))

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
                require("megatron")
                if self.min_lr != 0.0:
                    raise ValueError(f"{OPTIM}.min_lr={self.min_lr!r} is not read by lr_decay_style={SCHEDULER_NAME}: "
                                     f"allowed values are [0.0] (length_surge's floor is {OPTIM}.length_surge."
                                     "min_lr_ratio x the group's max LR)")
                object.__setattr__(self, "length_surge", length_surge_options(self.length_surge))
                if not self.use_checkpoint_opt_param_scheduler:
                    logger.warning("verl_lrstab: %s.use_checkpoint_opt_param_scheduler set to true for length_surge, "
                                   "so that a resumed run continues its LR schedule and surge detector exactly", OPTIM)
                    object.__setattr__(self, "use_checkpoint_opt_param_scheduler", True)
            else:
                if _misspelt(self.lr_decay_style):
                    raise ValueError(f"{OPTIM}.lr_decay_style={self.lr_decay_style!r} is not supported: allowed "
                                     f"values are {list(STYLES)}")
                _warn_ignored(self.length_surge, "lr_decay_style", self.lr_decay_style)
            super().__post_init__()  # verl's own (it accepts any lr_decay_style)

    return _named(LengthSurgeMcoreOptimizerConfig)


def _misspelt(name) -> bool:
    """Whether the scheduler name ``name`` reads as a misspelt ``length_surge`` (refused naming the allowed
    values, where verl's own check would fail with a bare assertion or not at all)."""
    return name != SCHEDULER_NAME and bool(difflib.get_close_matches(str(name), [SCHEDULER_NAME], n=1, cutoff=0.75))


def _verl_own(base: type, kwargs: dict, key: str, name, ours: tuple):
    """A config that does not name ``length_surge``, built as verl's own class ``base`` by verl's own checks:
    nothing of this package runs with it or travels with it when Ray sends it to a worker (a critic's optim
    on a node without this package, too). Our fields (``ours``) are left out; ``length_surge`` options set
    there are warned about, as they are ignored."""
    _warn_ignored(kwargs.get("length_surge"), key, name, stacklevel=4)
    return base(**{k: v for k, v in kwargs.items() if k not in ours})


def _warn_ignored(options, key: str, name, stacklevel: int = 3) -> None:
    """Warn that ``length_surge`` options (when set) are ignored beside the stock scheduler ``key=name``
    (``stacklevel`` counted from here: the config's caller)."""
    if options:
        warnings.warn(f"{OPTIM}.length_surge is set but {key}={name!r}: the length_surge options are ignored",
                      stacklevel=stacklevel)


def _named(cls: type) -> type:
    cls.__module__ = PUBLIC_MODULE  # pickled by name (Ray sends configs to the workers): see its __getattr__
    cls.__qualname__ = cls.__name__
    return cls


#: Where the classes are named (a Hydra ``_target_``, and what Ray unpickles by name): this module.
PUBLIC_MODULE = "verl_lrstab.glue.configs"
_BUILDERS = {"LengthSurgeOptimizerConfig": ("FSDPOptimizerConfig", _build_fsdp),
             "LengthSurgeMcoreOptimizerConfig": ("McoreOptimizerConfig", _build_mcore)}
_classes: dict = {}


def make_config(name: str, original_cls: type, require=_no_registry) -> type:
    """Our subclass ``name`` of verl's ``original_cls`` (built once; the registry's wrap factory).

    ``require(engine)`` runs when a config names ``length_surge``: the registry passes its
    :func:`~verl_lrstab.glue.registry.require` (refuse the run if the glue cannot serve it here).
    """
    cls = _classes.get(name)
    if cls is None:
        cls = _classes[name] = _BUILDERS[name][1](original_cls, require)
    elif not issubclass(cls, original_cls):
        raise TypeError(f"{name} does not derive from {original_cls!r}")
    return cls


def fsdp_config_checks(module, cls):
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    needed = {"lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps", "warmup_style",
              *_UNREAD_FSDP}
    yield "FSDPOptimizerConfig has the fields the scheduler reads", needed <= fields, sorted(needed - fields)


def mcore_config_checks(module, cls):
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    needed = {"lr", "lr_warmup_init", "lr_warmup_steps", "lr_warmup_steps_ratio", "lr_decay_steps", "lr_decay_style",
              "min_lr", "weight_decay", "weight_decay_incr_style", "total_training_steps",
              "use_checkpoint_opt_param_scheduler"}
    yield "McoreOptimizerConfig has the fields the scheduler reads", needed <= fields, sorted(needed - fields)
