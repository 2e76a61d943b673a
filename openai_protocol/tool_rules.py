"""What ``tools`` and ``tool_choice`` may hold (chat), in OpenAI's shapes and words.

``tools``: at most ``MAX_TOOLS`` of ``{"type": "function", "function": {"name",
"description", "parameters", "strict"}}``, each name as ``schema_rules.NAME_PATTERN`` allows
and each ``parameters`` a bounded JSON Schema object (``schema_rules.check_schema``).
``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
{"name"}}``; any but ``"none"`` needs ``tools``, and a named function must be one of them
(:func:`check_tool_choice`, across the two fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openai_protocol.field_errors import (
    FieldError,
    check_num_items,
    check_one_of,
    invalid_type,
    missing_parameter,
    object_at,
    optional_of,
)
from openai_protocol.schema_rules import (
    NAME_PATTERN,
    check_name,
    check_schema,
    schema_json_schema,
)

MAX_TOOLS = 128  # OpenAI's
TOOL_CHOICE_MODES = ("none", "auto", "required")
TOOL_TYPES = ("function",)


def _member(param: str, fields: dict[str, Any], key: str) -> Any:
    """A required member of ``fields``: ``null`` is missing."""
    value = fields.get(key)
    if value is None:
        raise missing_parameter(f"{param}.{key}")
    return value


@dataclass(frozen=True)
class Tools:
    def check(self, param: str, value: Any) -> None:
        if not isinstance(value, list):
            raise invalid_type(param, "an array", value)
        check_num_items(param, value, 0, MAX_TOOLS)
        for n, tool in enumerate(value):
            item = f"{param}[{n}]"
            fields = object_at(item, tool)
            check_one_of(f"{item}.type", _member(item, fields, "type"), TOOL_TYPES)
            function = object_at(f"{item}.function", _member(item, fields, "function"))
            where = f"{item}.function"
            check_name(f"{where}.name", _member(where, function, "name"))
            optional_of(f"{where}.description", function.get("description"), str, "a string")
            if function.get("parameters") is not None:
                check_schema(f"{where}.parameters", function["parameters"], can_be_boolean=False)
            optional_of(f"{where}.strict", function.get("strict"), bool, "a boolean")

    def json_schema(self) -> dict[str, Any]:
        function = {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": NAME_PATTERN},
                "description": {"type": ["string", "null"]},
                "parameters": schema_json_schema(can_be_boolean=False),
                "strict": {"type": ["boolean", "null"]},
            },
        }
        tool = {
            "type": "object",
            "required": ["type", "function"],
            "properties": {"type": {"enum": list(TOOL_TYPES)}, "function": function},
        }
        tools = {"type": "array", "maxItems": MAX_TOOLS, "items": tool}
        return {"anyOf": [tools, {"type": "null"}]}


@dataclass(frozen=True)
class ToolChoice:
    def check(self, param: str, value: Any) -> None:
        if isinstance(value, str):
            check_one_of(param, value, TOOL_CHOICE_MODES)
            return
        if not isinstance(value, dict):
            raise invalid_type(param, "a string or an object", value)
        check_one_of(f"{param}.type", _member(param, value, "type"), TOOL_TYPES)
        function = object_at(f"{param}.function", _member(param, value, "function"))
        name = _member(f"{param}.function", function, "name")
        if not isinstance(name, str):
            raise invalid_type(f"{param}.function.name", "a string", name)

    def json_schema(self) -> dict[str, Any]:
        named = {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": list(TOOL_TYPES)},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        }
        return {"anyOf": [{"enum": list(TOOL_CHOICE_MODES)}, named, {"type": "null"}]}


def check_tool_choice(data: Mapping[str, Any]) -> None:
    """A ``tool_choice`` but ``"none"`` needs ``tools``; a named one, a function in them.
    Runs after each field passed its own rule."""
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    tools = data.get("tools")
    if not tools:
        raise FieldError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
            "tool_choice",
            "invalid_value",
        )
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {tool["function"]["name"] for tool in tools}:
            raise FieldError(
                f"Invalid value for 'tool_choice': function '{name}' is not one of the "
                "functions in 'tools'.",
                "tool_choice",
                "invalid_value",
            )
