#!/usr/bin/env python
"""Build the tiny local assets of the CPU path (tokenizer, Qwen2 model, arithmetic parquet).

Usage: python scripts/build_cpu_assets.py [--out DIR] [--force]

DIR defaults to $LRSTAB_ASSETS, else <repo>/.assets. Prints the paths as JSON; point the
configs at them with ``LRSTAB_ASSETS=DIR`` (configs/cpu_demo.yaml reads ${lrstab_asset:...}).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from verl_lrstab_cpu.assets import ENV_VAR, build_assets
from verl_lrstab_cpu.launch import REPO_ROOT


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get(ENV_VAR, REPO_ROOT / ".assets")))
    p.add_argument("--force", action="store_true", help="rebuild even if the assets are current")
    args = p.parse_args(argv)
    start = time.monotonic()
    paths = build_assets(args.out, force=args.force)
    print(json.dumps({**paths, "seconds": round(time.monotonic() - start, 1)}, indent=1))


if __name__ == "__main__":
    main()
