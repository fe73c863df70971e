"""``python -m verl_lrstab.cli``: the ``lrstab`` console script (the e2e tests run it so)."""

import sys

from verl_lrstab.cli import main

sys.exit(main())
