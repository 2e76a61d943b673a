"""The grammar of tool calls: what the model may write for ``tools`` and ``tool_choice``.

A Lark grammar in llguidance's dialect over the calls ``model_files.tool_call_syntax`` defines
(the syntax the prompt asks for and the parser reads)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- The name is a literal, one of the tools' names; the arguments are held to that function's
  ``parameters`` JSON Schema (``%json``; a function without parameters, or with ``{}``, takes
  exactly ``{}``; a schema without a ``type`` is made an object's), written on one line with
  the syntax's separators (``"x-guidance"``: ``", "``, ``": "``, no other whitespace).
- Calls are joined by ``CALL_SEPARATOR`` (``"\\n"``), and the answer ends after the last
  call's ``</tool_call>``: EOS is allowed only where the answer may end.

By ``tool_choice``:

=============  ==============================================================================
``none``       no grammar (``None``)
``required``   one or more calls (exactly one when ``parallel_tool_calls`` is false), nothing
               else
a function     exactly one call, of that function
``auto``       either text that holds no ``<tool_call>`` anywhere, or text (which may be empty
               and holds no ``<tool_call>``) followed by calls as for ``required``: whatever
               the model writes then parses, as text or as calls
=============  ==============================================================================
"""

from __future__ import annotations

import json
from typing import Any

from backend_engine.structured_output.constraint import OutputConstraint
from backend_engine.structured_output.json_format import JSON_OPTIONS, closed_objects
from backend_engine.structured_output.regex_size import check_schema_patterns
from model_files import tool_call_syntax as syntax

TOOLS_PARAM = "tools"
# A function without parameters takes no arguments: exactly "{}".
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


# llguidance reads the two separators as regexes: the syntax's are plain punctuation and a space.
def tool_call_constraint(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool,
) -> OutputConstraint | None:
    """The constraint for ``tool_choice`` over ``tools`` (OpenAI's JSON shapes), or None for
    ``"none"`` (no tool grammar)."""
    if tool_choice == "none":
        return None
    return OutputConstraint.grammar(
        tool_call_grammar(tools, tool_choice, parallel_tool_calls), TOOLS_PARAM
    )


def tool_call_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool,
) -> str:
    """The Lark text for ``tool_choice`` other than ``"none"`` (see the module's table)."""
    functions = _functions_by_name(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in 'tools'")
        functions = {name: functions[name]}
        is_parallel = False
        is_auto = False
    elif tool_choice in ("auto", "required"):
        is_parallel = parallel_tool_calls
        is_auto = tool_choice == "auto"
    else:
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}"
        )
    open_tag = _literal(syntax.CALL_OPEN)
    calls = "call_body (SEPARATOR call)*" if is_parallel else "call_body"
    start = f"TEXT | lead {calls}" if is_auto else f"{open_tag} {calls}"
    lines = [
        f"start: {start}",
        "call_body: " + " | ".join(f"function_{n}" for n in range(len(functions))),
    ]
    if is_parallel:
        lines += [
            f"call: {open_tag} call_body",
            f"SEPARATOR: {_literal(syntax.CALL_SEPARATOR)}",
        ]
    if is_auto:
        lines += [
            # Any text without the opening tag (intersected with /(?s:.*)/: valid UTF-8).
            f"TEXT: /(?s:.*)/ & ~(/(?s:.*)/ {open_tag} /(?s:.*)/)",
            # Text up to the first opening tag: lazy, so it ends right there.
            f"lead[lazy]: /(?s:.*)/ {open_tag}",
        ]
    after_open = len(syntax.CALL_OPEN)
    for n, (name, parameters) in enumerate(functions.items()):
        head = syntax.call_head(name)[after_open:]
        lines += [
            f"function_{n}: {_literal(head)} arguments_{n} {_literal(syntax.CALL_TAIL)}",
            f"arguments_{n}: %json {json.dumps(_arguments_schema(parameters))}",
        ]
    return "\n".join(lines) + "\n"


def _functions_by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """Each function's parameters schema by name, in the order given (the first of a name)."""
    functions: dict[str, dict[str, Any] | None] = {}
    for n, tool in enumerate(tools):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str):
            raise ValueError(f"tools[{n}] is not a function with a name")
        functions.setdefault(name, function.get("parameters"))
    if not functions:
        raise ValueError("tool calls need at least one function in 'tools'")
    return functions


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    if parameters:
        check_schema_patterns(parameters)
    schema = closed_objects(dict(parameters)) if parameters else dict(NO_PARAMETERS)
    schema.setdefault("type", "object")
    schema["x-guidance"] = dict(JSON_OPTIONS)
    return schema


def _literal(text: str) -> str:
    """``text`` as a Lark string literal (llguidance reads them as JSON strings, DEL escaped)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
