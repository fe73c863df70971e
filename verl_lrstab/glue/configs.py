"""verl's optimizer configs, extended to accept ``length_surge``: the classes, by name and how they are built.

The glue puts :class:`LengthSurgeOptimizerConfig` in place of ``verl.workers.config.FSDPOptimizerConfig``
and :class:`LengthSurgeMcoreOptimizerConfig` in place of ``McoreOptimizerConfig`` (the ``_target_`` of
verl's ``optim/fsdp.yaml`` / ``optim/megatron.yaml``), so the name alone selects the scheduler::

    actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge      # FSDP (Megatron accepts it too)
    actor_rollout_ref.actor.optim.lr_decay_style=length_surge         # Megatron's own key

Both derive from the verl class the glue finds. A config that names another scheduler is built as verl's
own class, by verl's own checks (a misspelt ``length_surge`` is refused naming the allowed values): no
code of this package runs with it, and it reaches a Ray worker without this package (a critic's optim
too). For ``length_surge`` the subclass runs verl's with ``constant`` in its place (verl
asserts the name is one of its own), then restores the name: every other check of verl's applies as
it is; the options node is checked by :class:`~verl_lrstab.config.LengthSurgeConfig`, as training reads
it (:meth:`~verl_lrstab.config.LengthSurgeConfig.check_training`).

The registry builds the classes when it wraps verl's config module
(:mod:`.optimizer_subclasses`, how they are built). They are reached by name here, built on first use (module ``__getattr__``: as a Hydra ``_target_``, and
when Ray unpickles them by name), so that importing this module imports nothing of verl. Naming one
of them as ``_target_`` also works where verl's plugins are disabled (``VERL_USE_EXTERNAL_PLUGINS=none``):
the ``__getattr__`` runs the entry point in its process, at that call, never at import (nothing in the
package imports this module: the registry imports :mod:`.optimizer_subclasses`).
"""

from __future__ import annotations

from verl_lrstab.glue.optimizer_subclasses import _BUILDERS, _classes, length_surge_options, make_config, plain

__all__ = ["length_surge_options", "make_config", "plain"]


def __getattr__(name: str):
    """``LengthSurgeOptimizerConfig`` / ``LengthSurgeMcoreOptimizerConfig`` (also as Hydra ``_target_``).

    Naming one explicitly runs the package's entry point in this process (it may not have run:
    ``VERL_USE_EXTERNAL_PLUGINS=none``), whose hook on verl's config module builds the class.
    """
    if name not in _BUILDERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _classes:
        import importlib

        importlib.import_module("verl_lrstab._entry")
        from verl.workers.config import optimizer

        if name not in _classes:  # the glue failed to load: verl's class with the guard, and the cause
            make_config(name, getattr(optimizer, _BUILDERS[name][0]))
    return _classes[name]
