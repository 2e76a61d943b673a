"""The one table of request-field rules that the gateway and the engine server both check."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from openai_protocol.field_rules import (
    MAX_STOP_CHARS,
    Endpoint,
    FieldError,
    check_fields,
    drop_nulls,
)
from openai_protocol.json_body import parse_json_object

BOTH: tuple[Endpoint, ...] = ("chat", "completions")

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
    ("response_format", {"type": "text"}, ("chat",)),
    ("tools", [], ("chat",)),
    ("tool_choice", "none", ("chat",)),
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
    ("response_format", {"type": "json_object"}, ("chat",), "unsupported_parameter"),
    ("tools", [{"type": "function"}], ("chat",), "unsupported_parameter"),
    ("tool_choice", "auto", ("chat",), "unsupported_parameter"),
    ("functions", [{"name": "f"}], ("chat",), "unsupported_parameter"),
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
