"""Reading a completion body at the gateway: the field table, nulls, nesting, encodings."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.admin_api import admin_routes
from gateway.api.request_body import parse_body, read_json, requested_model
from gateway.errors import EXCEPTION_HANDLERS, ApiError
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database

ADMIN_KEY = "admin-" + "y" * 40
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, **fields}


def refusal(data: dict[str, Any], endpoint: Any = "chat") -> tuple[int, str | None, str]:
    with pytest.raises(ApiError) as caught:
        parse_body(data, endpoint)
    rejection = caught.value.rejection
    assert rejection.type == "invalid_request_error"
    return rejection.status, rejection.param, rejection.code


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("field", "value"), [("seed", 2**64), ("seed", -(2**70)), ("top_k", 10**20)]
)
def test_the_issue_values_are_refused_at_the_door(endpoint: Any, field: str, value: int) -> None:
    data = {"model": "tiny", "messages": MESSAGES, "prompt": "hi", field: value}
    status, param, code = refusal(data, endpoint)
    assert (status, param) == (400, field)
    assert code.startswith("integer_")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"stop": "s" * 100_000}, "stop"),
        ({"n": 129}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"model": "tiny\x00"}, "model"),
        ({"model": "tiny\x1b[31m"}, "model"),
        ({"model": ""}, "model"),
        ({"model": None}, "model"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"tollway_hint": "G"}, "tollway_hint"),
        ({"tollway_hint": ["small"]}, "tollway_hint"),
    ],
)
def test_bad_fields_are_400_with_their_param(fields: dict[str, Any], param: str) -> None:
    assert refusal(chat(**fields))[:2] == (400, param)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOL_TURNS = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


def test_tool_turns_and_the_developer_role_pass_with_tools() -> None:
    data = chat(messages=TOOL_TURNS, tools=[TOOL], tool_choice="auto", parallel_tool_calls=False)
    body = parse_body(data, "chat")
    assert body.messages == TOOL_TURNS
    assert body.tools == [TOOL]
    assert body.raw["tools"] == [TOOL]  # forwarded as given
    assert "Weather in Paris?" in body.prompt_text
    assert body.prompt_chars > parse_body(chat(messages=TOOL_TURNS), "chat").prompt_chars


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_schema_too_large_for_the_rules_is_400_naming_its_field(endpoint: Any) -> None:
    """Under a body limit raised past it, a 1 MiB schema still meets the field rule."""
    schema = {"type": "object", "description": "d" * (1 << 20)}
    data = {"model": "tiny", "messages": MESSAGES, "prompt": "hi"}
    data["structured_outputs"] = {"json": schema}
    assert refusal(data, endpoint) == (400, "structured_outputs.json", "schema_above_max_length")


@pytest.mark.parametrize("hint", ["small", "large", None])
def test_a_routing_hint_is_small_large_or_not_given(hint: str | None) -> None:
    assert parse_body(chat(tollway_hint=hint), "chat").routing_hint == hint


def test_null_is_not_given_and_not_forwarded() -> None:
    body = parse_body(
        chat(temperature=None, stream=None, max_tokens=None, stream_options=None, n=None),
        "chat",
    )
    assert body.is_stream is False
    assert body.include_usage is False
    assert body.max_tokens is None
    assert body.n == body.num_choices == 1
    assert body.raw == {"model": "tiny", "messages": MESSAGES}
    body = parse_body(chat(stream=True, stream_options={"include_usage": None}), "chat")
    assert (body.is_stream, body.include_usage) == (True, False)
    assert body.raw["stream_options"] == {}


def test_max_completion_tokens_wins_and_edges_pass() -> None:
    body = parse_body(chat(max_tokens=5, max_completion_tokens=7, seed=-(2**63)), "chat")
    assert body.max_tokens == 7
    body = parse_body({"model": "tiny", "prompt": [1, 2], "max_tokens": 2**31 - 1}, "completions")
    assert body.max_tokens == 2**31 - 1
    assert body.prompts == ([1, 2],)


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Once", ("Once",)),
        ("", ("",)),
        (["Once"], ("Once",)),
        (["Once", "Twice", ""], ("Once", "Twice", "")),
        ([5, 6, 7], ([5, 6, 7],)),  # one prompt of token ids
        ([[5, 6], [7]], ([5, 6], [7])),
    ],
)
def test_every_prompt_shape_becomes_its_list_of_prompts(prompt: Any, prompts: Any) -> None:
    body = parse_body({"model": "tiny", "prompt": prompt, "n": 3}, "completions")
    assert body.prompts == prompts
    assert body.n == 3
    assert body.num_choices == 3 * len(prompts)
    assert body.raw["prompt"] == prompt  # forwarded as the client sent it


def test_prompt_text_and_chars_cover_every_prompt() -> None:
    body = parse_body({"model": "tiny", "prompt": ["ab", "cde"]}, "completions")
    assert body.prompt_text == "ab\ncde"
    assert body.prompt_chars == 5
    ids = parse_body({"model": "tiny", "prompt": [[1, 2], [3]]}, "completions")
    assert (ids.prompt_text, ids.prompt_chars) == ("", 0)


@pytest.mark.parametrize(
    ("prompt", "param", "code"),
    [
        (None, "prompt", "missing_required_parameter"),
        ([], "prompt", "empty_array"),
        (["a", [1]], "prompt", "invalid_type"),
        ([1, "a"], "prompt[0]", "invalid_type"),
        ([[]], "prompt[0]", "empty_array"),
        (["p"] * 129, "prompt", "array_above_max_length"),
    ],
)
def test_bad_prompts_are_400_naming_them(prompt: Any, param: str, code: str) -> None:
    data = {"model": "tiny"} if prompt is None else {"model": "tiny", "prompt": prompt}
    assert refusal(data, "completions") == (400, param, code)


def test_n_times_the_prompts_is_bounded() -> None:
    assert parse_body({"model": "tiny", "prompt": ["a"] * 2, "n": 64}, "completions")
    data = {"model": "tiny", "prompt": ["a"] * 2, "n": 65}
    assert refusal(data, "completions") == (400, "n", "invalid_value")


def test_requested_model_is_only_what_a_record_can_hold() -> None:
    assert requested_model({"model": "tiny"}) == "tiny"
    assert requested_model({"model": "tiny\x00"}) == ""
    assert requested_model({"model": 7}) == ""
    assert requested_model({}) == ""


async def _echo(request: Request) -> Response:
    return JSONResponse(await read_json(request, 1 << 20))


@pytest.fixture
async def client(db: Database) -> AsyncIterator[httpx.AsyncClient]:
    routes = [Route("/echo", _echo, methods=["POST"])]
    routes += admin_routes(db, hash_key(ADMIN_KEY), MemoryBudgetLedger())
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        yield c


def nested(depth: int) -> bytes:
    return b'{"name": "t", "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path", ["/echo", "/admin/tenants"])
@pytest.mark.parametrize("depth", [64, 1_000, 20_000])  # admin bodies are capped at 64 KiB
async def test_deeply_nested_json_is_400(client: httpx.AsyncClient, path: str, depth: int) -> None:
    response = await client.post(path, content=nested(depth))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json"
    assert "nested too deeply" in error["message"]


async def test_nesting_under_the_cap_parses(client: httpx.AsyncClient) -> None:
    response = await client.post("/echo", content=nested(62))
    assert response.status_code == 200
    assert response.json()["name"] == "t"


@pytest.mark.parametrize("path", ["/echo", "/admin/tenants"])
async def test_a_duplicated_key_is_400_naming_it(client: httpx.AsyncClient, path: str) -> None:
    response = await client.post(path, content=b'{"name": "t", "x": {"y": 1, "y": 2}}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_json"
    assert "the key 'y' appears more than once" in error["message"]


@pytest.mark.parametrize("content", [b'{"a": NaN}', b'{"a": "\\udc00"}', b"[1]", b"\xff"])
async def test_what_cannot_be_stored_or_is_no_object_is_400(
    client: httpx.AsyncClient, content: bytes
) -> None:
    response = await client.post("/echo", content=content)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


async def test_a_compressed_body_is_415(client: httpx.AsyncClient) -> None:
    payload = json.dumps({"a": 1}).encode()
    for encoding, content in [("gzip", gzip.compress(payload)), ("gzip", payload), ("br", payload)]:
        response = await client.post(
            "/echo", content=content, headers={"content-encoding": encoding}
        )
        assert response.status_code == 415, response.text
        assert response.json()["error"]["code"] == "unsupported_content_encoding"
    plain = await client.post("/echo", content=payload, headers={"content-encoding": "identity"})
    assert plain.json() == {"a": 1}


async def test_a_405_says_what_is_allowed(client: httpx.AsyncClient) -> None:
    response = await client.request("TRACE", "/echo")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
