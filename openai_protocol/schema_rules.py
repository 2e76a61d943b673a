"""What an output constraint may hold: ``response_format``, ``structured_outputs`` and the
bounds of every JSON Schema a request carries.

A request may constrain its output in one of two fields (the request models refuse both at
once, and so does ``field_rules.check_fields``):

- ``response_format`` (OpenAI's; an extension on /v1/completions):
  ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "description",
  "schema", "strict"}}``;
- ``structured_outputs`` (Tollway's extension, as vLLM's): exactly one of ``json`` (a JSON
  Schema), ``regex``, ``choice`` (strings) or ``grammar`` (a Lark grammar).

Every JSON Schema (these two and each tool's ``parameters``) is bounded here, once, as
OpenAI bounds the schemas it takes: the engine compiles each distinct one into a grammar,
so its size bounds that work. ``check_schema`` is the one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from openai_protocol.field_errors import (
    FieldError,
    check_length,
    check_num_items,
    check_one_of,
    invalid_type,
    missing_parameter,
    object_at,
    optional_of,
    unknown_parameter,
)

# A schema serialized as compact JSON. OpenAI caps a schema's property names, definition
# names, enum and const strings at 120,000 characters in all; a whole schema of 100,000
# characters is of that order, far above real tool and response schemas (a few thousand
# characters), and keeps what one request makes the engine's grammar compiler read bounded
# well below the gateway's 1 MiB body.
MAX_SCHEMA_CHARS = 100_000
MAX_ENUM_VALUES = 1_000  # in all of one schema's enums: OpenAI's limit
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1_000
# ``^[a-zA-Z0-9_-]{1,64}$``: a function's or a response format's name (OpenAI's pattern).
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"
_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

RESPONSE_FORMAT_TYPES = ("json_object", "json_schema", "text")  # OpenAI's message order
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar")

# Keywords whose value is data, not a schema (enum values are counted, not walked), and those
# whose value maps names to schemas (a property called "enum" is a schema, not an enum).
_DATA_KEYWORDS = frozenset({"const", "default", "examples"})
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def check_name(param: str, value: Any) -> None:
    """A name as OpenAI's ``NAME_PATTERN`` allows: 1 to 64 letters, digits, ``_`` or ``-``."""
    if not isinstance(value, str):
        raise invalid_type(param, "a string", value)
    if not 1 <= len(value) <= 64 or not _NAME_CHARACTERS.issuperset(value):
        raise FieldError(
            f"Invalid '{param}': string does not match pattern. Expected a string that "
            f"matches the pattern '{NAME_PATTERN}'.",
            param,
            "invalid_value",
        )


def check_schema(param: str, value: Any, *, can_be_boolean: bool = True) -> None:
    """A JSON Schema: an object (or ``true``/``false``), at most ``MAX_SCHEMA_CHARS`` as
    compact JSON, with at most ``MAX_ENUM_VALUES`` enum values in all."""
    if isinstance(value, bool) and can_be_boolean:
        return
    if not isinstance(value, dict):
        raise invalid_type(param, "an object" + (" or a boolean" if can_be_boolean else ""), value)
    num_chars = _serialized_chars(value)
    if num_chars > MAX_SCHEMA_CHARS:
        raise FieldError(
            f"Invalid '{param}': schema too long. Expected a schema with maximum length "
            f"{MAX_SCHEMA_CHARS} characters as JSON, but got a schema with length "
            f"{num_chars} instead.",
            param,
            "schema_above_max_length",
        )
    num_values = _num_enum_values(value)
    if num_values > MAX_ENUM_VALUES:
        raise FieldError(
            f"Invalid '{param}': too many enum values. Expected a schema with at most "
            f"{MAX_ENUM_VALUES} enum values in total, but got a schema with {num_values} "
            "instead.",
            param,
            "schema_above_max_enum_values",
        )


def schema_json_schema(*, can_be_boolean: bool = True) -> dict[str, Any]:
    kinds = ["object", "boolean"] if can_be_boolean else ["object"]
    return {"type": [*kinds, "null"]}


def _serialized_chars(schema: dict[str, Any]) -> int:
    try:
        return len(orjson.dumps(schema).decode("utf-8"))
    except TypeError:  # an integer past 64 bits (not from orjson's parser): near enough
        return len(repr(schema))


def _num_enum_values(schema: dict[str, Any]) -> int:
    """Values in all the ``enum`` keywords of ``schema`` and its subschemas (no recursion:
    the body's depth cap bounds the stack, not Python's)."""
    total = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, child in node.items():
                if key == "enum":
                    total += len(child) if isinstance(child, list) else 0
                elif key in _NAMED_SCHEMAS and isinstance(child, dict):
                    stack.extend(child.values())
                elif key not in _DATA_KEYWORDS:
                    stack.append(child)
    return total


@dataclass(frozen=True)
class ResponseFormat:
    """``response_format``: a type, and for ``json_schema`` a named, bounded schema."""

    def check(self, param: str, value: Any) -> None:
        fields = object_at(param, value)
        if fields.get("type") is None:
            raise missing_parameter(f"{param}.type")
        check_one_of(f"{param}.type", fields["type"], RESPONSE_FORMAT_TYPES)
        spec = fields.get("json_schema")
        if spec is None:
            if fields["type"] == "json_schema":
                raise missing_parameter(f"{param}.json_schema")
            return
        spec = object_at(f"{param}.json_schema", spec)
        if spec.get("name") is None:
            raise missing_parameter(f"{param}.json_schema.name")
        check_name(f"{param}.json_schema.name", spec["name"])
        optional_of(f"{param}.json_schema.description", spec.get("description"), str, "a string")
        optional_of(f"{param}.json_schema.strict", spec.get("strict"), bool, "a boolean")
        if spec.get("schema") is not None:
            check_schema(f"{param}.json_schema.schema", spec["schema"])

    def json_schema(self) -> dict[str, Any]:
        spec = {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": NAME_PATTERN},
                "description": {"type": ["string", "null"]},
                "schema": schema_json_schema(),
                "strict": {"type": ["boolean", "null"]},
            },
        }
        response_format = {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": list(RESPONSE_FORMAT_TYPES)},
                "json_schema": {"anyOf": [spec, {"type": "null"}]},
            },
        }
        return {"anyOf": [response_format, {"type": "null"}]}


@dataclass(frozen=True)
class StructuredOutputs:
    """``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``."""

    def check(self, param: str, value: Any) -> None:
        fields = object_at(param, value)
        for key in fields:
            if key not in STRUCTURED_OUTPUT_KINDS:
                raise unknown_parameter(f"{param}.{key}")
        given = [key for key in STRUCTURED_OUTPUT_KINDS if fields.get(key) is not None]
        if len(given) != 1:
            got = ", ".join(f"'{key}'" for key in given) if given else "none"
            raise FieldError(
                f"Invalid '{param}': expected exactly one of 'json', 'regex', 'choice' or "
                f"'grammar', but got {got}.",
                param,
                "invalid_value",
            )
        (kind,) = given
        item, constraint = f"{param}.{kind}", fields[kind]
        if kind == "json":
            check_schema(item, constraint)
        elif kind == "choice":
            if not isinstance(constraint, list):
                raise invalid_type(item, "an array of strings", constraint)
            check_num_items(item, constraint, 1, MAX_CHOICES)
            for n, choice in enumerate(constraint):
                if not isinstance(choice, str):
                    raise invalid_type(f"{item}[{n}]", "a string", choice)
        else:
            if not isinstance(constraint, str):
                raise invalid_type(item, "a string", constraint)
            check_length(item, constraint, 1, _MAX_TEXT_CHARS[kind])

    def json_schema(self) -> dict[str, Any]:
        def text(max_chars: int) -> dict[str, Any]:
            return {"type": ["string", "null"], "minLength": 1, "maxLength": max_chars}

        choice = {
            "type": ["array", "null"],
            "minItems": 1,
            "maxItems": MAX_CHOICES,
            "items": {"type": "string"},
        }
        extension = {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "json": schema_json_schema(),
                "regex": text(MAX_REGEX_CHARS),
                "choice": choice,
                "grammar": text(MAX_GRAMMAR_CHARS),
            },
        }
        return {"anyOf": [extension, {"type": "null"}]}


_MAX_TEXT_CHARS = {"regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}


def check_one_constraint(data: Mapping[str, Any]) -> None:
    """``structured_outputs`` and a ``response_format`` other than text are not both given."""
    response_format = data.get("response_format")
    is_formatted = isinstance(response_format, dict) and response_format.get("type") != "text"
    if is_formatted and data.get("structured_outputs") is not None:
        raise FieldError(
            "Invalid 'structured_outputs': give either 'response_format' (of type "
            "'json_object' or 'json_schema') or 'structured_outputs', not both.",
            "structured_outputs",
            "invalid_value",
        )
