"""What the scripted multi-turn rollout does, without verl: the names it registers under, the trace variable,
the tool's answer schedule and a trajectory's weight version.

:mod:`.agentic` (the tool config and the registration hook, imported in every process) and
:mod:`.agentic_loop` (verl's classes, imported only where verl runs an agent loop) both take these from here,
so neither module imports the other to read them.
"""

from __future__ import annotations

AGENT_NAME = "lrstab_scripted_tools"
PARSER_NAME = "lrstab_scripted"
TOOL_NAME = "lrstab_lookup"
TRACE_ENV = "LRSTAB_AGENT_TRACE"
#: The words of the tool's answers: in the tiny tokenizer's vocabulary, one or two tokens each.
WORDS = ("the", "number", "first", "second", "result", "sum", "difference", "total", "count", "check")


def answer_words(step: int, words: int, growth: float = 1.0, grow_from: int = 1, grow_steps: int = 1) -> int:
    """The tool's answer length in words at trainer step ``step``: ``words`` up to ``grow_from``, then growing
    linearly to ``growth x words`` over ``grow_steps`` steps, then staying there."""
    done = min(max(step - grow_from, 0), grow_steps) / grow_steps
    return max(1, round(words * (1.0 + (growth - 1.0) * done)))


def weight_version(agent_data) -> int:
    """The weight version the trajectory was sampled with (``global_steps`` of the rollout's first response)."""
    version = (getattr(agent_data, "extra_fields", None) or {}).get("global_steps")
    return int(version) if version is not None else 0
