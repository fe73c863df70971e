"""Every node of the run's Ray cluster loads the plugin: checked before a ``length_surge`` run trains.

verl loads the plugin in every process through its ``verl.plugins`` entry point, so a node where
verl-lrstab is not installed runs the actor's workers without it: verl's own optimizer config
then refuses the scheduler's name with a bare assertion. :func:`check_every_node` runs where the
trainer is built (verl's TaskRunner): one tiny task pinned to each live node imports the package
there, finds its entry point and reads ``VERL_USE_EXTERNAL_PLUGINS`` (the job's environment, as verl's
workers get it), and reports its version; a node where verl would not load the plugin refuses the run,
naming the node and why. A one-node cluster is not probed: the trainer's own process has just imported the package
from the environment every process of that node shares.
"""

from __future__ import annotations

import builtins
import logging
import types

from verl_lrstab.glue.failsafe import OPTIM_KEY, SCHEDULER_NAME
from verl_lrstab.glue.steps import GlueError

logger = logging.getLogger("verl_lrstab")

#: Seconds to wait for every node's answer (a node busy starting workers answers in seconds).
PROBE_TIMEOUT_S = 300.0


def _probe() -> dict:
    """Runs on one node, in a Ray worker: whether ``verl_lrstab`` imports there, its version, and whether verl
    loads it there (its ``verl.plugins`` entry point installed, and allowed by ``VERL_USE_EXTERNAL_PLUGINS``)."""
    import importlib
    import os
    import socket
    import sys
    from importlib.metadata import entry_points

    where = {"host": socket.gethostname(), "python": sys.executable}
    try:
        module = importlib.import_module("verl_lrstab")
    except Exception as exc:  # noqa: BLE001 - reported by node
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", **where}
    version = getattr(module, "__version__", "?")
    names = {ep.name for ep in entry_points(group="verl.plugins") if ep.value.split(":")[0] == "verl_lrstab._entry"}
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    allowed = {name.strip() for name in policy.split(",") if name.strip()}
    if not names:
        error = ("verl_lrstab imports, but its verl.plugins entry point is not installed (the package is on a path, "
                 "not installed), so verl never loads the plugin there")
    elif policy == "none" or (policy != "auto" and not names & allowed):
        error = f"VERL_USE_EXTERNAL_PLUGINS={policy} leaves the plugin out (its entry point is {sorted(names)[0]})"
    else:
        return {"ok": True, "version": version, **where}
    return {"ok": False, "error": error, "version": version, **where}


def _by_value(fn):
    """``fn`` as a function of no importable module: Ray ships its code, so a node without the package
    can run it (a function of this module would be shipped by reference and fail to unpickle there)."""
    return types.FunctionType(fn.__code__, {"__builtins__": builtins, "__name__": "verl_lrstab_node_probe"},
                              fn.__name__)


def check_every_node(timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`GlueError` naming each live Ray node where ``import verl_lrstab`` fails (no-op outside Ray)."""
    try:
        import ray
    except ImportError:
        return
    if not ray.is_initialized():
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) <= 1:
        return
    probe = ray.remote(num_cpus=0, max_retries=0)(_by_value(_probe))
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            for node in nodes]
    answers = []
    for node, ref in zip(nodes, refs):
        try:
            answer = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the node could not run the probe at all
            answer = {"ok": False, "error": f"the probe did not run there ({type(exc).__name__}: {exc})"}
        answers.append((node, answer))
    missing = [f"node {_describe(node, answer)}: {answer['error']}" for node, answer in answers if not answer["ok"]]
    if missing:
        raise GlueError(f"verl_lrstab: {OPTIM_KEY}={SCHEDULER_NAME} needs verl-lrstab's plugin on every node of the "
                        f"Ray cluster, and verl cannot load it on {len(missing)} of its {len(nodes)} nodes: "
                        + "; ".join(missing) + ". Install verl-lrstab into the Python environment of every node "
                        "(or into the job's image); runs with a stock scheduler are unaffected.")
    versions = {answer["version"] for _, answer in answers}
    if len(versions) > 1:
        logger.warning("verl_lrstab: the Ray nodes hold different verl-lrstab versions: %s",
                       "; ".join(f"{_describe(node, answer)}: {answer['version']}" for node, answer in answers))


def _describe(node: dict, answer: dict) -> str:
    where = node.get("NodeManagerAddress", "?")
    host = answer.get("host") or node.get("NodeManagerHostname", "")
    return f"{where} ({host}, id {str(node.get('NodeID', ''))[:12]}, {answer.get('python', 'python ?')})"
