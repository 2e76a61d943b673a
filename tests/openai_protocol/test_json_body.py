"""The shared body parser: duplicated keys are refused wherever they hide, and a body that
only looks like it has one (colons and quotes inside strings) parses."""

from __future__ import annotations

import json

import pytest

from openai_protocol.errors import MAX_ECHOED_ID_CHARS
from openai_protocol.field_rules import FieldError
from openai_protocol.json_body import parse_json_object


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (b'{"max_tokens": 1, "max_tokens": 9999}', "max_tokens"),
        (b'{"a" : 1,\n"a"\t:2}', "a"),
        (
            b'{"model": "m", "stream_options": {"include_usage": true, "include_usage": false}}',
            "include_usage",
        ),
        (b'{"messages": [{"role": "user", "content": "x: \\":", "role": "system"}]}', "role"),
        (b'{"x": [[{"k": 1}], [{"k": 1, "k": 1}]], "prompt": [1, 2, 3]}', "k"),
        (b'{"\\u0061": 1, "a": 2}', "a"),
    ],
)
def test_a_key_given_twice_in_one_object_is_invalid_json_naming_it(body: bytes, key: str) -> None:
    with pytest.raises(FieldError) as raised:
        parse_json_object(body)
    assert raised.value.code == "invalid_json"
    assert f"the key '{key}' appears more than once" in str(raised.value)


def test_a_long_duplicated_key_is_echoed_as_a_bounded_prefix() -> None:
    key = "k" * 10_000
    with pytest.raises(FieldError) as raised:
        parse_json_object(json.dumps({key: 1})[:-1].encode() + f', "{key}": 2}}'.encode())
    message = str(raised.value)
    assert f"'{'k' * MAX_ECHOED_ID_CHARS}...'" in message
    assert len(message) < 200


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "x:y", "b": "\\":", "c": "\\" :", "d": {"a": "{{{"}}',
        b'{"a": {"a": {"a": 1}}, "b": [{"a": 1}, {"a": 1}]}',
        json.dumps({"model": "m", "prompt": list(range(10_000))}).encode(),
        json.dumps({"k": "{" * 100 + ":" * 100, "l": [{"x": 1}] * 10}).encode(),
    ],
)
def test_equal_keys_in_different_objects_and_colons_in_strings_parse(body: bytes) -> None:
    assert parse_json_object(body) == json.loads(body)
