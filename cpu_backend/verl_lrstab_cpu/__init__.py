"""Opt-in CPU backend for verl 0.9.x: a test and demo backend, not a production engine.

Importing this package registers, through verl's own registries:
  * the ``cpu`` platform (``verl.plugin.platform.PlatformRegistry``), used only
    when ``VERL_PLATFORM=cpu`` is set (:mod:`.platform`);
  * the ``transformers`` rollout (``_ROLLOUT_REGISTRY`` and
    ``RolloutReplicaRegistry``), used only with ``actor_rollout_ref.rollout.name=transformers``
    (:mod:`.rollout`);
  * with ``VERL_PLATFORM=cpu`` only: verl's own ``vllm`` rollout on vLLM's CPU build
    (:mod:`.vllm_rollout`);
  * the OmegaConf resolver ``${lrstab_asset:<model|train|val|root>}`` giving the
    absolute path of the tiny local assets (:mod:`.assets`);
  * once verl imports ``verl.checkpoint_engine``: the ``gloo`` checkpoint engine
    (``CheckpointEngineRegistry``), verl's weight sync between separate actor and rollout
    pools on CPU (:mod:`.gloo_engine`), used only with
    ``actor_rollout_ref.rollout.checkpoint_engine.backend=gloo``;
  * once verl imports its tool agent loop: the ``lrstab_scripted_tools`` agent loop
    (verl's ``register``), its tool parser and tool, a multi-turn rollout (:mod:`.agentic`).

Load it in every verl process (driver, TaskRunner, Ray workers) with
``VERL_USE_EXTERNAL_MODULES=verl_lrstab_cpu`` (verl imports it on ``import verl``;
the variable reaches the workers of a local Ray cluster). Nothing here runs unless
that variable names this package: installing verl-lrstab never switches a GPU run
to CPU.
"""

from __future__ import annotations


def _register_asset_resolver() -> None:
    from pathlib import Path

    from omegaconf import OmegaConf

    from .assets import asset_paths

    def _resolve(key: str) -> str:
        paths = asset_paths()
        if key not in paths:
            raise ValueError(f"${{lrstab_asset:{key}}}: unknown asset {key!r}; allowed: {sorted(paths)}")
        if not Path(paths[key]).exists():
            raise FileNotFoundError(
                f"${{lrstab_asset:{key}}}: {paths[key]} does not exist. Build the assets with "
                f"`python scripts/build_cpu_assets.py --out {paths['root']}` or point LRSTAB_ASSETS at them."
            )
        return paths[key]

    OmegaConf.register_new_resolver("lrstab_asset", _resolve, replace=True)


def register() -> None:
    """Register the CPU platform, the transformers rollout, the asset resolver and the agent loop (idempotent)."""
    from . import platform  # noqa: F401  (the decorator registers it)
    from .rollout import register as register_rollout

    register_rollout()
    from .vllm_rollout import register as register_vllm  # rollout.name=vllm, only when VERL_PLATFORM=cpu

    register_vllm()
    _register_asset_resolver()
    from .agentic import register_when_verl_loads

    register_when_verl_loads()
    from verl_lrstab.glue.imports import when_imported

    from .gloo_engine import register as register_gloo

    when_imported("verl.checkpoint_engine.base", lambda module: register_gloo())


register()
