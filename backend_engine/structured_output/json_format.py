"""How generated JSON is spaced, for every structured output: one space after ``,`` and ``:``,
on one line, as ``json.dumps`` writes it (and as models write it). No other whitespace is
allowed: flexible whitespace lets a small model loop on blank lines until ``max_tokens``.

Objects are closed to keys their schema does not list (``closed_objects``).

The separators are the tool-call syntax's (``model_files/tool_call_syntax.py``), so a tool
call's arguments and a ``response_format`` answer are spaced alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model_files import tool_call_syntax as syntax

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": syntax.ITEM_SEPARATOR,
    "key_separator": syntax.KEY_SEPARATOR,
    "whitespace_flexible": False,
}

# Keywords whose values are data, not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` but says nothing of others
    (no ``additionalProperties``, no ``patternProperties``) closed to them.

    JSON Schema lets such an object hold any other key, and a grammar that allows them lets a
    small model invent keys until ``max_tokens`` (a LangChain ``function_calling`` schema is
    sent that way). Generating only the declared properties still validates against the
    client's schema, as OpenAI's strict mode and xgrammar's default do. The client's schema
    is not changed: its canonical text keys the cache; this is applied when compiling."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYWORDS else closed_objects(value)
        for key, value in schema.items()
    }
    is_open = "additionalProperties" not in out and "patternProperties" not in out
    if isinstance(out.get("properties"), dict) and is_open:
        out["additionalProperties"] = False
    return out
