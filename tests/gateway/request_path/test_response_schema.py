"""Answers OpenAI's clients can read: every field OpenAI's API reference marks as required is
present (``message.refusal`` and ``logprobs.refusal`` included, as null), the openai SDK's
types accept each answer and chunk, and the check that the request-path tests run on every
answer (`tests.support.schema_checked_app`) does catch one that is not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from starlette.types import Receive, Scope, Send

from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.support.openai_response_schema import (
    check_answer,
    check_event_stream,
    missing_required,
)
from tests.support.schema_checked_app import SchemaCheckedApp
from tests.support.stand_in_stack import tenant_key

CHAT: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "system_fingerprint": "fp_1",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi", "refusal": None},
            "logprobs": {
                "content": [
                    {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}
                ],
                "refusal": None,
            },
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def without(answer: dict[str, Any], *path: str | int) -> dict[str, Any]:
    trimmed = copy.deepcopy(answer)
    parent = trimmed
    for step in path[:-1]:
        parent = parent[step]
    del parent[path[-1]]
    return trimmed


@pytest.mark.parametrize(
    ("path", "missing"),
    [
        (("choices", 0, "message", "refusal"), "choices[0].message.refusal"),
        (("choices", 0, "logprobs", "refusal"), "choices[0].logprobs.refusal"),
        (("choices", 0, "logprobs"), "choices[0].logprobs"),
        (("choices", 0, "finish_reason"), "choices[0].finish_reason"),
        (("choices", 0, "logprobs", "content", 0, "bytes"), "choices[0].logprobs.content[0].bytes"),
        (("usage", "total_tokens"), "usage.total_tokens"),
        (("created",), "created"),
        (("system_fingerprint",), "system_fingerprint"),  # issue #26: every answer has one
    ],
)
def test_a_missing_required_field_is_named(path: tuple[str | int, ...], missing: str) -> None:
    assert missing_required(CHAT, "chat") == []
    assert missing_required(without(CHAT, *path), "chat") == [missing]
    with pytest.raises(AssertionError, match=missing.replace("[", r"\[").replace("]", r"\]")):
        check_answer(without(CHAT, *path), "chat")


def test_the_sdk_types_refuse_a_field_of_the_wrong_kind() -> None:
    check_answer(CHAT, "chat")
    for field, value in [("finish_reason", "done"), ("index", "first")]:
        bad = copy.deepcopy(CHAT)
        bad["choices"][0][field] = value
        with pytest.raises(pydantic.ValidationError):
            check_answer(bad, "chat")
    choice = {"index": 0, "delta": {}, "logprobs": None}
    chunk = {**CHAT, "object": "chat.completion.chunk", "choices": [choice]}
    assert missing_required(chunk, "chat_chunk") == ["choices[0].finish_reason"]
    stream = 'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n'  # not answers: skipped
    assert check_event_stream(stream, "chat_chunk") == []


def test_what_openai_sends_beyond_the_sdk_types_passes_and_nothing_else() -> None:
    """An echoed prompt's null first logprob, a streamed completion's null finish_reason and
    Tollway's abort/error finish reasons pass; any other finish_reason does not."""
    logprobs = {
        "tokens": ["Once", " upon"],
        "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {" upon": -1.5}],
        "text_offset": [0, 4],
    }
    choice = {"index": 0, "text": "Once upon", "logprobs": logprobs, "finish_reason": None}
    chunk = {**CHAT, "object": "text_completion", "choices": [choice]}
    check_answer({**chunk, "usage": None}, "completion_chunk")
    for reason in ("abort", "error", "length"):
        check_answer({**chunk, "choices": [{**choice, "finish_reason": reason}]}, "completion")
    with pytest.raises(pydantic.ValidationError):
        check_answer({**chunk, "choices": [{**choice, "finish_reason": "done"}]}, "completion")
    with pytest.raises(pydantic.ValidationError):  # null only where OpenAI sends it
        check_answer({**chunk, "choices": [choice]}, "completion")


async def test_the_request_path_check_catches_an_answer_without_refusal() -> None:
    async def engine(scope: Scope, receive: Receive, send: Send) -> None:
        body = httpx.Response(200, json=without(CHAT, "choices", 0, "message", "refusal"))
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body.content})

    checked = SchemaCheckedApp(engine)
    transport = httpx.ASGITransport(app=checked)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        await client.post("/v1/chat/completions", json={})
        await client.post("/v1/models", json={})  # not an answer: not checked
    assert len(checked.failures) == 1
    assert "choices[0].message.refusal" in checked.failures[0]


@pytest.fixture
def client(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> httpx.Client:
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    _, key = tenant_key(db_url)
    return httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120)


MESSAGES = [{"role": "user", "content": "Hello"}]


def test_engine_answers_carry_every_required_field(client: httpx.Client) -> None:
    """Through the gateway from the engine: whole and streamed, with and without logprobs,
    one choice and several (each answer is also checked by the ``gateway`` fixture)."""
    chat = {"model": SMALL, "messages": MESSAGES, "max_tokens": 3, "n": 2, "ignore_eos": True}
    answer = client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    check_answer(body, "chat")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
        assert choice["logprobs"]["refusal"] is None
    assert isinstance(body["system_fingerprint"], str)
    assert body["system_fingerprint"]
    streamed = client.post(
        "/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = check_event_stream(streamed.content, "chat_chunk")
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert all(c.system_fingerprint == body["system_fingerprint"] for c in chunks)
    text = {"model": SMALL, "prompt": ["Once", "Twice"], "max_tokens": 2, "logprobs": 1}
    completion = client.post("/v1/completions", json=text)
    assert completion.status_code == 200, completion.text
    check_answer(completion.json(), "completion")
    assert [c["index"] for c in completion.json()["choices"]] == [0, 1]
    streamed = client.post("/v1/completions", json={**text, "stream": True})
    assert check_event_stream(streamed.content, "completion_chunk")
    echoed = client.post("/v1/completions", json={**text, "echo": True, "n": 2})
    assert echoed.status_code == 200, echoed.text
    check_answer(echoed.json(), "completion")
    first = echoed.json()["choices"][0]
    assert first["text"].startswith("Once")
    assert first["logprobs"]["token_logprobs"][0] is None  # the prompt's first token
