"""Client input at the gateway, end to end with real engines: what cannot run is a 400 at
the door (never a 500 or a failed engine step), null is "not given", the edges of every
range work, nesting is capped, bodies are uncompressed, and every 405 carries ``Allow``."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_errors import assert_openai_error
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture
def client(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> Iterator[httpx.Client]:
    settings = settings_for(engines, tmp_path / "gw", db_url)
    with httpx.Client(base_url=gateway(settings), timeout=60) as http:
        yield http


def body(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": SMALL, "max_tokens": 3, "ignore_eos": True}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "Tell me about cats."}]
    else:
        base["prompt"] = "Tell me about cats."
    return {**base, **fields}


def post(client: httpx.Client, key: str, path: str, payload: Any, **headers: str) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return client.post(path, content=content, headers={**auth, **headers})


def completed(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_the_issue_values_are_400_at_the_gateway(
    client: httpx.Client, db_url: str, path: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    for field, value in [("seed", 2**64), ("seed", -(2**70)), ("top_k", 10**20)]:
        for is_stream in (False, True):
            response = post(client, key, path, body(path, stream=is_stream, **{field: value}))
            error = assert_openai_error(response, 400, error_code(field, value))
            assert error["param"] == field
            assert error["type"] == "invalid_request_error"
    records = usage_records(db_url, tenant_id, 6)
    assert len(records) == 6
    assert all(r.status.value == "rejected" for r in records)
    completed(post(client, key, path, body(path)))


def error_code(field: str, value: int) -> str:
    return "integer_above_max_value" if value > 0 else "integer_below_min_value"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_edges_and_nulls_work_end_to_end(client: httpx.Client, db_url: str, path: str) -> None:
    _, key = tenant_key(db_url)
    for fields in [
        {"seed": -(2**63), "temperature": 2.0, "top_p": 1e-9},
        {"seed": 2**63 - 1, "temperature": 0.7, "top_k": 2**31 - 1},
        {"stop": ["x" * 1024, "y"], "n": 1, "presence_penalty": 0, "logit_bias": {}},
        {"temperature": None, "stream": None, "top_p": None, "seed": None, "stop": None},
        {"stream_options": None, "user": None, "n": None, "logprobs": None},
    ]:
        response = post(client, key, path, body(path, **fields))
        assert response.status_code == 200, (fields, response.text)
        assert response.headers["content-type"].startswith("application/json")


def test_a_model_name_with_nul_is_refused_at_the_door(client: httpx.Client, db_url: str) -> None:
    tenant_id, key = tenant_key(db_url)
    cases = [
        ("tiny\x00", "invalid_value"),
        ("tiny\nlarge", "invalid_value"),
        ("m" * 201, "string_above_max_length"),
    ]
    for model, code in cases:
        response = post(client, key, CHAT, body(CHAT, model=model))
        assert assert_openai_error(response, 400, code)["param"] == "model"
    records = usage_records(db_url, tenant_id, 3)
    assert [r.requested_model for r in records] == ["", "", ""]
    assert all(r.status.value == "rejected" for r in records)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("depth", [65, 1_000, 50_000])
def test_deeply_nested_json_is_400(
    client: httpx.Client, db_url: str, path: str, depth: int
) -> None:
    _, key = tenant_key(db_url)
    payload = json.dumps(body(path)).encode()[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    error = assert_openai_error(post(client, key, path, payload), 400, "invalid_json")
    assert "nested too deeply" in error["message"]


def test_content_array_must_not_be_empty(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url)
    empty = body(CHAT, messages=[{"role": "user", "content": []}])
    error = assert_openai_error(post(client, key, CHAT, empty), 400, "empty_array")
    assert error["param"] == "messages[0].content"


def test_a_compressed_body_is_415(client: httpx.Client, db_url: str) -> None:
    _, key = tenant_key(db_url)
    payload = json.dumps(body(CHAT)).encode()
    zipped = post(client, key, CHAT, gzip.compress(payload), **{"content-encoding": "gzip"})
    assert_openai_error(zipped, 415, "unsupported_content_encoding")
    plain = post(client, key, CHAT, payload, **{"content-encoding": "gzip"})
    assert_openai_error(plain, 415, "unsupported_content_encoding")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("TRACE", CHAT, {"POST"}),
        ("GET", COMPLETIONS, {"POST"}),
        ("TRACE", "/health", {"GET", "HEAD"}),
    ],
)
def test_every_405_says_what_is_allowed(
    client: httpx.Client, method: str, path: str, allowed: set[str]
) -> None:
    response = client.request(method, path)
    error = assert_openai_error(response, 405, "http_405")
    assert error["type"] == "invalid_request_error"
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOL_TURNS = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


def test_tool_turns_and_the_developer_role_reach_the_engine(
    client: httpx.Client, db_url: str
) -> None:
    """The tools are rendered into the prompt whatever ``tool_choice``; ``none`` keeps the
    answer free text (the tool grammar is the engine's own tests' business)."""
    tenant_id, key = tenant_key(db_url)
    plain = post(client, key, CHAT, body(CHAT, messages=TOOL_TURNS))
    completed(plain)
    with_tools = post(
        client, key, CHAT, body(CHAT, messages=TOOL_TURNS, tools=[TOOL], tool_choice="none")
    )
    completed(with_tools)
    assert with_tools.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    records = usage_records(db_url, tenant_id, 2)
    assert sorted(r.prompt_tokens for r in records) == sorted(
        a.json()["usage"]["prompt_tokens"] for a in (plain, with_tools)
    )


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_schema_past_the_cap_is_400_naming_its_field_under_the_body_limit(
    client: httpx.Client, db_url: str, path: str
) -> None:
    tenant_id, key = tenant_key(db_url)
    schema = {"type": "object", "description": "d" * 200_000}  # 200 kB: a body the gateway reads
    response_format = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    response = post(client, key, path, body(path, response_format=response_format))
    error = assert_openai_error(response, 400, "schema_above_max_length")
    assert error["param"] == "response_format.json_schema.schema"
    enum = {"type": "string", "enum": [str(n) for n in range(10_000)]}
    response = post(client, key, path, body(path, structured_outputs={"json": enum}))
    error = assert_openai_error(response, 400, "schema_above_max_enum_values")
    assert error["param"] == "structured_outputs.json"
    assert all(r.status.value == "rejected" for r in usage_records(db_url, tenant_id, 2))
