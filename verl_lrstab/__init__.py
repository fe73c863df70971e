"""verl-lrstab: decay the actor LR when the mean response length surges (arXiv 2602.01826),
and log the training-inference mismatch KL. See README.md and docs/.

Importing this package imports nothing else (its names load on first use) and has no side
effect on verl; verl loads the glue itself through the ``verl.plugins`` entry point
(``verl_lrstab._entry``), which reports a broken module by name instead of failing here.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "SCHEDULER_NAME": "verl_lrstab.config",
    "LengthSurgeConfig": "verl_lrstab.config",
    "SurgeDetector": "verl_lrstab.detector",
    "LengthSurgeSchedule": "verl_lrstab.schedule",
    "ReplayResult": "verl_lrstab.schedule",
    "decay_period_from_surge": "verl_lrstab.schedule",
    "decay_scale": "verl_lrstab.schedule",
    "replay": "verl_lrstab.schedule",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verl_lrstab' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
