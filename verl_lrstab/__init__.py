"""verl-lrstab: decay the actor LR when the mean response length surges (arXiv 2602.01826),
and log the training-inference mismatch KL. See README.md.

Importing this package has no side effect on verl; verl loads the glue itself through the
``verl.plugins`` entry point (``verl_lrstab._entry``).
"""

from verl_lrstab.config import SCHEDULER_NAME, LengthSurgeConfig
from verl_lrstab.detector import SurgeDetector
from verl_lrstab.schedule import LengthSurgeSchedule, ReplayResult, decay_period_from_surge, decay_scale, replay

__version__ = "0.1.0"

__all__ = [
    "SCHEDULER_NAME",
    "LengthSurgeConfig",
    "LengthSurgeSchedule",
    "ReplayResult",
    "SurgeDetector",
    "decay_period_from_surge",
    "decay_scale",
    "replay",
    "__version__",
]
