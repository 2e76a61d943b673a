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
from openai_protocol.prompt_rules import MAX_CHOICES as MAX_N
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
    ("n", 2, BOTH),
    ("n", MAX_N, BOTH),
    ("stop", "x" * MAX_STOP_CHARS, BOTH),
    ("stop", ["a", "b", "c", "d"], BOTH),
    ("stop", [], BOTH),
    ("logprobs", True, ("chat",)),
    ("logprobs", 20, ("completions",)),
    ("user", "u" * 256, BOTH),
    ("presence_penalty", 0, BOTH),
    ("presence_penalty", -2, BOTH),
    ("presence_penalty", 2.0, BOTH),
    ("frequency_penalty", 0.0, BOTH),
    ("frequency_penalty", -2.0, BOTH),
    ("frequency_penalty", 1.5, BOTH),
    ("repetition_penalty", 1.0, BOTH),
    ("repetition_penalty", 1e-6, BOTH),
    ("repetition_penalty", 100, BOTH),
    ("logit_bias", {}, BOTH),
    ("logit_bias", {"50256": -100, "0": 100, "7": 0.5}, BOTH),
    ("logit_bias", {"2147483647": 1}, BOTH),
    ("logit_bias", {str(token): 1 for token in range(300)}, BOTH),
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
    ("echo", True, ("completions",)),
    ("best_of", 1, ("completions",)),
    ("suffix", "", ("completions",)),
    ("prompt", "", ("completions",)),
    ("prompt", "Once upon a time", ("completions",)),
    ("prompt", ["a", "b", ""], ("completions",)),
    ("prompt", ["p"] * MAX_N, ("completions",)),
    ("prompt", [1, 2, 3], ("completions",)),
    ("prompt", list(range(5_000)), ("completions",)),  # one prompt: no bound on its items
    ("prompt", [[1, 2], [3]], ("completions",)),
    ("prompt", [[0]] * MAX_N, ("completions",)),
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
    ("n", MAX_N + 1, BOTH, "integer_above_max_value"),
    ("n", 0, BOTH, "integer_below_min_value"),
    ("n", 2.0, BOTH, "invalid_type"),
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
    ("presence_penalty", -2.01, BOTH, "decimal_below_min_value"),
    ("presence_penalty", "0.5", BOTH, "invalid_type"),
    ("frequency_penalty", 2.01, BOTH, "decimal_above_max_value"),
    ("frequency_penalty", -3, BOTH, "decimal_below_min_value"),
    ("frequency_penalty", True, BOTH, "invalid_type"),
    ("repetition_penalty", 0, BOTH, "decimal_below_min_value"),
    ("repetition_penalty", -1.0, BOTH, "decimal_below_min_value"),
    ("repetition_penalty", 100.5, BOTH, "decimal_above_max_value"),
    ("repetition_penalty", "1.1", BOTH, "invalid_type"),
    ("logit_bias", {str(token): 1 for token in range(301)}, BOTH, "invalid_value"),
    ("logit_bias", {"abc": 1}, BOTH, "invalid_value"),
    ("logit_bias", {"-1": 1}, BOTH, "invalid_value"),
    ("logit_bias", {"1.5": 1}, BOTH, "invalid_value"),
    ("logit_bias", {"": 1}, BOTH, "invalid_value"),
    ("logit_bias", {"\u0661": 1}, BOTH, "invalid_value"),  # a digit, but not an ASCII one
    ("logit_bias", {"2147483648": 1}, BOTH, "invalid_value"),
    ("logit_bias", {"1" * 5_000: 1}, BOTH, "invalid_value"),  # past int()'s digit limit
    ("logit_bias", {"50256": 100.5}, BOTH, "decimal_above_max_value"),
    ("logit_bias", {"50256": -101}, BOTH, "decimal_below_min_value"),
    ("logit_bias", {"50256": "-100"}, BOTH, "invalid_type"),
    ("logit_bias", {"50256": True}, BOTH, "invalid_type"),
    ("logit_bias", {"50256": None}, BOTH, "invalid_type"),
    ("logit_bias", [], BOTH, "invalid_type"),
    ("logit_bias", "{}", BOTH, "invalid_type"),
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
    ("echo", "true", ("completions",), "invalid_type"),
    ("best_of", 2, ("completions",), "unsupported_parameter"),
    ("best_of", 1.0, ("completions",), "invalid_type"),
    ("suffix", "end", ("completions",), "unsupported_parameter"),
    ("suffix", 1, ("completions",), "invalid_type"),
    ("prompt", [], ("completions",), "empty_array"),
    ("prompt", 5, ("completions",), "invalid_type"),
    ("prompt", {"text": "a"}, ("completions",), "invalid_type"),
    ("prompt", ["p"] * (MAX_N + 1), ("completions",), "array_above_max_length"),
    ("prompt", [[1]] * (MAX_N + 1), ("completions",), "array_above_max_length"),
    ("prompt", ["a", [1]], ("completions",), "invalid_type"),  # strings and token lists mixed
    ("prompt", [[1], "a"], ("completions",), "invalid_type"),
    ("prompt", [1, "a"], ("completions",), "invalid_type"),  # token ids and strings mixed
    ("prompt", [1, [2]], ("completions",), "invalid_type"),  # token ids and lists mixed
    ("prompt", [[1, "a"]], ("completions",), "invalid_type"),
    ("prompt", [[]], ("completions",), "empty_array"),
    ("prompt", [-1], ("completions",), "invalid_type"),
    ("prompt", [2**31], ("completions",), "invalid_type"),
    ("prompt", [True], ("completions",), "invalid_type"),
    ("prompt", [1.0], ("completions",), "invalid_type"),
    ("prompt", [None], ("completions",), "invalid_type"),
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
    data = {"model": "m", "temperature": None, "stream": True, "stream_options": {"x": None}}
    check_fields(data, "chat")
    assert drop_nulls(data) == {"model": "m", "stream": True, "stream_options": {}}
    check_fields({"prompt": ["a", "b"], "n": None}, "completions")
    check_fields({"stream_options": None}, "chat")
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
def test_stream_options_need_stream(endpoint: Endpoint) -> None:
    options = {"include_usage": True}
    check_fields({"stream": True, "stream_options": options}, endpoint)
    check_fields({"stream": True, "stream_options": {"include_usage": None}}, endpoint)
    for stream in (False, None, "absent"):
        data: dict[str, Any] = {"stream_options": options}
        if stream != "absent":
            data["stream"] = stream
        with pytest.raises(FieldError) as caught:
            check_fields(data, endpoint)
        assert (caught.value.param, caught.value.code) == ("stream_options", "invalid_value")
        assert caught.value.message == (
            "The 'stream_options' parameter is only allowed when 'stream' is enabled."
        )


def test_n_times_the_prompts_is_at_most_the_choice_bound() -> None:
    check_fields({"prompt": ["a"] * 64, "n": 2}, "completions")
    check_fields({"prompt": [[1]] * 2, "n": 64}, "completions")
    check_fields({"prompt": list(range(1_000)), "n": MAX_N}, "completions")  # one prompt
    for prompt in (["a"] * 43, [[1]] * 43):
        with pytest.raises(FieldError) as caught:
            check_fields({"prompt": prompt, "n": 3}, "completions")
        assert (caught.value.param, caught.value.code) == ("n", "invalid_value")
        assert caught.value.message == (
            "Invalid 'n': 3 choices for each of 43 prompts make 129; at most 128 choices per "
            "request."
        )


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("best_of", 3, "Ask for 'n' choices and pick among them"),
        ("suffix", "}", "This server has no fill-in-the-middle."),
    ],
)
def test_best_of_and_suffix_say_why_not(field: str, value: Any, why: str) -> None:
    with pytest.raises(FieldError) as caught:
        check_fields({field: value}, "completions")
    assert caught.value.message.startswith(
        f"Unsupported parameter: '{field}' is not supported on this server. {why}"
    )


def test_logit_bias_names_the_token_it_refuses() -> None:
    with pytest.raises(FieldError) as caught:
        check_fields({"logit_bias": {"12": 1, "x7": 1}}, "chat")
    assert caught.value.param == "logit_bias"
    assert caught.value.message == (
        "Invalid 'logit_bias': 'x7' is not a token id (an integer from 0 to 2147483647, "
        "written as a string)."
    )
    with pytest.raises(FieldError) as caught:
        check_fields({"logit_bias": {"12": -250}}, "chat")
    assert caught.value.param == "logit_bias.12"
    assert caught.value.message == (
        "Invalid 'logit_bias.12': decimal below minimum value. Expected a value >= -100, but "
        "got -250 instead."
    )
    with pytest.raises(FieldError) as caught:
        check_fields({"logit_bias": {str(t): 0 for t in range(301)}}, "chat")
    assert "at most 300 token ids, but got 301" in caught.value.message


MEDIA_PARTS = [
    ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "images"),
    ({"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "files"),
]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
@pytest.mark.parametrize(("part", "media"), MEDIA_PARTS)
def test_media_parts_are_refused_in_every_role(role: str, part: dict[str, Any], media: str) -> None:
    text = {"type": "text", "text": "look"}
    messages = [
        {"role": "user", "content": [text]},
        {"role": role, "content": [text, part], "tool_call_id": "call_1"},
    ]
    with pytest.raises(FieldError) as caught:
        check_fields({"messages": messages}, "chat")
    assert caught.value.param == "messages[1].content[1]"
    assert caught.value.code == "invalid_value"
    assert f"this model takes no {media}" in caught.value.message
    assert f"'{part['type']}'" in caught.value.message


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_text_parts_pass_in_every_role(role: str) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    check_fields({"messages": [{"role": role, "content": parts}]}, "chat")


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
