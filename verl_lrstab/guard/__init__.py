"""``lrstab guard``: keep a verl run alive through a collapse.

:mod:`.plan` holds the decisions as pure functions (the checkpoint plan, the trouble and its
onset, the rollback's overrides); :mod:`.overrides` writes and reads the launch line in Hydra's
grammar; :mod:`.preflight` checks verl's checkpoint folder before a launch; :mod:`.run_state` reads
and checks the run's state file; :mod:`.moves` sets checkpoints aside in an order no fault can
turn into a loss; :mod:`.supervisor` runs verl's ``main_ppo`` and acts on them, under
:mod:`.watchdog`, reading its metrics through :mod:`.metrics`; :mod:`.files` holds the atomic
writes and the run folder's lock, :mod:`.lock` the checkpoint folder's; :mod:`.errors` the guard's error.
"""
