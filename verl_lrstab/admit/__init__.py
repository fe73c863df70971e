"""``lrstab admit``: screen rollout configurations' mismatch at LR 0 before a long run.

:mod:`.verdict` holds the judgement as pure functions over logged figures (the budget, the drift at
LR 0, the verdict, the report's JSON, table and figure); :mod:`.runner` runs each candidate in verl's
real ``main_ppo`` at LR 0 and judges it with them. The command line is ``verl_lrstab.cli.admit``.
"""
