"""The figures' optional dependency: matplotlib is the ``plot`` extra, and verl does not bring it.

Where matplotlib does not import, each figure a command would draw is one line naming how to get
it, and the command goes on: its tables, reports and exit status are those of a run with matplotlib
(a screening's candidates all run, a replay still prints its schedule).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable, Optional

INSTALL = "pip install 'verl-lrstab[plot]'"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_plots(figure: str, say: Optional[Callable[[str], None]] = None) -> Optional[ModuleType]:
    """:mod:`verl_lrstab.plots`, or None after one line through ``say`` (default: stderr) saying that
    ``figure`` is not drawn and how to get it. Only a missing matplotlib is turned into that line."""
    try:
        from verl_lrstab import plots
    except ImportError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise  # numpy and pandas are requirements: their absence is a broken install, not an extra
        (say or _stderr)(f"lrstab: {figure} not drawn: figures need matplotlib, which does not import here "
                         f"({err}); {INSTALL}")
        return None
    return plots
