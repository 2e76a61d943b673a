"""Tool calls read out of an answer: whole, and streamed in pieces of every size, with the same
result."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from backend_engine.text.tool_call_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedAnswer,
    ParsedToolCall,
    ParseEvent,
    ToolCallStreamParser,
    answer_from_events,
    new_tool_call_id,
    parse_tool_calls,
)
from model_files import tool_call_syntax as syntax

PARIS_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
PARIS = syntax.call_text("get_weather", PARIS_ARGUMENTS)
NOW = syntax.call_text("get_time", "{}")
HEAD = syntax.call_head("get_weather")


def counting_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def call(n: int, name: str, arguments: str) -> ParsedToolCall:
    return ParsedToolCall(f"call_{n}", name, arguments)


# (answer text, what it parses to)
CASES: list[tuple[str, ParsedAnswer]] = [
    ("It is sunny in Paris.\n", ParsedAnswer("It is sunny in Paris.\n", ())),
    ("", ParsedAnswer("", ())),
    ("  \n", ParsedAnswer("  \n", ())),
    (PARIS, ParsedAnswer(None, (call(0, "get_weather", PARIS_ARGUMENTS),))),
    (
        PARIS + syntax.CALL_SEPARATOR + NOW,
        ParsedAnswer(None, (call(0, "get_weather", PARIS_ARGUMENTS), call(1, "get_time", "{}"))),
    ),
    (
        " Let me check,\nboth.\n\n" + PARIS + syntax.CALL_SEPARATOR + NOW,
        ParsedAnswer(
            " Let me check,\nboth.",
            (call(0, "get_weather", PARIS_ARGUMENTS), call(1, "get_time", "{}")),
        ),
    ),
    ("\n \n" + NOW, ParsedAnswer(None, (call(0, "get_time", "{}"),))),
    (
        "Zürich 🙂 <tool_cal\n" + NOW,
        ParsedAnswer("Zürich 🙂 <tool_cal", (call(0, "get_time", "{}"),)),
    ),
    # An opening tag no head follows is text; a later call still counts.
    ("Use <tool_call> tags.", ParsedAnswer("Use <tool_call> tags.", ())),
    ("<tool_call><tool_call>", ParsedAnswer("<tool_call><tool_call>", ())),
    (
        "a <tool_call>x\n" + PARIS,
        ParsedAnswer("a <tool_call>x", (call(0, "get_weather", PARIS_ARGUMENTS),)),
    ),
    # After the calls, text that starts no call is dropped.
    (PARIS + " bye.", ParsedAnswer(None, (call(0, "get_weather", PARIS_ARGUMENTS),))),
    (NOW + "\n", ParsedAnswer(None, (call(0, "get_time", "{}"),))),
    (NOW + "\n<tool_call>oops" + NOW, ParsedAnswer(None, (call(0, "get_time", "{}"),))),
    # Names and arguments as JSON writes them, even when they hold the syntax's own marks.
    (
        syntax.call_text('say "hi"\\ <tool_call>', '{"s": "}\\n</tool_call>", "n": [1, {}]}'),
        ParsedAnswer(
            None, (call(0, 'say "hi"\\ <tool_call>', '{"s": "}\\n</tool_call>", "n": [1, {}]}'),)
        ),
    ),
    # Truncated (finish_reason "length"): the arguments generated so far.
    (HEAD + '{"city": "Par', ParsedAnswer(None, (call(0, "get_weather", '{"city": "Par'),))),
    (HEAD, ParsedAnswer(None, (call(0, "get_weather", ""),))),
    (
        HEAD + '{"city": "Paris"}}\n</tool_',
        ParsedAnswer(None, (call(0, "get_weather", '{"city": "Paris"}'),)),
    ),
    (
        HEAD + '{"a": {"b": 1}}',  # the held "}" closes the arguments themselves
        ParsedAnswer(None, (call(0, "get_weather", '{"a": {"b": 1}}'),)),
    ),
    (
        "Ok.\n" + HEAD[:-5],  # cut inside the head: no call, all text
        ParsedAnswer("Ok.\n" + HEAD[:-5], ()),
    ),
    (
        NOW + "\n" + HEAD[:-5],
        ParsedAnswer(None, (call(0, "get_time", "{}"),)),
    ),
]


def stream(pieces: list[str]) -> list[ParseEvent]:
    parser = ToolCallStreamParser(counting_ids())
    events: list[ParseEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def splittings(text: str) -> list[list[str]]:
    """Everything at once, one character at a time, every split in two, random pieces."""
    out = [[text], list(text), *([text[:n], text[n:]] for n in range(len(text) + 1))]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_a_whole_answer_parses(text: str, expected: ParsedAnswer) -> None:
    assert parse_tool_calls(text, counting_ids()) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_every_splitting_streams_the_whole_answer(text: str, expected: ParsedAnswer) -> None:
    for pieces in splittings(text):
        events = stream(pieces)
        assert answer_from_events(events) == expected, pieces
        assert all(not isinstance(e, ContentDelta | ArgumentsDelta) or e.text for e in events)
        started: set[int] = set()
        for event in events:  # a call's start comes before its arguments, calls in order
            if isinstance(event, CallStart):
                assert event.index == len(started)
                started.add(event.index)
            elif isinstance(event, ArgumentsDelta):
                assert event.index == len(started) - 1


def test_content_is_held_back_only_while_it_may_precede_a_call() -> None:
    parser = ToolCallStreamParser(counting_ids())
    assert parser.feed("Hi <tool") == [ContentDelta("Hi")]
    assert parser.feed("s> and ") == [ContentDelta(" <tools> and")]
    assert parser.feed("\n") == []
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "get_time", "arguments": ') == [CallStart(0, "call_0", "get_time")]
    assert parser.finish() == []


def test_arguments_stream_as_they_come() -> None:
    parser = ToolCallStreamParser(counting_ids())
    assert parser.feed(HEAD + '{"city": "Pa') == [
        CallStart(0, "call_0", "get_weather"),
        ArgumentsDelta(0, '{"city": "Pa'),
    ]
    assert parser.feed('ris"}') == [ArgumentsDelta(0, 'ris"')]  # "}" may start the tail
    assert parser.feed("}\n</tool_call>") == [ArgumentsDelta(0, "}")]
    assert parser.feed("\n" + NOW) == [CallStart(1, "call_1", "get_time"), ArgumentsDelta(1, "{}")]
    assert parser.num_calls == 2
    assert parser.finish() == []


def test_two_calls_in_one_piece_are_both_given_whole() -> None:
    parser = ToolCallStreamParser(counting_ids())
    assert parser.feed("Both:\n" + PARIS + "\n" + NOW) == [
        ContentDelta("Both:"),
        CallStart(0, "call_0", "get_weather"),
        ArgumentsDelta(0, PARIS_ARGUMENTS),
        CallStart(1, "call_1", "get_time"),
        ArgumentsDelta(1, "{}"),
    ]


def test_call_ids_are_openai_shaped_and_distinct() -> None:
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    for call_id in ids:
        assert call_id.startswith("call_")
        assert len(call_id) == 29
        assert call_id[5:].isalnum()
    [parsed] = parse_tool_calls(NOW).tool_calls
    assert parsed.id.startswith("call_")
