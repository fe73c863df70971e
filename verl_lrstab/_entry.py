"""The ``verl.plugins`` entry point: verl imports this in every process on ``import verl``.

verl logs a failing plugin at debug level only, so a failure here is reported loudly
and leaves a guard: a config that names ``length_surge`` then fails with the cause,
instead of verl's bare assertion.
"""

import logging


def load() -> None:
    try:
        from verl_lrstab import verl_plugin

        verl_plugin.install()
    except Exception as exc:  # noqa: BLE001 - reported below, verl would swallow it
        logging.getLogger("verl_lrstab").error("verl-lrstab failed to load; lr_scheduler_type=length_surge will not "
                                               "work in this process: %r", exc, exc_info=True)
        _guard_config(exc)


def _guard_config(cause: BaseException) -> None:
    """Make ``FSDPOptimizerConfig(lr_scheduler_type='length_surge')`` raise with ``cause``."""

    def guard(module):
        cls = module.FSDPOptimizerConfig
        original = cls.__post_init__

        def __post_init__(self):
            if self.lr_scheduler_type == "length_surge":
                raise RuntimeError("actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge needs the "
                                   f"verl-lrstab plugin, which failed to load in this process: {cause!r}") from cause
            original(self)

        cls.__post_init__ = __post_init__

    from verl_lrstab._hooks import when_imported

    when_imported("verl.workers.config", guard)


load()
