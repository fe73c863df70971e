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
    "CusumDetector": "verl_lrstab.cusum",
    "RatioDetector": "verl_lrstab.ratio",
    "LengthSurgeSchedule": "verl_lrstab.detectors",
    "UpdateFigures": "verl_lrstab.detectors",
    "LengthSurgeLR": "verl_lrstab.scheduler",
    "ReplayResult": "verl_lrstab.log_replay",
    "replay": "verl_lrstab.log_replay",
    "decay_period_from_surge": "verl_lrstab.decay",
    "decay_scale": "verl_lrstab.decay",
}
#: Names kept for code written before a rename: ``SurgeDetector`` is the ratio rule's ``RatioDetector``.
_ALIASES = {"SurgeDetector": "RatioDetector"}

__all__ = [*_EXPORTS, *_ALIASES, "__version__"]


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _EXPORTS:
        raise AttributeError(f"module 'verl_lrstab' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[target]), target)
