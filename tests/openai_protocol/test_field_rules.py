"""The one table of request-field rules that the gateway and the engine server both check."""

from __future__ import annotations

import time
from typing import Any

import jsonschema
import orjson
import pytest

from openai_protocol.field_rules import (
    MAX_STOP_CHARS,
    RULES,
    Endpoint,
    FieldError,
    check_fields,
    drop_nulls,
)
from openai_protocol.json_body import parse_json_object
from openai_protocol.schema_rules import (
    MAX_CHOICES,
    MAX_ENUM_VALUES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
)
from openai_protocol.tool_rules import MAX_TOOLS

BOTH: tuple[Endpoint, ...] = ("chat", "completions")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"name": "weather", "description": "d", "schema": WEATHER, "strict": True}


def tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


TOOL = tool("get_weather", description="The weather in a city", parameters=WEATHER)

# (field, value, endpoints) that must be accepted: the edges of every range.
GOOD: list[tuple[str, Any, tuple[Endpoint, ...]]] = [
    ("temperature", 0, BOTH),
    ("temperature", 2.0, BOTH),
    ("top_p", 1e-9, BOTH),
    ("top_p", 1, BOTH),
    ("top_k", -1, BOTH),
    ("top_k", 2**31 - 1, BOTH),
    ("seed", -(2**63), BOTH),
    ("seed", 2**63 - 1, BOTH),
    ("max_tokens", 1, BOTH),
    ("max_tokens", 2**31 - 1, BOTH),
    ("max_completion_tokens", 1, ("chat",)),
    ("n", 1, BOTH),
    ("stop", "x" * MAX_STOP_CHARS, BOTH),
    ("stop", ["a", "b", "c", "d"], BOTH),
    ("stop", [], BOTH),
    ("logprobs", True, ("chat",)),
    ("logprobs", 20, ("completions",)),
    ("user", "u" * 256, BOTH),
    ("presence_penalty", 0, BOTH),
    ("frequency_penalty", 0.0, BOTH),
    ("logit_bias", {}, BOTH),
    ("response_format", {"type": "text"}, BOTH),
    ("response_format", {"type": "json_object"}, BOTH),
    ("response_format", {"type": "json_schema", "json_schema": JSON_SCHEMA_FORMAT}, BOTH),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a-b_C9"}}, BOTH),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": True}},
        BOTH,
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {**JSON_SCHEMA_FORMAT, "strict": None}},
        BOTH,
    ),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n" * 64}}, BOTH),
    ("structured_outputs", {"json": {"type": "object"}}, BOTH),
    ("structured_outputs", {"json": {"enum": list(range(MAX_ENUM_VALUES))}}, BOTH),
    ("structured_outputs", {"json": False}, BOTH),
    ("structured_outputs", {"regex": "[a-z]+", "choice": None}, BOTH),
    ("structured_outputs", {"regex": "x" * MAX_REGEX_CHARS}, BOTH),
    ("structured_outputs", {"choice": ["yes", "no", ""]}, BOTH),
    ("structured_outputs", {"choice": ["c"] * MAX_CHOICES}, BOTH),
    ("structured_outputs", {"grammar": 'start: "a"'}, BOTH),
    ("structured_outputs", {"grammar": "g" * MAX_GRAMMAR_CHARS}, BOTH),
    ("tools", [], ("chat",)),
    ("tools", [TOOL], ("chat",)),
    ("tools", [{"type": "function", "function": {"name": "f"}}] * MAX_TOOLS, ("chat",)),
    ("tools", [tool("f", description=None, parameters=None, strict=True)], ("chat",)),
    ("tool_choice", "none", ("chat",)),
    ("parallel_tool_calls", False, ("chat",)),
    ("echo", False, ("completions",)),
    ("best_of", 1, ("completions",)),
    ("stream_options", {"include_usage": None}, BOTH),
    ("model", "m" * 200, BOTH),
    ("model", "meta-llama/Llama-3.1-8B-Instruct", BOTH),
    ("unknown_field", {"anything": [1, 2]}, BOTH),  # unknown fields are ignored, as OpenAI does
]

# (field, value, endpoints, code) that must be refused with that code and param.
BAD: list[tuple[str, Any, tuple[Endpoint, ...], str]] = [
    ("seed", 2**64, BOTH, "integer_above_max_value"),  # the issue's
    ("seed", -(2**70), BOTH, "integer_below_min_value"),  # the issue's
    ("seed", float(2**64), BOTH, "integer_above_max_value"),  # as orjson parses 2**64
    ("seed", 2**63, BOTH, "integer_above_max_value"),
    ("seed", -(2**63) - 1, BOTH, "integer_below_min_value"),
    ("seed", 1.5, BOTH, "invalid_type"),
    ("seed", "1", BOTH, "invalid_type"),
    ("top_k", 10**20, BOTH, "integer_above_max_value"),  # the issue's
    ("top_k", float(10**20), BOTH, "integer_above_max_value"),
    ("top_k", -2, BOTH, "integer_below_min_value"),
    ("top_k", True, BOTH, "invalid_type"),
    ("temperature", -0.1, BOTH, "decimal_below_min_value"),
    ("temperature", 2.01, BOTH, "decimal_above_max_value"),
    ("temperature", "hot", BOTH, "invalid_type"),
    ("temperature", False, BOTH, "invalid_type"),
    ("top_p", 0, BOTH, "decimal_below_min_value"),
    ("top_p", 1.5, BOTH, "decimal_above_max_value"),
    ("max_tokens", 0, BOTH, "integer_below_min_value"),
    ("max_tokens", 2**31, BOTH, "integer_above_max_value"),
    ("max_tokens", 10.0, BOTH, "invalid_type"),
    ("max_completion_tokens", -1, ("chat",), "integer_below_min_value"),
    ("n", 2, BOTH, "unsupported_value"),
    ("n", 0, BOTH, "integer_below_min_value"),
    ("stop", "", BOTH, "empty_string"),
    ("stop", ["a", ""], BOTH, "empty_string"),
    ("stop", "x" * (MAX_STOP_CHARS + 1), BOTH, "string_above_max_length"),
    ("stop", "x" * 100_000, BOTH, "string_above_max_length"),
    ("stop", ["a", "b", "c", "d", "e"], BOTH, "array_above_max_length"),
    ("stop", [1], BOTH, "invalid_type"),
    ("stop", 5, BOTH, "invalid_type"),
    ("stream", "yes", BOTH, "invalid_type"),
    ("stream_options", [], BOTH, "invalid_type"),
    ("stream_options", {"include_usage": "yes"}, BOTH, "invalid_type"),
    ("ignore_eos", 1, BOTH, "invalid_type"),
    ("logprobs", 1, ("chat",), "invalid_type"),
    ("logprobs", True, ("completions",), "invalid_type"),
    ("logprobs", 21, ("completions",), "integer_above_max_value"),
    ("top_logprobs", 21, ("chat",), "integer_above_max_value"),
    ("top_logprobs", -1, ("chat",), "integer_below_min_value"),
    ("user", "u" * 257, BOTH, "string_above_max_length"),
    ("user", 7, BOTH, "invalid_type"),
    ("presence_penalty", 2.5, BOTH, "decimal_above_max_value"),
    ("presence_penalty", 0.5, BOTH, "unsupported_value"),
    ("frequency_penalty", -1, BOTH, "unsupported_value"),
    ("logit_bias", {"50256": -100}, BOTH, "unsupported_parameter"),
    ("logit_bias", [], BOTH, "invalid_type"),
    ("response_format", "json", BOTH, "invalid_type"),
    ("response_format", {}, BOTH, "missing_required_parameter"),
    ("response_format", {"type": "xml"}, BOTH, "invalid_value"),
    ("response_format", {"type": 1}, BOTH, "invalid_type"),
    ("response_format", {"type": "json_schema"}, BOTH, "missing_required_parameter"),
    ("response_format", {"type": "json_schema", "json_schema": []}, BOTH, "invalid_type"),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {}},
        BOTH,
        "missing_required_parameter",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "a b"}},
        BOTH,
        "invalid_value",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n" * 65}},
        BOTH,
        "invalid_value",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": ""}},
        BOTH,
        "invalid_value",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n\n"}},
        BOTH,
        "invalid_value",
    ),
    ("response_format", {"type": "json_schema", "json_schema": {"name": 5}}, BOTH, "invalid_type"),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}},
        BOTH,
        "invalid_type",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": []}},
        BOTH,
        "invalid_type",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}},
        BOTH,
        "invalid_type",
    ),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "n", "description": 1}},
        BOTH,
        "invalid_type",
    ),
    ("structured_outputs", [], BOTH, "invalid_type"),
    ("structured_outputs", {}, BOTH, "invalid_value"),
    ("structured_outputs", {"regex": None}, BOTH, "invalid_value"),
    ("structured_outputs", {"regex": "a", "grammar": "b"}, BOTH, "invalid_value"),
    ("structured_outputs", {"regex": "a", "json_object": True}, BOTH, "unknown_parameter"),
    ("structured_outputs", {"json": "{}"}, BOTH, "invalid_type"),
    ("structured_outputs", {"regex": ""}, BOTH, "empty_string"),
    ("structured_outputs", {"regex": "x" * (MAX_REGEX_CHARS + 1)}, BOTH, "string_above_max_length"),
    ("structured_outputs", {"regex": ["a"]}, BOTH, "invalid_type"),
    (
        "structured_outputs",
        {"grammar": "g" * (MAX_GRAMMAR_CHARS + 1)},
        BOTH,
        "string_above_max_length",
    ),
    ("structured_outputs", {"choice": []}, BOTH, "empty_array"),
    ("structured_outputs", {"choice": "yes"}, BOTH, "invalid_type"),
    ("structured_outputs", {"choice": ["yes", 1]}, BOTH, "invalid_type"),
    ("structured_outputs", {"choice": ["c"] * (MAX_CHOICES + 1)}, BOTH, "array_above_max_length"),
    ("tools", {"type": "function"}, ("chat",), "invalid_type"),
    ("tools", [TOOL] * (MAX_TOOLS + 1), ("chat",), "array_above_max_length"),
    ("tools", ["f"], ("chat",), "invalid_type"),
    ("tools", [{"type": "function"}], ("chat",), "missing_required_parameter"),
    ("tools", [{"function": {"name": "f"}}], ("chat",), "missing_required_parameter"),
    (
        "tools",
        [{"type": "code_interpreter", "function": {"name": "f"}}],
        ("chat",),
        "invalid_value",
    ),
    ("tools", [{"type": "function", "function": "f"}], ("chat",), "invalid_type"),
    ("tools", [{"type": "function", "function": {}}], ("chat",), "missing_required_parameter"),
    ("tools", [tool("get weather")], ("chat",), "invalid_value"),
    ("tools", [tool("f" * 65)], ("chat",), "invalid_value"),
    ("tools", [tool("f", description=["d"])], ("chat",), "invalid_type"),
    ("tools", [tool("f", parameters="{}")], ("chat",), "invalid_type"),
    ("tools", [tool("f", parameters=True)], ("chat",), "invalid_type"),
    ("tools", [tool("f", strict="yes")], ("chat",), "invalid_type"),
    ("tool_choice", "any", ("chat",), "invalid_value"),
    ("tool_choice", 1, ("chat",), "invalid_type"),
    ("tool_choice", {"type": "function"}, ("chat",), "missing_required_parameter"),
    ("tool_choice", {"type": "tool", "function": {"name": "f"}}, ("chat",), "invalid_value"),
    ("tool_choice", {"type": "function", "function": {}}, ("chat",), "missing_required_parameter"),
    ("tool_choice", {"type": "function", "function": {"name": 1}}, ("chat",), "invalid_type"),
    ("parallel_tool_calls", "true", ("chat",), "invalid_type"),
    ("functions", [{"name": "f"}], ("chat",), "unsupported_parameter"),
    ("function_call", "auto", ("chat",), "unsupported_parameter"),
    ("echo", True, ("completions",), "unsupported_value"),
    ("best_of", 2, ("completions",), "unsupported_value"),
    ("suffix", "end", ("completions",), "unsupported_parameter"),
    ("model", "", BOTH, "empty_string"),
    ("model", "m" * 201, BOTH, "string_above_max_length"),
    ("model", "tiny\x00", BOTH, "invalid_value"),
    ("model", "tiny\n", BOTH, "invalid_value"),
    ("model", "tiny\x85", BOTH, "invalid_value"),
    ("model", 3, BOTH, "invalid_type"),
]


def _cases(table: list[Any]) -> list[Any]:
    return [
        pytest.param(endpoint, *row, id=f"{endpoint}-{row[0]}-{str(row[1])[:20]}")
        for row in table
        for endpoint in row[2]
    ]


@pytest.mark.parametrize(("endpoint", "field", "value", "endpoints"), _cases(GOOD))
def test_good_values_pass(endpoint: Endpoint, field: str, value: Any, endpoints: Any) -> None:
    check_fields({field: value}, endpoint)


@pytest.mark.parametrize(("endpoint", "field", "value", "endpoints"), _cases(GOOD))
def test_what_a_rule_accepts_its_json_schema_accepts(
    endpoint: Endpoint, field: str, value: Any, endpoints: Any
) -> None:
    """The OpenAPI document lays each rule's keywords over the request models: a value the
    rule accepts must be valid there too (a generated "invalid" request must be refused)."""
    rule = RULES[endpoint].get(field)
    if rule is not None:
        jsonschema.validate(value, rule.json_schema(), cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize(("endpoint", "field", "value", "endpoints", "code"), _cases(BAD))
def test_bad_values_are_refused_with_the_field_as_param(
    endpoint: Endpoint, field: str, value: Any, endpoints: Any, code: str
) -> None:
    with pytest.raises(FieldError) as caught:
        check_fields({"model": "m", field: value}, endpoint)
    assert caught.value.code == code
    assert caught.value.param is not None
    assert caught.value.param.startswith(field)
    assert f"'{field}" in caught.value.message


def test_null_is_not_given() -> None:
    data = {"model": "m", "temperature": None, "stream": None, "stream_options": {"x": None}}
    check_fields(data, "chat")
    assert drop_nulls(data) == {"model": "m", "stream_options": {}}
    plain = {"model": "m", "temperature": 0.5}
    assert drop_nulls(plain) is plain  # nothing to drop: no copy


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"tools": [TOOL, TOOL, TOOL, tool("get weather")]},
            "Invalid 'tools[3].function.name': string does not match pattern. Expected a "
            "string that matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
        ),
        (
            {"tools": [TOOL] * 129},
            "Invalid 'tools': array too long. Expected an array with maximum length 128, but "
            "got an array with length 129 instead.",
        ),
        (
            {"tool_choice": "auto"},
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
            "specified.",
        ),
        (
            {"response_format": {"type": "object"}},
            "Invalid value for 'response_format.type': 'object'. Supported values are: "
            "'json_object', 'json_schema', and 'text'.",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "Missing required parameter: 'response_format.json_schema'.",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "Invalid type for 'tools[0].function.parameters': expected an object, but got an "
            "array instead.",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "Invalid 'structured_outputs': expected exactly one of 'json', 'regex', 'choice' or "
            "'grammar', but got 'regex', 'choice'.",
        ),
        (
            {"structured_outputs": {"pattern": "a"}},
            "Unknown parameter: 'structured_outputs.pattern'.",
        ),
    ],
)
def test_messages_are_in_openai_words(data: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldError) as caught:
        check_fields(data, "chat")
    assert caught.value.message == message


def test_tool_choice_needs_tools_and_names_one_of_them() -> None:
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "f"}}):
        check_fields({"tools": [tool("f")], "tool_choice": choice}, "chat")
    check_fields({"tool_choice": "none"}, "chat")
    check_fields({"tools": [], "tool_choice": "none"}, "chat")
    for tools in (None, []):
        for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
            with pytest.raises(FieldError) as caught:
                check_fields({"tools": tools, "tool_choice": choice}, "chat")
            assert (caught.value.param, caught.value.code) == ("tool_choice", "invalid_value")
    named = {"type": "function", "function": {"name": "g"}}
    with pytest.raises(FieldError) as caught:
        check_fields({"tools": [tool("f")], "tool_choice": named}, "chat")
    assert caught.value.message == (
        "Invalid value for 'tool_choice': function 'g' is not one of the functions in 'tools'."
    )


@pytest.mark.parametrize("endpoint", BOTH)
def test_one_output_constraint_at_most(endpoint: Endpoint) -> None:
    extension = {"regex": "[0-9]+"}
    check_fields({"response_format": {"type": "text"}, "structured_outputs": extension}, endpoint)
    for kind in ("json_object", "json_schema"):
        response_format = {"type": kind, "json_schema": JSON_SCHEMA_FORMAT}
        with pytest.raises(FieldError) as caught:
            check_fields(
                {"response_format": response_format, "structured_outputs": extension}, endpoint
            )
        assert (caught.value.param, caught.value.code) == ("structured_outputs", "invalid_value")


def test_top_logprobs_needs_logprobs() -> None:
    check_fields({"top_logprobs": 0}, "chat")
    check_fields({"top_logprobs": 3, "logprobs": True}, "chat")
    with pytest.raises(FieldError) as caught:
        check_fields({"top_logprobs": 3}, "chat")
    assert caught.value.param == "top_logprobs"


def nested(depth: int) -> bytes:
    """A JSON object whose containers nest ``depth`` deep (the object itself is one)."""
    if depth == 1:
        return b'{"model": "m"}'
    return b'{"model": "m", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize("depth", [1, 2, 63, 64])
def test_json_nested_up_to_the_cap_parses(depth: int) -> None:
    assert parse_json_object(nested(depth))["model"] == "m"


@pytest.mark.parametrize("depth", [65, 1_000, 1_025, 100_000])
def test_json_nested_deeper_is_refused(depth: int) -> None:
    with pytest.raises(FieldError) as caught:
        parse_json_object(nested(depth))
    assert caught.value.code == "invalid_json"
    assert "nested too deeply" in caught.value.message


def test_many_shallow_brackets_are_fine() -> None:
    body = orjson.dumps({"model": "m", "x": [[1]] * 10_000, "y": "[[[[" * 100})
    assert len(parse_json_object(body)["x"]) == 10_000


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b'"text"', b'{"a": NaN}', b'{"a": 1e999}', b'{"a": "\\ud800"}'],
)
def test_what_is_not_a_json_object_is_refused(body: bytes) -> None:
    with pytest.raises(FieldError) as caught:
        parse_json_object(body)
    assert caught.value.code == "invalid_json"
    assert caught.value.param is None


def test_deep_json_is_refused_quickly() -> None:
    body = b"[" * 2_000_000 + b"]" * 2_000_000  # 4 MB, the engine's body cap
    started = time.perf_counter()
    with pytest.raises(FieldError):
        parse_json_object(body)
    assert time.perf_counter() - started < 5.0  # generous: a busy 2-core machine
