"""The grammar of tool calls: what the model may write for ``tools`` and ``tool_choice``.

(Being written: see the tool-calling task. ``tool_call_constraint`` is the interface.)
"""

from __future__ import annotations

from typing import Any

from backend_engine.structured_output.constraint import OutputConstraint


def tool_call_constraint(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool,
) -> OutputConstraint | None:
    """The constraint for ``tool_choice`` over ``tools`` (OpenAI's JSON shapes), or None for
    ``"none"`` (no tool grammar)."""
    if tool_choice == "none":
        return None
    raise NotImplementedError("tool calling is being built")
