"""``python -m verl_lrstab``: the ``lrstab`` command (the same parser, options and exit statuses)."""

import sys

from verl_lrstab.cli import main

if __name__ == "__main__":
    sys.exit(main())
