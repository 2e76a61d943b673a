"""The bounds of every JSON Schema a request carries, in each of the three places one goes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from openai_protocol.field_rules import Endpoint, FieldError, check_fields
from openai_protocol.schema_rules import MAX_ENUM_VALUES, MAX_SCHEMA_CHARS, check_schema

MIB = 1 << 20


def big_schema(num_chars: int) -> dict[str, Any]:
    """An object schema of about ``num_chars`` characters as JSON (many described fields)."""
    description = "d" * 1000
    num_properties = num_chars // len(description) + 1
    properties = {
        f"p{n}": {"type": "string", "description": description} for n in range(num_properties)
    }
    return {"type": "object", "properties": properties}


def enum_schema(num_values: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"enum": [f"v{n}" for n in range(num_values)]}}}


# Where a schema goes: (endpoint, the request fields holding ``schema``, the param it is).
PLACES: list[tuple[Endpoint, Any, str]] = [
    (
        "chat",
        lambda s: {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}
        },
        "response_format.json_schema.schema",
    ),
    (
        "completions",
        lambda s: {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": s}}
        },
        "response_format.json_schema.schema",
    ),
    ("chat", lambda s: {"structured_outputs": {"json": s}}, "structured_outputs.json"),
    ("completions", lambda s: {"structured_outputs": {"json": s}}, "structured_outputs.json"),
    (
        "chat",
        lambda s: {"tools": [{"type": "function", "function": {"name": "f", "parameters": s}}]},
        "tools[0].function.parameters",
    ),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), PLACES)
def test_a_mebibyte_schema_is_refused_naming_its_field(
    endpoint: Endpoint, fields: Any, param: str
) -> None:
    schema = big_schema(MIB)
    assert len(orjson.dumps(schema)) > MIB
    with pytest.raises(FieldError) as caught:
        check_fields({"model": "m", **fields(schema)}, endpoint)
    assert (caught.value.param, caught.value.code) == (param, "schema_above_max_length")
    assert caught.value.message.startswith(f"Invalid '{param}': schema too long.")


@pytest.mark.parametrize(("endpoint", "fields", "param"), PLACES)
def test_ten_thousand_enum_values_are_refused_naming_the_field(
    endpoint: Endpoint, fields: Any, param: str
) -> None:
    schema = enum_schema(10_000)
    assert len(orjson.dumps(schema)) < MAX_SCHEMA_CHARS  # the enum rule, not the size's
    with pytest.raises(FieldError) as caught:
        check_fields({"model": "m", **fields(schema)}, endpoint)
    assert (caught.value.param, caught.value.code) == (param, "schema_above_max_enum_values")
    assert caught.value.message == (
        f"Invalid '{param}': too many enum values. Expected a schema with at most 1000 enum "
        "values in total, but got a schema with 10000 instead."
    )


def test_the_size_is_the_compact_json_length_in_characters() -> None:
    at_cap = {"d": "é" * (MAX_SCHEMA_CHARS - len('{"d":""}'))}  # two bytes each in UTF-8
    check_schema("s", at_cap)
    with pytest.raises(FieldError):
        check_schema("s", {"d": at_cap["d"] + "é"})


def test_enum_values_count_across_the_whole_schema() -> None:
    half = [str(n) for n in range(MAX_ENUM_VALUES // 2)]
    schema = {
        "type": "object",
        "properties": {"a": {"enum": half}, "b": {"type": "array", "items": {"enum": half}}},
    }
    check_schema("s", schema)  # exactly the cap
    for extra in (
        {"$defs": {"c": {"enum": ["x"]}}},
        {"anyOf": [{"enum": ["x"]}, {"type": "null"}]},
        {"properties": {**schema["properties"], "c": {"enum": ["x"]}}},
    ):
        with pytest.raises(FieldError) as caught:
            check_schema("s", {**schema, **extra})
        assert "but got a schema with 1001 instead" in caught.value.message


def test_what_is_data_or_a_name_is_not_an_enum() -> None:
    many = [str(n) for n in range(MAX_ENUM_VALUES + 1)]
    check_schema(
        "s",
        {
            "type": "object",
            "properties": {"enum": {"type": "string"}},  # a property called "enum"
            "default": {"enum": many},
            "examples": [{"enum": many}],
            "const": {"enum": many},
        },
    )


def test_a_boolean_schema_is_a_schema_where_one_may_be() -> None:
    check_schema("s", True)
    with pytest.raises(FieldError) as caught:
        check_schema("s", True, can_be_boolean=False)
    assert caught.value.code == "invalid_type"
