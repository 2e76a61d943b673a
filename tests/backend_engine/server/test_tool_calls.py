"""Tool calls over HTTP on SmolLM2: every call the engine returns is one of the tools, with
arguments that validate against that function's ``parameters``.

Every request (forced calls greedy and seeded, plain and streamed, auto mode, and a round trip
that answers a call with a tool result) is sent at once by one module fixture so they share
batches; the tests then check what came back.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer
from tests.backend_engine.server.conftest import SMOLLM2_NAME
from tests.backend_engine.server.response_schema import check_answer

pytest.importorskip("torch", reason="SmolLM2's engine needs torch")

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
BOOKING_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "restaurant": {"type": "string", "minLength": 1, "maxLength": 20},
        "party": {
            "type": "object",
            "properties": {
                "adults": {"type": "integer", "minimum": 1, "maximum": 10},
                "children": {"type": "integer", "minimum": 0, "maximum": 5},
            },
            "required": ["adults"],
            "additionalProperties": False,
        },
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
    },
    "required": ["restaurant", "party"],
    "additionalProperties": False,
}
CURRENCY = {"enum": ["EUR", "USD", "GBP"]}
MONEY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "amount": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "from": CURRENCY,
        "to": CURRENCY,
    },
    "required": ["amount", "from", "to"],
    "additionalProperties": False,
}
PARAMETERS = {
    "get_weather": WEATHER_PARAMETERS,
    "book_table": BOOKING_PARAMETERS,
    "convert_currency": MONEY_PARAMETERS,
}
DESCRIPTIONS = {
    "get_weather": "The weather forecast for a city",
    "book_table": "Book a table at a restaurant",
    "convert_currency": "Convert an amount of money between currencies",
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": DESCRIPTIONS[name], "parameters": parameters},
    }
    for name, parameters in PARAMETERS.items()
]

WEATHER = "What is the weather in Paris, in celsius, for the next 3 days?"
BOOKING = "Book a table at Chez Marie for 2 adults and 1 child at 19:30."
BOTH = "What is the weather in Rome, and can you book a table for 4 at Da Mario?"
SEEDS = (None, 1, 2)  # None: greedy
MAX_TOKENS = 150
AUTO_MAX_TOKENS = 60  # an answer in text (SmolLM2's in auto mode) runs to it
REQUIRED = "required"


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@dataclass(frozen=True)
class Case:
    """One request: its prompt, ``tool_choice`` (a name for a named function), sampling."""

    prompt: str
    choice: str  # "required", "auto", or the name of the function the request names
    seed: int | None = None
    is_parallel: bool = True
    stream: bool = False

    def body(self) -> dict[str, Any]:
        choice = self.choice if self.choice in ("required", "auto") else named(self.choice)
        sampling: dict[str, Any] = {"temperature": 0} if self.seed is None else {"seed": self.seed}
        body: dict[str, Any] = {
            "model": SMOLLM2_NAME,
            "messages": [{"role": "user", "content": self.prompt}],
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": AUTO_MAX_TOKENS if self.choice == "auto" else MAX_TOKENS,
            "stream": self.stream,
            **sampling,
        }
        if not self.is_parallel:
            body["parallel_tool_calls"] = False
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


FORCED = [
    *(Case(prompt, REQUIRED, seed) for prompt in (WEATHER, BOTH) for seed in SEEDS),
    *(Case(BOOKING, "book_table", seed) for seed in SEEDS),
    # Named: the function is called even where the prompt asks for something else.
    *(Case(WEATHER, "convert_currency", seed) for seed in SEEDS),
    *(Case(BOTH, REQUIRED, seed, is_parallel=False) for seed in SEEDS),
]
AUTO = [Case(prompt, "auto", seed) for prompt in (WEATHER, BOOKING) for seed in (None, 1)]
STREAMED = [
    Case(BOTH, REQUIRED, None, stream=True),
    Case(BOTH, REQUIRED, 1, stream=True),
    Case(BOOKING, "book_table", None, stream=True),
    Case(WEATHER, "convert_currency", 2, stream=True),
    Case(BOTH, REQUIRED, 2, is_parallel=False, stream=True),
    Case(WEATHER, "auto", None, stream=True),
]

TOOL_RESULT = '{"temperature": 18, "sky": "cloudy"}'


@dataclass(frozen=True)
class RoundTrip:
    """A call (``first``), then the conversation with the call and its result answered with
    ``tool_choice`` "none" and "auto" (``answers``, by tool_choice)."""

    first: dict[str, Any]
    answers: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Answers:
    whole: dict[Case, dict[str, Any]]  # the response body, by case
    chunks: dict[Case, list[dict[str, Any]]]  # the stream's chunks, by streamed case
    round_trip: RoundTrip


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    check_answer(answer)
    return answer


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                check_answer(chunks[-1], is_chunk=True)
    return chunks


async def _round_trip(client: httpx.AsyncClient) -> RoundTrip:
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": WEATHER},
    ]
    request = {"model": SMOLLM2_NAME, "tools": TOOLS, "temperature": 0}
    first = await _post(
        client,
        {
            **request,
            "messages": messages,
            "tool_choice": named("get_weather"),
            "max_tokens": MAX_TOKENS,
        },
    )
    (call,) = first["choices"][0]["message"]["tool_calls"]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT},
    ]
    choices = ("none", "auto")
    answers = await asyncio.gather(
        *(
            _post(
                client,
                {
                    **request,
                    "messages": messages,
                    "tool_choice": choice,
                    "max_tokens": AUTO_MAX_TOKENS,
                },
            )
            for choice in choices
        )
    )
    return RoundTrip(first, dict(zip(choices, answers, strict=True)))


def _whole_case(case: Case) -> Case:
    return replace(case, stream=False)


# Every non-streamed request: the forced and auto cases, and each streamed case's twin.
PLAIN = list(dict.fromkeys([*FORCED, *AUTO, *map(_whole_case, STREAMED)]))


@pytest.fixture(scope="module")
def answers(smollm2_url: str) -> Answers:
    async def run() -> Answers:
        async with httpx.AsyncClient(base_url=smollm2_url, timeout=600) as client:
            bodies, chunks, trip = await asyncio.gather(
                asyncio.gather(*(_post(client, c.body()) for c in PLAIN)),
                asyncio.gather(*(_stream(client, c.body()) for c in STREAMED)),
                _round_trip(client),
            )
        return Answers(
            dict(zip(PLAIN, bodies, strict=True)), dict(zip(STREAMED, chunks, strict=True)), trip
        )

    return asyncio.run(run())


def assert_valid_calls(calls: list[dict[str, Any]], names: set[str], where: str) -> None:
    """Each call is a function among ``names`` whose arguments validate against its
    parameters, with a ``call_`` id."""
    assert calls, where
    for call in calls:
        assert call["type"] == "function", where
        assert re.fullmatch("call_[0-9A-Za-z]+", call["id"]), where
        function = call["function"]
        assert function["name"] in names, where
        assert isinstance(function["arguments"], str), where
        arguments = json.loads(function["arguments"])
        jsonschema.validate(arguments, PARAMETERS[function["name"]])


def _expected_names(case: Case) -> set[str]:
    return set(PARAMETERS) if case.choice in (REQUIRED, "auto") else {case.choice}


def complete_calls(
    case: Case, calls: list[dict[str, Any]], finish_reason: str | None, num_tokens: int
) -> list[dict[str, Any]]:
    """The calls of a forced answer that must be whole: all of them when it ended by itself
    (``tool_calls``). Parallel calls are open-ended, so the model may call again until
    ``max_tokens`` cuts it (``length``): the last call keeps the arguments generated so far
    (docs/structured_outputs.md), and the ones before it are whole."""
    if finish_reason == "length":
        assert case.is_parallel, case
        assert case.choice == REQUIRED, case
        assert num_tokens == MAX_TOKENS, case
        assert len(calls) >= 2, case
        return calls[:-1]
    assert finish_reason == "tool_calls", case
    return calls


def test_forced_calls_are_tools_with_valid_arguments(answers: Answers) -> None:
    ids = []
    for case in FORCED:
        body = answers.whole[case]
        (choice,) = body["choices"]
        message = choice["message"]
        where = f"{case}: {message}"
        assert message["role"] == "assistant", where
        assert message["content"] is None, where
        num_tokens = body["usage"]["completion_tokens"]
        assert 0 < num_tokens <= MAX_TOKENS, where
        calls = message["tool_calls"]
        whole = complete_calls(case, calls, choice["finish_reason"], num_tokens)
        assert_valid_calls(whole, _expected_names(case), where)
        ids += [call["id"] for call in calls]
    assert len(ids) == len(set(ids)), "tool call ids are unique"
    reasons = [answers.whole[case]["choices"][0]["finish_reason"] for case in FORCED]
    assert reasons.count("tool_calls") >= len(FORCED) - 2, reasons


def test_a_named_function_is_called_once(answers: Answers) -> None:
    for case in FORCED:
        if case.choice != REQUIRED:
            (call,) = answers.whole[case]["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == case.choice, case


def test_parallel_tool_calls_false_gives_exactly_one_call(answers: Answers) -> None:
    for case in FORCED:
        if not case.is_parallel:
            calls = answers.whole[case]["choices"][0]["message"]["tool_calls"]
            assert len(calls) == 1, (case, calls)
    # And the same prompts allowed parallel calls make more than one somewhere: the limit bites.
    parallel = [c for c in FORCED if c.prompt == BOTH and c.is_parallel]
    num_calls = [len(answers.whole[c]["choices"][0]["message"]["tool_calls"]) for c in parallel]
    assert max(num_calls) > 1, num_calls


def _streamed_calls(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str, str | None]:
    """(the calls the stream's deltas build, its content, its finish reason), checking that
    each call's first delta carries its index, id, type and name."""
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    finish_reason = None
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            finish_reason = choice["finish_reason"] or finish_reason
            for piece in delta.get("tool_calls") or []:
                index = piece["index"]
                if index not in calls:
                    assert index == len(calls), "calls are streamed in order"
                    assert re.fullmatch("call_[0-9A-Za-z]+", piece["id"]), piece
                    assert piece["type"] == "function"
                    assert piece["function"]["name"]
                    calls[index] = {
                        "id": piece["id"],
                        "type": "function",
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }
                else:
                    assert "id" not in piece, piece
                    assert "name" not in piece["function"], piece
                calls[index]["function"]["arguments"] += piece["function"].get("arguments", "")
    return [calls[n] for n in range(len(calls))], content, finish_reason


def test_streamed_calls_equal_the_whole_answer(answers: Answers) -> None:
    num_calls = []
    for case in STREAMED:
        chunks = answers.chunks[case]
        whole = answers.whole[_whole_case(case)]
        (choice,) = whole["choices"]
        calls, content, finish_reason = _streamed_calls(chunks)
        where = f"{case}: {calls} {content!r} vs {choice}"
        assert finish_reason == choice["finish_reason"], where
        assert content == (choice["message"]["content"] or ""), where
        expected = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
        if case.choice != "auto":
            num_tokens = whole["usage"]["completion_tokens"]
            whole_calls = complete_calls(case, calls, finish_reason, num_tokens)
            assert_valid_calls(whole_calls, _expected_names(case), where)
        for count in ("prompt_tokens", "completion_tokens"):  # the cache's share may differ
            assert chunks[-1]["usage"][count] == whole["usage"][count], where
        num_calls.append(len(calls))
    assert max(num_calls) > 1, "one stream holds two calls"


def test_auto_answers_parse_as_content_or_valid_calls(answers: Answers) -> None:
    for case in AUTO:
        (choice,) = answers.whole[case]["choices"]
        message = choice["message"]
        where = f"{case}: {choice}"
        if message.get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls", where
            assert_valid_calls(message["tool_calls"], set(PARAMETERS), where)
        else:
            assert isinstance(message["content"], str), where
            assert message["content"], where
            assert "<tool_call>" not in message["content"], where
            assert choice["finish_reason"] in ("stop", "length"), where


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer(smollm2_gguf)


def test_a_round_trip_answers_the_tool_result(answers: Answers, tokenizer: Tokenizer) -> None:
    trip = answers.round_trip
    (call,) = trip.first["choices"][0]["message"]["tool_calls"]
    assert trip.first["choices"][0]["finish_reason"] == "tool_calls"
    assert_valid_calls([call], {"get_weather"}, str(call))
    # The call and its result, as the default (Hermes) format renders them in ChatML turns.
    arguments = call["function"]["arguments"]
    turns = (
        "<|im_start|>assistant\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        "<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>\n"
    )
    grown = len(tokenizer.encode(turns, add_special_tokens=False))
    first_prompt = trip.first["usage"]["prompt_tokens"]
    for choice_name, body in trip.answers.items():
        (choice,) = body["choices"]
        message = choice["message"]
        where = f"tool_choice={choice_name}: {choice}"
        assert body["usage"]["prompt_tokens"] == first_prompt + grown, where
        assert 0 < body["usage"]["completion_tokens"] <= AUTO_MAX_TOKENS, where
        if message.get("tool_calls"):
            assert choice_name == "auto", where
            assert_valid_calls(message["tool_calls"], set(PARAMETERS), where)
        else:
            assert isinstance(message["content"], str), where
            assert message["content"], where
            assert choice["finish_reason"] in ("stop", "length"), where
    assert "tool_calls" not in trip.answers["none"]["choices"][0]["message"]
