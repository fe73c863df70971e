"""The ``verl.plugins`` entry point: verl imports this in every process on ``import verl``.

Nothing here may break a verl run. verl logs a failing plugin at debug level only, so a
failure to load the glue goes through :func:`verl_lrstab._hooks.report_failure`: one ERROR
naming verl's version and the cause, verl's own code left in place, and a guard armed so
that a config naming ``length_surge`` fails at config time with that cause. Stock configs
(``constant``, ``cosine``) are untouched.
"""


def load() -> None:
    try:
        from verl_lrstab import verl_plugin

        verl_plugin.install()
    except Exception as exc:  # noqa: BLE001 - reported below, verl would swallow it
        from verl_lrstab._hooks import report_failure

        report_failure("verl_lrstab.verl_plugin (the glue module itself)", exc)


load()
