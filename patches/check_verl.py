"""``lrstab check-verl`` from a checkout: the checks live in the package (:mod:`verl_lrstab.cli.check_verl`).

Exit status 0 when every check passes; otherwise one line per failed check and status 1.
"""

from __future__ import annotations

import sys

from verl_lrstab.cli.check_verl import checks, run  # noqa: F401 - ``checks`` for the tests that load this file

if __name__ == "__main__":
    sys.exit(run())
