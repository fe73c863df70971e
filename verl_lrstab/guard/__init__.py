"""``lrstab guard``: keep a verl run alive through a collapse.

:mod:`.plan` holds the decisions as pure functions (the checkpoint plan, the trouble and its
onset, the rollback's overrides); :mod:`.supervisor` runs verl's ``main_ppo`` and acts on them.
"""
