"""Where the engine server's answers once differed from OpenAI's, over HTTP: a model's card
by id, an unknown model's error, ``refusal`` and ``system_fingerprint`` in every answer,
``stream_options`` without ``stream``, content parts in every role, and the fields OpenAI's
API reference marks as required.

The real engine over the tiny demo checkpoint (``test_app``'s server).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from backend_engine.server.fingerprint import engine_build, system_fingerprint
from tests.backend_engine.server.test_app import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    MODEL_NAME,
    LiveServer,
    assert_openai_error,
    greedy,
    live_server,
    sse_events,
)
from tests.support.openai_response_schema import kind_of, missing_required

__all__ = ["live_server"]  # the fixture, shared with test_app

JSON = dict[str, Any]
FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}")


def answer(server: LiveServer, path: str, body: JSON) -> JSON:
    with server.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: JSON = response.json()
    return result


def chunks(server: LiveServer, path: str, body: JSON) -> list[JSON]:
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with server.client() as client, client.stream("POST", path, json=request) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_a_model_card_by_its_id(live_server: LiveServer) -> None:
    with live_server.client() as client:
        [listed] = client.get("/v1/models").json()["data"]
        card = client.get(f"/v1/models/{MODEL_NAME}")
        unknown = [client.get(f"/v1/models/{name}") for name in ("gpt-17", "org/tiny-demo")]
    assert card.status_code == 200
    assert card.json() == listed
    assert card.json()["id"] == MODEL_NAME
    for response, name in zip(unknown, ("gpt-17", "org/tiny-demo"), strict=True):
        error = assert_openai_error(response, 404, "model_not_found")
        assert error["type"] == "invalid_request_error"
        assert error["message"] == (
            f"The model `{name}` does not exist or you do not have access to it."
        )


@pytest.mark.parametrize(
    ("path", "body"), [(CHAT, greedy(messages=MESSAGES)), (COMPLETIONS, greedy(prompt="Hi"))]
)
def test_an_unknown_model_is_openais_model_not_found(
    live_server: LiveServer, path: str, body: JSON
) -> None:
    with live_server.client() as client:
        response = client.post(path, json={**body, "model": "gpt-17"})
    error = assert_openai_error(response, 404, "model_not_found")
    assert (error["type"], error["param"]) == ("invalid_request_error", "model")
    assert "`gpt-17` does not exist" in error["message"]


def test_chat_answers_carry_refusal_null(live_server: LiveServer) -> None:
    body = greedy(messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1)
    [choice] = answer(live_server, CHAT, body)["choices"]
    assert choice["message"]["refusal"] is None
    assert set(choice["logprobs"]) == {"content", "refusal"}
    assert choice["logprobs"]["refusal"] is None
    assert len(choice["logprobs"]["content"]) == 3
    streamed = [
        c["choices"][0]["logprobs"] for c in chunks(live_server, CHAT, body) if c["choices"]
    ]
    with_logprobs = [lp for lp in streamed if lp is not None]
    assert with_logprobs
    assert all(lp["refusal"] is None for lp in with_logprobs)


def test_every_answer_and_chunk_has_the_engines_system_fingerprint(live_server: LiveServer) -> None:
    engine = live_server.engine
    expected = system_fingerprint(engine_build(), engine.engine.kv_cache.extra_key)
    assert FINGERPRINT.fullmatch(expected)
    answers = [
        answer(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=2)),
        answer(live_server, COMPLETIONS, greedy(prompt="Hi", max_tokens=2)),
        *chunks(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=2, n=2)),
        *chunks(live_server, COMPLETIONS, greedy(prompt=["Hi", "Ho"], max_tokens=2)),
    ]
    assert {a["system_fingerprint"] for a in answers} == {expected}


def test_the_fingerprint_changes_with_the_build_or_the_weights() -> None:
    weights, other_weights = b"\x01" * 16, b"\x02" * 16
    fingerprints = {
        system_fingerprint(build, identity)
        for build in ("0.1.0", "0.1.1")
        for identity in (weights, other_weights)
    }
    assert len(fingerprints) == 4
    assert all(FINGERPRINT.fullmatch(f) for f in fingerprints)
    assert system_fingerprint("0.1.0", weights) == system_fingerprint("0.1.0", weights)


@pytest.mark.parametrize(
    ("path", "body"), [(CHAT, greedy(messages=MESSAGES)), (COMPLETIONS, greedy(prompt="Hi"))]
)
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_need_stream(
    live_server: LiveServer, path: str, body: JSON, stream: bool | None
) -> None:
    request = {**body, "stream": stream, "stream_options": {"include_usage": True}}
    with live_server.client() as client:
        response = client.post(path, json=request)
    error = assert_openai_error(response, 400)
    assert error["param"] == "stream_options"
    assert "only allowed when 'stream' is enabled" in error["message"]


def text_parts(*texts: str) -> list[JSON]:
    return [{"type": "text", "text": text} for text in texts]


TURNS: list[JSON] = [
    {"role": "system", "content": text_parts("You are ", "terse.")},
    {"role": "developer", "content": text_parts("Answer in English.")},
    {"role": "user", "content": text_parts("What is ", "the weather?")},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": text_parts("Sunny", ", 20 C")},
    {"role": "assistant", "content": text_parts("It is sunny.")},
    {"role": "user", "content": text_parts("Thanks!")},
]


def test_content_parts_in_every_role(live_server: LiveServer) -> None:
    body = greedy(messages=TURNS, max_tokens=2)
    [choice] = answer(live_server, CHAT, body)["choices"]
    assert choice["message"]["content"] is not None
    # Parts are joined as one text: the same prompt as the plain strings.
    plain = [
        {**turn, "content": "".join(p["text"] for p in turn["content"])}
        if isinstance(turn["content"], list)
        else turn
        for turn in TURNS
    ]
    usage = answer(live_server, CHAT, greedy(messages=plain, max_tokens=2))["usage"]
    assert answer(live_server, CHAT, body)["usage"]["prompt_tokens"] == usage["prompt_tokens"]


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize("turn", [0, 1, 2, 4, 5])
def test_an_image_part_in_any_role_says_the_model_takes_no_images(
    live_server: LiveServer, turn: int
) -> None:
    messages = [dict(t) for t in TURNS]
    messages[turn]["content"] = [*messages[turn]["content"], IMAGE]
    with live_server.client() as client:
        response = client.post(CHAT, json=greedy(messages=messages))
    error = assert_openai_error(response, 400)
    assert error["param"] == f"messages[{turn}].content[{len(messages[turn]['content']) - 1}]"
    assert "takes no images" in error["message"]


def test_the_required_fields_are_present(live_server: LiveServer) -> None:
    """OpenAI's API reference's required fields, in answers of every shape; and the check
    sees a missing one."""
    chat = greedy(messages=MESSAGES, max_tokens=2, logprobs=True, n=2)
    completion = greedy(prompt=["Hi", "Ho"], max_tokens=2, logprobs=1, echo=True)
    whole = [answer(live_server, CHAT, chat), answer(live_server, COMPLETIONS, completion)]
    streamed = [*chunks(live_server, CHAT, chat), *chunks(live_server, COMPLETIONS, completion)]
    for obj in whole:
        assert missing_required(obj, kind_of(obj, is_chunk=False)) == [], obj
    for obj in streamed:
        assert missing_required(obj, kind_of(obj, is_chunk=True)) == [], obj
    assert [c["message"]["refusal"] for c in whole[0]["choices"]] == [None, None]
    assert [c["logprobs"]["refusal"] for c in whole[0]["choices"]] == [None, None]
    assert whole[0]["usage"]["total_tokens"] > 0
    del whole[0]["choices"][1]["message"]["refusal"]
    del whole[1]["system_fingerprint"]
    assert missing_required(whole[0], "chat") == ["choices[1].message.refusal"]
    assert missing_required(whole[1], "completion") == ["system_fingerprint"]
