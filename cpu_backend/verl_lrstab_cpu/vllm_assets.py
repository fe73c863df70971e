"""The tiny local assets in the shape vLLM's CPU attention accepts.

vLLM-CPU's attention kernels support head sizes 32, 64, 80, ... only; the tiny model of
:mod:`.assets` has hidden 64 with 4 heads (head size 16). This builds the same assets
(same tokenizer, data, warm start recipe and seed) with 2 attention heads and 1 KV head
(head size 32) into their own directory, so the transformers-backend runs keep theirs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

from . import assets

ENV_VAR = "LRSTAB_VLLM_ASSETS"
VLLM_SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 1}  # head size 64 / 2 = 32


def default_vllm_assets_dir() -> Path:
    """``$LRSTAB_VLLM_ASSETS`` if set, else ``~/.cache/verl_lrstab/assets-vllm``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "verl_lrstab" / "assets-vllm"


@contextlib.contextmanager
def _recipe(**changes):
    """:data:`assets.RECIPE` with ``changes`` while the block runs (its builder reads it at call time)."""
    saved = dict(assets.RECIPE)
    assets.RECIPE.update(changes)
    try:
        yield
    finally:
        assets.RECIPE.clear()
        assets.RECIPE.update(saved)


def build_vllm_assets(root: Optional[os.PathLike] = None, force: bool = False) -> dict[str, str]:
    """Build (or reuse) the vLLM-shaped assets; same return value as :func:`assets.build_assets`."""
    with _recipe(**VLLM_SHAPE):
        return assets.build_assets(root or default_vllm_assets_dir(), force=force)


if __name__ == "__main__":  # python -m verl_lrstab_cpu.vllm_assets [--out DIR] [--force]
    import argparse
    import json

    p = argparse.ArgumentParser(description="build the vLLM-shaped tiny assets")
    p.add_argument("--out", type=Path, default=default_vllm_assets_dir())
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    print(json.dumps(build_vllm_assets(args.out, force=args.force), indent=1))
