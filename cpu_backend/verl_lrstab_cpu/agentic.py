"""A multi-turn, tool-calling rollout for the CPU backend, on verl's own agent-loop machinery.

The tiny model cannot write a tool call, so the decision to call the tool is scripted; everything
else is verl's: :class:`~.agentic_loop.ScriptedToolAgentLoop` is verl's ``ToolAgentLoop`` (its state machine, the
continuous-token builder that appends the tool's answer to the response with ``response_mask`` 0, the
response cap, the padding), registered through verl's own ``register(...)`` as
``actor_rollout_ref.rollout.agent.default_agent_loop=lrstab_scripted_tools``; its tool parser
(:class:`~.agentic_loop.ScriptedToolParser`, registered in verl's ``ToolParser`` registry) reads every model turn as
one call of the tool; the tool (:class:`~.agentic_loop.ScriptedLookupTool`, a verl ``BaseTool``) is loaded by verl from
a tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``, :func:`write_tool_config`)
and answers with as many words as its schedule says for the trainer step.

The trainer step is the rollout's weight version (``global_steps``, which the ``transformers`` rollout
returns with each response: the weights of step ``t`` sample step ``t + 1``).

With ``LRSTAB_AGENT_TRACE=<dir>`` every trajectory is recorded (one JSON line: weight version, response
tokens, the model's own tokens counted from the ``response_mask`` verl's loop built, the tool's answer
words) for checks independent of verl-lrstab's glue.

The names, the trace variable and the answer schedule live in :mod:`.agentic_script`, which both this module
and :mod:`.agentic_loop` import; they are exported here too.

:mod:`.agentic_loop` (the classes) is imported only once verl imports its tool agent loop
(:func:`register_when_verl_loads`): that import is heavy, and most processes never run an agent loop.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .agentic_script import AGENT_NAME, PARSER_NAME, TOOL_NAME, TRACE_ENV, WORDS, answer_words, weight_version

__all__ = ["AGENT_NAME", "PARSER_NAME", "TOOL_NAME", "TRACE_ENV", "WORDS", "answer_words", "weight_version",
           "write_tool_config", "register_when_verl_loads"]


def write_tool_config(path: os.PathLike, words: int, growth: float = 1.0, grow_from: int = 1,
                      grow_steps: int = 1) -> Path:
    """A verl tool config (``multi_turn.tool_config_path``) declaring the scripted tool with its schedule."""
    import yaml

    config = {"tools": [{
        "class_name": "verl_lrstab_cpu.agentic_loop.ScriptedLookupTool",
        "config": {"type": "native", "words": words, "growth": growth, "grow_from": grow_from,
                   "grow_steps": grow_steps},
        "tool_schema": {"type": "function", "function": {
            "name": TOOL_NAME, "description": "Look the question up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "query"}},
                           "required": ["query"]}}},
    }]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def register_when_verl_loads() -> None:
    """Register the agent loop and its parser right after verl imports its tool agent loop (in the process
    that runs the agent loops), so the processes that never run one never import it."""
    from verl_lrstab.glue.imports import when_imported

    when_imported("verl.experimental.agent_loop.tool_agent_loop",
                  lambda module: importlib.import_module("verl_lrstab_cpu.agentic_loop"))
