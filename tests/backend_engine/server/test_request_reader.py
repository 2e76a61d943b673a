"""The engine server refuses what it cannot run with a 400, and takes null as "not given".

A real engine over the tiny demo checkpoint, in process (Starlette's test client runs the
app and its lifespan). The rules themselves are tested in ``test_field_rules.py``; here they
must hold over HTTP: no 500 or 503 for any client input, and the engine keeps serving.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from tests.backend_engine.server.response_schema import check_response

MODEL = "tiny-demo"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about cats."}]


@pytest.fixture(scope="module")
def client(demo_checkpoint: Callable[..., Path]) -> Iterator[TestClient]:
    config = EngineConfig(
        model=str(demo_checkpoint(architecture="LlamaForCausalLM", size="tiny")),
        max_model_len=2048,
        num_kv_blocks=256,
        max_num_seqs=8,
        show_progress=False,
    )
    with TestClient(build_app(AsyncEngine(config, model_name=MODEL))) as test_client:
        test_client.event_hooks = {"response": [check_response]}  # OpenAI's response schema
        yield test_client


def body(path: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": "Tell me about cats."})
    return {**base, **fields}


def assert_400(response: httpx.Response, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    return error


def completion_tokens(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["completion_tokens"] == 4
    choice = answer["choices"][0]
    return [choice["message"]["content"] if "message" in choice else choice["text"]]


ISSUE_VALUES = [("seed", 2**64), ("seed", -(2**70)), ("top_k", 10**20)]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("is_stream", [False, True])
@pytest.mark.parametrize(("field", "value"), ISSUE_VALUES)
def test_the_issue_values_are_400_not_a_failed_engine_step(
    client: TestClient, path: str, is_stream: bool, field: str, value: int
) -> None:
    payload = body(path, stream=is_stream, **{field: value})
    assert_400(client.post(path, content=json.dumps(payload)), field)
    completion_tokens(client.post(path, json=body(path)))  # and the engine still serves


BAD_FIELDS = [
    ("temperature", 2.5, "temperature"),
    ("temperature", "hot", "temperature"),
    ("top_p", 0, "top_p"),
    ("top_k", -2, "top_k"),
    ("seed", 2**63, "seed"),
    ("seed", 0.5, "seed"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 2**40, "max_tokens"),
    ("n", 129, "n"),
    ("n", 0, "n"),
    ("stop", "x" * 100_000, "stop"),
    ("stop", ["a", ""], "stop[1]"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("user", "u" * 1000, "user"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("repetition_penalty", 0, "repetition_penalty"),
    ("logit_bias", {"1": 101}, "logit_bias.1"),
    ("logit_bias", {"512": 5}, "logit_bias"),  # the tiny demo's vocabulary: ids 0 to 511
    ("logit_bias", {"x": 5}, "logit_bias"),
    ("stream_options", {"include_usage": True}, "stream_options"),  # without stream
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage"),
    ("model", "tiny-demo\u0000", "model"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("field", "value", "param"), BAD_FIELDS)
def test_bad_sampling_fields_are_400_with_their_param(
    client: TestClient, path: str, field: str, value: Any, param: str
) -> None:
    assert_400(client.post(path, json=body(path, **{field: value})), param)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (
            CHAT,
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": [{"role": "user", "content": []}]}, "messages"),
        (COMPLETIONS, {"echo": "yes"}, "echo"),
        (COMPLETIONS, {"suffix": "!"}, "suffix"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"best_of": 2}, "best_of"),
    ],
)
def test_what_the_engine_does_not_do_is_refused_not_ignored(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    assert_400(client.post(path, json=body(path, **fields)), param)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_edge_values_work_end_to_end(client: TestClient, path: str) -> None:
    edges = [
        {"seed": -(2**63), "temperature": 1.0},
        {"seed": 2**63 - 1, "temperature": 2.0, "top_p": 1e-9},
        {"top_k": 2**31 - 1, "temperature": 0.5, "seed": 0},
        {"top_k": -1, "stop": ["x" * 1024, "y"], "n": 1, "presence_penalty": 0},
        {"logit_bias": {}, "user": "u" * 256, "frequency_penalty": 0.0},
        {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 100},
        {"logit_bias": {str(t): 100 - 2 * t / 3 for t in range(300)}, "repetition_penalty": 1e-9},
        {"logit_bias": {"511": -100}, "presence_penalty": -2.0, "temperature": 1.0},
    ]
    for fields in edges:
        completion_tokens(client.post(path, json=body(path, **fields)))
    seeded = body(path, seed=-(2**63), temperature=1.0)
    first = completion_tokens(client.post(path, json=seeded))
    assert completion_tokens(client.post(path, json=seeded)) == first


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_null_is_the_default(client: TestClient, path: str) -> None:
    nulls = dict.fromkeys(
        ["temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "user", "logprobs"]
    )
    nulls |= dict.fromkeys(["stream_options", "presence_penalty", "logit_bias", "echo"])
    answer = client.post(path, json=body(path, **nulls))
    default = client.post(path, json=body(path, temperature=None, stream=None))
    assert answer.status_code == default.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")  # stream: null


def nested(depth: int, path: str) -> bytes:
    payload = json.dumps(body(path))
    return payload[:-1].encode() + b', "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/abort_request"])
@pytest.mark.parametrize("depth", [64, 1_000, 100_000])
def test_deeply_nested_json_is_400(client: TestClient, path: str, depth: int) -> None:
    error = assert_400(client.post(path, content=nested(depth, path)), None)
    assert "nested too deeply" in error["message"]


def test_nesting_under_the_cap_is_fine(client: TestClient) -> None:
    completion_tokens(client.post(CHAT, content=nested(62, CHAT)))


def test_a_compressed_body_is_415(client: TestClient) -> None:
    payload = json.dumps(body(CHAT)).encode()
    for encoding, content in [("gzip", gzip.compress(payload)), ("gzip", payload), ("br", payload)]:
        response = client.post(CHAT, content=content, headers={"content-encoding": encoding})
        assert response.status_code == 415, response.text
        assert response.json()["error"]["code"] == "unsupported_content_encoding"
    identity = client.post(CHAT, content=payload, headers={"content-encoding": "identity"})
    completion_tokens(identity)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("TRACE", CHAT, "POST"), ("GET", COMPLETIONS, "POST"), ("TRACE", "/health", "GET, HEAD")],
)
def test_every_405_says_what_is_allowed(
    client: TestClient, method: str, path: str, allowed: str
) -> None:
    response = client.request(method, path)
    assert response.status_code == 405
    assert {m.strip() for m in response.headers["allow"].split(",")} == set(allowed.split(", "))
    assert response.json()["error"]["type"] == "invalid_request_error"
