"""The scripted multi-turn rollout's classes, registered with verl on import.

Imported in a process only once verl imports its tool agent loop (``register_when_verl_loads`` of
``verl_lrstab_cpu.agentic``, which describes the rollout): verl's ``register`` keeps the class's import path,
which must be a module-level name. What the classes share with that module comes from :mod:`.agentic_script`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from .agentic_script import AGENT_NAME, PARSER_NAME, TOOL_NAME, TRACE_ENV, WORDS, answer_words, weight_version


@ToolParser.register(PARSER_NAME)
class ScriptedToolParser(ToolParser):
    """Every model turn is one call of the tool (its text is the query): the tiny model cannot write one."""

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return text, [FunctionCall(name=TOOL_NAME, arguments=json.dumps({"query": text[:40]}))]


class ScriptedLookupTool(BaseTool):
    """Answers with :func:`~.agentic_script.answer_words` words for the trajectory's trainer step (its config:
    ``words``, ``growth``, ``grow_from``, ``grow_steps``)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        agent_data = kwargs.get("agent_data")
        step = weight_version(agent_data) + 1
        n = answer_words(step, int(self.config["words"]), float(self.config.get("growth", 1.0)),
                         int(self.config.get("grow_from", 1)), int(self.config.get("grow_steps", 1)))
        if agent_data is not None:
            agent_data.extra_fields["lrstab_tool_words"] = n
        return ToolResponse(text=" ".join(WORDS[i % len(WORDS)] for i in range(n))), 0.0, {}


@register(AGENT_NAME)
class ScriptedToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with :class:`ScriptedToolParser`: the model answers, the tool answers, ... for
    ``multi_turn.max_assistant_turns`` model turns (the response cap may end it sooner)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = ScriptedToolParser(self.tokenizer)
        self.tool_parser_name = PARSER_NAME

    async def run(self, sampling_params, **kwargs):
        output = await super().run(sampling_params, **kwargs)
        trace = os.environ.get(TRACE_ENV)
        if trace:  # the rollout's own record, for checks independent of verl-lrstab's glue
            record = {"version": weight_version(output), "response_tokens": len(output.response_ids),
                      "model_tokens": int(sum(output.response_mask)),
                      "tool_words": output.extra_fields.get("lrstab_tool_words"), "num_turns": output.num_turns}
            Path(trace).mkdir(parents=True, exist_ok=True)
            with open(Path(trace) / f"trajectories_{os.getpid()}.jsonl", "a") as out:
                out.write(json.dumps(record) + "\n")
        return output
