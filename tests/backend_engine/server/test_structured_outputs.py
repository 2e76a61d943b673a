"""Structured outputs over HTTP on SmolLM2: every answer parses and validates.

For each schema in ``tests/support/json_schemas.py``: greedy and three seeds, plain and
streamed, on /v1/chat/completions (``response_format``) and /v1/completions (the
``structured_outputs`` extension), all sent at once so they share batches. Then the other
forms (json_object, regex, choice, grammar), and bad constraints as 400s while /health answers.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.backend_engine.server.conftest import SMOLLM2_NAME
from tests.backend_engine.server.response_schema import check_answer
from tests.support.json_schemas import PROMPTS, SCHEMAS

SEEDS = (None, 1, 2, 3)  # None: greedy


def _body(endpoint: str, schema_name: str, seed: int | None, stream: bool) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": 0} if seed is None else {"seed": seed}
    body: dict[str, Any] = {"model": SMOLLM2_NAME, "max_tokens": 300, "stream": stream, **sampling}
    schema = SCHEMAS[schema_name]
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPTS[schema_name]}]
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": schema_name, "schema": schema, "strict": True},
        }
    else:
        body["prompt"] = PROMPTS[schema_name] + "\n"
        body["structured_outputs"] = {"json": schema}
    return body


async def _answer(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]
) -> tuple[str, str]:
    """(text, finish_reason) of one request, streamed or not."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    key = "content" if endpoint == "chat" else "text"
    if not body["stream"]:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        check_answer(response.json())
        choice = response.json()["choices"][0]
        return (choice["message"][key] if endpoint == "chat" else choice[key]), choice[
            "finish_reason"
        ]
    text, finish_reason = "", ""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            check_answer(chunk, is_chunk=True)
            for choice in chunk["choices"]:
                piece = choice["delta"].get(key) if endpoint == "chat" else choice[key]
                text += piece or ""
                finish_reason = choice["finish_reason"] or finish_reason
    return text, finish_reason


def test_every_answer_validates_greedy_and_sampled_plain_and_streamed_on_both_endpoints(
    smollm2_url: str,
) -> None:
    cases = [
        (endpoint, name, seed, stream)
        for endpoint in ("chat", "completions")
        for name in SCHEMAS
        for seed in SEEDS
        for stream in (False, True)
    ]

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=smollm2_url, timeout=600) as client:
            return await asyncio.gather(*(_answer(client, c[0], _body(*c)) for c in cases))

    answers = asyncio.run(run())
    for (endpoint, name, seed, stream), (text, finish_reason) in zip(cases, answers, strict=True):
        where = f"{endpoint} {name} seed={seed} stream={stream}: {text!r}"
        assert finish_reason == "stop", where
        jsonschema.validate(
            json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker()
        )
    # Streamed and whole answers are the same answer (greedy, and per seed).
    half = {c: a for c, a in zip(cases, answers, strict=True)}
    for endpoint, name, seed, stream in cases:
        if stream:
            assert half[(endpoint, name, seed, True)] == half[(endpoint, name, seed, False)]


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
            lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t),
        ),
        (
            {"structured_outputs": {"choice": ["red", "green", "blue"]}},
            lambda t: t in ("red", "green", "blue"),
        ),
        (
            {
                "structured_outputs": {
                    "grammar": 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
                }
            },
            lambda t: re.fullmatch(r"The answer is [0-9]+\.", t),
        ),
    ],
)
def test_the_other_forms(smollm2_url: str, constraint: dict[str, Any], check: Any) -> None:
    body = {
        "model": SMOLLM2_NAME,
        "temperature": 0,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": 'Pick a colour, as in {"colour": "red"}.'}],
        **constraint,
    }
    response = httpx.post(f"{smollm2_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    check_answer(response.json())
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert check(choice["message"]["content"]), choice


def test_a_truncated_answer_ends_with_length(smollm2_url: str) -> None:
    body = _body("chat", "order", None, False) | {"max_tokens": 6}
    response = httpx.post(f"{smollm2_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    check_answer(response.json())
    assert response.json()["choices"][0]["finish_reason"] == "length"


def _json_schema(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


BAD_INPUTS: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (fields, the param named, words the message holds)
    "invalid schema": (
        _json_schema({"type": "strin"}),
        "response_format.json_schema.schema",
        "strin",
    ),
    "unsupported keyword": (
        _json_schema({"type": "array", "uniqueItems": True}),
        "response_format.json_schema.schema",
        "uniqueItems",
    ),
    "recursive $ref": (
        _json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        "response_format.json_schema.schema",
        "$ref",
    ),
    "10,000-value enum": (
        _json_schema({"enum": list(range(10_000))}),
        "response_format.json_schema.schema",
        "enum",
    ),
    "1 MiB schema": (
        _json_schema({"type": "object", "description": "x" * (1 << 20)}),
        "response_format.json_schema.schema",
        "maximum length 100000",
    ),
    "exploding regex": (
        {"structured_outputs": {"regex": "((a{100}){100}){100}"}},
        "structured_outputs.regex",
        "1,000,000 copies",
    ),
    "exploding pattern in a tool": (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(x{1000}){1000}"}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "1,000,000 copies",
    ),
    "invalid tool name": (
        {"tools": [{"type": "function", "function": {"name": "get weather!"}}]},
        "tools[0].function.name",
        "pattern",
    ),
    "tool_choice names no given tool": (
        {
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "tool_choice": {"type": "function", "function": {"name": "send_mail"}},
        },
        "tool_choice",
        "send_mail",
    ),
}


def test_bad_constraints_are_400s_naming_the_problem_while_health_answers(smollm2_url: str) -> None:
    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=smollm2_url, timeout=120) as client:
            bad = [
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": SMOLLM2_NAME,
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "Hi"}],
                        **fields,
                    },
                )
                for fields, _, _ in BAD_INPUTS.values()
            ]
            health = [client.get("/health") for _ in range(5)]
            results = await asyncio.gather(*bad, *health)
            return list(results[: len(bad)]), list(results[len(bad) :])

    bad, health = asyncio.run(run())
    assert all(r.status_code == 200 for r in health)
    for (name, (_, param, words)), response in zip(BAD_INPUTS.items(), bad, strict=True):
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", name
        assert error["param"] == param, (name, error)
        assert words in error["message"], (name, error)
