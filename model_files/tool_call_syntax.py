"""How a model writes a tool call, defined once.

The prompt that asks for calls (``chat_rendering``), the grammar that holds the model to them
(``backend_engine.structured_output.tool_grammar``) and the parser that reads them back
(``backend_engine.text.tool_call_parser``) all build on these constants, so the three cannot
drift apart. The format is Hermes' (Qwen2.5, Hermes 2/3 and SmolLM3 are trained on it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"city": "Paris"}}
    </tool_call>

One call is ``call_head(name) + <arguments, a JSON object> + CALL_TAIL``; calls follow each
other joined by ``CALL_SEPARATOR``. JSON is written with ``", "`` between items and ``": "``
between a key and its value, on one line (``JSON_SEPARATORS``), as ``json.dumps`` writes it
by default. No raw newline can occur inside one-line JSON (a string escapes it), so the first
``CALL_TAIL`` after a head ends that call's arguments.
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"  # between one call's CALL_TAIL and the next call's CALL_OPEN
ITEM_SEPARATOR = ", "
KEY_SEPARATOR = ": "
JSON_SEPARATORS = (ITEM_SEPARATOR, KEY_SEPARATOR)
NAME_KEY = "name"
ARGUMENTS_KEY = "arguments"

# What follows the arguments object: the call object's own "}", then the closing tag.
CALL_TAIL = "}\n" + CALL_CLOSE


def json_text(value: Any) -> str:
    """``value`` as JSON on one line, in the separators above (non-ASCII kept as is)."""
    return json.dumps(value, ensure_ascii=False, separators=JSON_SEPARATORS)


def head_prefix() -> str:
    """A call's head up to its name's JSON string: ``<tool_call>\\n{"name": ``."""
    return f"{CALL_OPEN}\n{{{json_text(NAME_KEY)}{KEY_SEPARATOR}"


def head_suffix() -> str:
    """What follows the name's JSON string, up to the arguments: ``, "arguments": ``."""
    return f"{ITEM_SEPARATOR}{json_text(ARGUMENTS_KEY)}{KEY_SEPARATOR}"


def call_head(name: str) -> str:
    """Everything of a call before its arguments:
    ``<tool_call>\\n{"name": "get_weather", "arguments": ``."""
    return head_prefix() + json_text(name) + head_suffix()


def call_text(name: str, arguments_json: str) -> str:
    """One whole call, its arguments given as JSON text (written as they are)."""
    return call_head(name) + arguments_json + CALL_TAIL


def calls_text(calls: list[tuple[str, str]]) -> str:
    """Several ``(name, arguments_json)`` calls, as a turn writes them."""
    return CALL_SEPARATOR.join(call_text(name, arguments) for name, arguments in calls)


def call_instruction() -> str:
    """The call's shape as the prompt shows it, with placeholders for the two values."""
    return f"{head_prefix()}<function-name>{head_suffix()}<args-json-object>{CALL_TAIL}"
