"""A request's output constraint, from whichever field asked for one.

``response_format`` (chat; an extension on completions), ``structured_outputs`` (the
extension: json, regex, choice, grammar) and ``tools`` with ``tool_choice`` (chat) each
become one :class:`OutputConstraint`; the request models refuse two at once.
"""

from __future__ import annotations

from backend_engine.structured_output.constraint import InvalidConstraint, OutputConstraint
from backend_engine.structured_output.tool_grammar import tool_call_constraint
from openai_protocol.request_models import ChatCompletionRequest, ConstrainedRequest


def output_constraint(body: ConstrainedRequest) -> OutputConstraint | None:
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return OutputConstraint.json_object("response_format")
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        return OutputConstraint.json_schema(
            fmt.json_schema.json_schema, "response_format.json_schema.schema"
        )
    extension = body.structured_outputs
    if extension is not None:
        if extension.json_schema is not None:
            return OutputConstraint.json_schema(extension.json_schema, "structured_outputs.json")
        if extension.regex is not None:
            return OutputConstraint.regex(extension.regex, "structured_outputs.regex")
        if extension.choice is not None:
            return OutputConstraint.choice(extension.choice, "structured_outputs.choice")
        if extension.grammar is not None:
            return OutputConstraint.grammar(extension.grammar, "structured_outputs.grammar")
    if isinstance(body, ChatCompletionRequest) and body.tools:
        choice = body.effective_tool_choice
        try:
            return tool_call_constraint(
                body.tool_dicts() or [],
                choice if isinstance(choice, str) else choice.model_dump(),
                body.parallel_tool_calls,
            )
        except ValueError as exc:
            raise InvalidConstraint(f"Invalid 'tools': {exc}", "tools") from None
    return None


def parses_tool_calls(body: ConstrainedRequest) -> bool:
    """Whether the answer is read for tool calls: tools were given and may be called."""
    return (
        isinstance(body, ChatCompletionRequest)
        and bool(body.tools)
        and body.effective_tool_choice != "none"
    )
