from __future__ import annotations

import re

import pytest

from backend_engine.outputs import FinishReason, RequestOutputDelta, TokenLogprob
from backend_engine.server.choice_streams import ChoiceDelta
from backend_engine.server.openai_format import JSON, ChatFormatter, ResponseIdentity
from backend_engine.server.token_text import TokenText
from backend_engine.server.usage_tally import UsageTally
from model_files import tool_call_syntax as syntax
from tests.support.byte_level_tokenizer import byte_level_tokenizer


def last_delta(
    num_cached_tokens: int | None, num_completion_tokens: int = 3, index: int = 0
) -> RequestOutputDelta:
    return RequestOutputDelta(
        "r", [], "", 7, num_completion_tokens, num_cached_tokens, finished=True, index=index
    )


def test_usage_reports_the_cached_tokens() -> None:
    assert UsageTally.of([ChoiceDelta(0, 0, last_delta(4))]).usage() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_usage_says_zero_cached_tokens_while_they_are_unknown() -> None:
    """A request that never reached the prefix cache: the wire format keeps its 0."""
    usage = UsageTally.of([ChoiceDelta(0, 0, last_delta(None))]).usage()
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_usage_counts_each_prompt_once_and_every_choice() -> None:
    """Two prompts of 7 tokens (4 cached), two choices each: OpenAI's usage."""
    tally = UsageTally()
    for prompt_index in (0, 1):
        for index in (0, 1):
            choice = 2 * prompt_index + index
            running = [last_delta(None, 1, index), last_delta(4, 2 + choice, index)]
            for delta in running:  # running totals: the latest counts
                tally.add(ChoiceDelta(prompt_index, choice, delta))
    assert tally.usage() == {
        "prompt_tokens": 14,
        "completion_tokens": 2 + 3 + 4 + 5,
        "total_tokens": 28,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


# Chat answers read for tool calls (``parses_tool_calls``): whole and streamed agree.

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
PARIS = syntax.call_text("get_weather", '{"city": "Paris"}')
NOW = syntax.call_text("get_time", "{}")
ANSWERS = [
    ("Let me look.\n" + PARIS + syntax.CALL_SEPARATOR + NOW, "stop"),
    (PARIS, "stop"),
    ("Just text, <tool_ and all.\n", "stop"),
    ("Zürich 🙂\n" + syntax.call_head("get_weather") + '{"city": "Z', "length"),
]


@pytest.fixture(scope="module")
def token_text() -> TokenText:
    return TokenText(byte_level_tokenizer())


IDENT = ResponseIdentity("chatcmpl-1", 0, "m", "fp_0123456789")
USAGE = {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}


def formatter(token_text: TokenText, want_logprobs: bool = False) -> ChatFormatter:
    return ChatFormatter(IDENT, token_text, want_logprobs, parses_tool_calls=True)


def whole(chat: ChatFormatter, deltas: list[RequestOutputDelta]) -> JSON:
    return chat.whole([ChoiceDelta(0, d.index, d) for d in deltas], USAGE)


def chunks(chat: ChatFormatter, delta: RequestOutputDelta) -> list[JSON]:
    return chat.chunks(ChoiceDelta(0, delta.index, delta))


def engine_deltas(
    token_text: TokenText, pieces: list[str], finish_reason: FinishReason
) -> list[RequestOutputDelta]:
    """One delta per piece, each token with a logprob; the last finished."""
    tokenizer = byte_level_tokenizer()
    deltas, num_tokens = [], 0
    for n, piece in enumerate(pieces):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        num_tokens += len(ids)
        is_last = n == len(pieces) - 1
        deltas.append(
            RequestOutputDelta(
                "r",
                ids,
                piece,
                7,
                num_tokens,
                0,
                [TokenLogprob(token_id, -0.25) for token_id in ids],
                finished=is_last,
                finish_reason=finish_reason if is_last else None,
            )
        )
    return deltas


def streamed_choice(chunks: list[JSON]) -> JSON:
    """The chunks' deltas added up, as a client does, in the shape of a whole choice."""
    content = ""
    calls: list[JSON] = []
    logprobs: list[JSON] = []
    finish_reason = None
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            assert len(delta["tool_calls"]) == 1
            if "id" in call:  # a call's first delta: its id and name, no arguments yet
                assert call["index"] == len(calls)
                assert call["function"]["arguments"] == ""
                calls.append({k: call[k] for k in ("id", "type", "function")})
            else:
                assert set(call) == {"index", "function"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        if choice["logprobs"] is not None:
            logprobs += choice["logprobs"]["content"]
        if choice["finish_reason"] is not None:
            assert chunk is chunks[-1]
            finish_reason = choice["finish_reason"]
    message: JSON = {
        "role": "assistant",
        "content": None if calls and not content else content,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "message": message,
        "logprobs": {"content": logprobs, "refusal": None},
        "finish_reason": finish_reason,
    }


def without_ids(choice: JSON) -> JSON:
    for call in choice["message"].get("tool_calls", []):
        assert CALL_ID.fullmatch(call.pop("id"))
    return choice


def test_a_whole_answer_has_its_calls(token_text: TokenText) -> None:
    text = "Let me look.\n" + PARIS + syntax.CALL_SEPARATOR + NOW
    [choice] = whole(formatter(token_text), engine_deltas(token_text, [text], "stop"))["choices"]
    assert without_ids(choice) == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": "Let me look.",
            "refusal": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def test_a_whole_answer_without_calls_is_text(token_text: TokenText) -> None:
    for parses in (True, False):
        chat = ChatFormatter(IDENT, token_text, False, parses_tool_calls=parses)
        [choice] = whole(chat, engine_deltas(token_text, ["Hi ", "<tool_ there\n"], "stop"))[
            "choices"
        ]
        assert choice["message"] == {
            "role": "assistant",
            "content": "Hi <tool_ there\n",
            "refusal": None,
        }
        assert choice["finish_reason"] == "stop"
    # Not read for calls, a call is text.
    chat = ChatFormatter(IDENT, token_text, False)
    [choice] = whole(chat, engine_deltas(token_text, [PARIS], "stop"))["choices"]
    assert choice["message"] == {"role": "assistant", "content": PARIS, "refusal": None}


def test_a_truncated_call_keeps_what_was_generated(token_text: TokenText) -> None:
    text = PARIS + syntax.CALL_SEPARATOR + syntax.call_head("get_time") + '{"zo'
    [choice] = whole(formatter(token_text), engine_deltas(token_text, [text], "length"))["choices"]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [
        '{"city": "Paris"}',
        '{"zo',
    ]


@pytest.mark.parametrize(("text", "finish_reason"), ANSWERS)
def test_streamed_answers_add_up_to_the_whole_one(
    token_text: TokenText, text: str, finish_reason: FinishReason
) -> None:
    answer = whole(
        formatter(token_text, want_logprobs=True), engine_deltas(token_text, [text], finish_reason)
    )
    [whole_choice] = answer["choices"]
    del whole_choice["index"]
    expected = without_ids(whole_choice)
    pieces_list = [[text], list(text), *([text[:n], text[n:]] for n in range(len(text) + 1))]
    pieces_list.append([text, ""])  # the last delta only finishes
    for pieces in pieces_list:
        chat = formatter(token_text, want_logprobs=True)
        streamed = [
            c for d in engine_deltas(token_text, pieces, finish_reason) for c in chunks(chat, d)
        ]
        assert without_ids(streamed_choice(streamed)) == expected, pieces
    assert len(expected["logprobs"]["content"]) == len(text.encode())


def test_two_calls_in_one_delta_stream_whole(token_text: TokenText) -> None:
    chat = formatter(token_text)
    [delta] = engine_deltas(token_text, [PARIS + syntax.CALL_SEPARATOR + NOW], "stop")
    out = chunks(chat, delta)
    assert [c["choices"][0]["delta"] for c in out[:-1]] == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": out[0]["choices"][0]["delta"]["tool_calls"][0]["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": out[2]["choices"][0]["delta"]["tool_calls"][0]["id"],
                    "type": "function",
                    "function": {"name": "get_time", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    assert out[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def test_held_back_text_still_reports_its_logprobs(token_text: TokenText) -> None:
    chat = formatter(token_text, want_logprobs=True)
    [held, rest] = engine_deltas(token_text, ["Hi\n<tool", "s>"], "stop")
    [chunk] = chunks(chat, held)
    assert chunk["choices"][0]["delta"] == {"content": "Hi"}
    out = chunks(chat, rest)
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "\n<tools>"}, {}]
    assert [e["token"] for e in out[0]["choices"][0]["logprobs"]["content"]] == ["s", ">"]
    chat = formatter(token_text, want_logprobs=True)
    [only_held, _] = engine_deltas(token_text, ["\n<tool_", "call>"], "stop")
    [chunk] = chunks(chat, only_held)
    assert chunk["choices"][0]["delta"] == {}
    assert len(chunk["choices"][0]["logprobs"]["content"]) == len("\n<tool_")


def test_each_choice_is_parsed_alone(token_text: TokenText) -> None:
    """Two choices' deltas interleaved, a call split across deltas in each: every choice's
    chunks add up to its own whole answer, with its own calls and finish reason."""
    answers: dict[int, tuple[str, FinishReason]] = {
        0: ("Sure.\n" + PARIS, "stop"),
        1: (NOW + syntax.CALL_SEPARATOR + PARIS, "stop"),
    }
    per_choice = {
        index: [
            RequestOutputDelta(**{**vars(d), "index": index})
            for d in engine_deltas(token_text, [text[:9], text[9:20], text[20:]], reason)
        ]
        for index, (text, reason) in answers.items()
    }
    mixed = [ChoiceDelta(0, i, per_choice[i][step]) for step in range(3) for i in (0, 1)]
    chat = ChatFormatter(IDENT, token_text, True, num_choices=2, parses_tool_calls=True)
    answer = chat.whole(mixed, USAGE)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    streamed = ChatFormatter(IDENT, token_text, True, num_choices=2, parses_tool_calls=True)
    assert [c["choices"][0]["index"] for c in streamed.opening_chunks()] == [0, 1]
    out = [chunk for choice in mixed for chunk in streamed.chunks(choice)]
    for whole_choice in answer["choices"]:
        index = whole_choice.pop("index")
        mine = [c for c in out if c["choices"][0]["index"] == index]
        assert without_ids(streamed_choice(mine)) == without_ids(whole_choice)
    names = [
        [c["function"]["name"] for c in choice["message"]["tool_calls"]]
        for choice in answer["choices"]
    ]
    assert names == [["get_weather"], ["get_time", "get_weather"]]
