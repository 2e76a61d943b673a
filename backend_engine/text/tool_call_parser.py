"""Reading tool calls out of an answer, whole or as it streams.

The model writes calls as ``model_files.tool_call_syntax`` defines them (the tool grammar holds
it to that)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallStreamParser` takes the answer's text in pieces of any size and says what each
piece adds: content, a call's start (its name), or a fragment of a call's arguments. The
non-streamed answer is the same parser fed the whole text at once (:func:`parse_tool_calls`),
so the two cannot disagree. The rules:

- **Content** is the text before the first call, without its trailing whitespace (the newline
  before ``<tool_call>``); while streaming, trailing whitespace and what may be the start of
  ``<tool_call>`` are held back until the text after them decides. An answer without calls is
  all content, exactly as generated.
- **A call** starts once its head is whole (``<tool_call>\\n{"name": "f", "arguments": ``); its
  arguments are the text from there to ``}\\n</tool_call>``, exactly as generated (a possible
  start of that tail is held back). Calls follow each other joined by ``"\\n"``.
- **An opening tag that no call head follows** (the grammar allows none; an unconstrained or
  truncated answer may hold one) is content when no call came before it; text after the
  calls that does not start another call is dropped.
- **Truncated** (the answer ends inside a call's arguments, ``finish_reason`` "length"): the
  call keeps the arguments generated so far, in both forms, since a stream cannot take back
  fragments it sent (OpenAI's behaviour too). A possible start of the tail held back at the
  end is dropped if the arguments are whole JSON without it, else added to them. An answer cut
  inside a head has no call there: its text is content if no call came before, else dropped.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from model_files import tool_call_syntax as syntax

_HEAD_PREFIX = syntax.head_prefix()
_HEAD_SUFFIX = syntax.head_suffix()
_NEXT_CALL = syntax.CALL_SEPARATOR + syntax.CALL_OPEN


def new_tool_call_id() -> str:
    """``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ParseEvent = ContentDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # the JSON text as generated


@dataclass(frozen=True)
class ParsedAnswer:
    """``content`` is None when the answer made calls and had no text before them."""

    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]


class _State(Enum):
    CONTENT = "content"
    HEAD = "head"  # from an opening tag, until the call's head is whole or cannot be
    ARGUMENTS = "arguments"
    BETWEEN = "between"  # after a call's tail: another call, or the end
    DROPPING = "dropping"  # after the calls, text that starts none


class _NeedMore(Exception):
    """The head read so far is a prefix of a valid one."""


class _NotAHead(Exception):
    """The text after an opening tag cannot be a call's head."""


class ToolCallStreamParser:
    """One answer's text, fed in pieces; ``finish()`` once at its end."""

    def __init__(self, new_call_id: Callable[[], str] = new_tool_call_id) -> None:
        self._new_call_id = new_call_id
        self._state = _State.CONTENT
        self._pending = ""  # text read but not yet given out as an event
        self._space = ""  # whitespace held between content and an opening tag being read
        self._num_calls = 0
        self._arguments = ""  # the current call's arguments so far

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[ParseEvent]:
        self._pending += text
        events: list[ParseEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ParseEvent]:
        """What the held-back text turns out to be, now that nothing follows."""
        events: list[ParseEvent] = []
        state, pending = self._state, self._pending
        if state is _State.CONTENT or (state is _State.HEAD and self._num_calls == 0):
            self._content(events, self._space + pending)
        elif state is _State.ARGUMENTS and pending and not _is_json(self._arguments):
            self._arguments += pending
            events.append(ArgumentsDelta(self._num_calls - 1, pending))
        self._pending = self._space = ""
        self._state = _State.DROPPING
        return events

    def _step(self, events: list[ParseEvent]) -> bool:
        """Advance as far as the pending text decides; True if the state changed."""
        if self._state is _State.CONTENT:
            return self._step_content(events)
        if self._state is _State.HEAD:
            return self._step_head(events)
        if self._state is _State.ARGUMENTS:
            return self._step_arguments(events)
        if self._state is _State.BETWEEN:
            return self._step_between()
        self._pending = ""
        return False

    def _step_content(self, events: list[ParseEvent]) -> bool:
        pending = self._pending
        at = pending.find(syntax.CALL_OPEN)
        if at < 0:
            body = pending[: len(pending) - _partial_suffix(pending, syntax.CALL_OPEN)]
            shown = body.rstrip()
            self._content(events, shown)
            self._pending = pending[len(shown) :]
            return False
        before = pending[:at]
        shown = before.rstrip()
        self._content(events, shown)
        self._space = before[len(shown) :]
        self._pending = pending[at:]
        self._state = _State.HEAD
        return True

    def _step_head(self, events: list[ParseEvent]) -> bool:
        try:
            name, length = _read_head(self._pending)
        except _NeedMore:
            return False
        except _NotAHead:
            if self._num_calls:
                self._state = _State.DROPPING
            else:  # the tag is text after all; read on after it
                self._content(events, self._space + syntax.CALL_OPEN)
                self._pending = self._pending[len(syntax.CALL_OPEN) :]
                self._state = _State.CONTENT
            self._space = ""
            return True
        events.append(CallStart(self._num_calls, self._new_call_id(), name))
        self._num_calls += 1
        self._arguments = ""
        self._pending = self._pending[length:]
        self._space = ""
        self._state = _State.ARGUMENTS
        return True

    def _step_arguments(self, events: list[ParseEvent]) -> bool:
        pending = self._pending
        at = pending.find(syntax.CALL_TAIL)
        end = at if at >= 0 else len(pending) - _partial_suffix(pending, syntax.CALL_TAIL)
        if end:
            self._arguments += pending[:end]
            events.append(ArgumentsDelta(self._num_calls - 1, pending[:end]))
        if at < 0:
            self._pending = pending[end:]
            return False
        self._pending = pending[at + len(syntax.CALL_TAIL) :]
        self._state = _State.BETWEEN
        return True

    def _step_between(self) -> bool:
        pending = self._pending
        if len(pending) < len(_NEXT_CALL) and _NEXT_CALL.startswith(pending):
            return False
        if pending.startswith(_NEXT_CALL):
            self._pending = pending[len(syntax.CALL_SEPARATOR) :]
            self._state = _State.HEAD
        else:
            self._state = _State.DROPPING
        return True

    def _content(self, events: list[ParseEvent], text: str) -> None:
        if text:
            events.append(ContentDelta(text))


def parse_tool_calls(text: str, new_call_id: Callable[[], str] = new_tool_call_id) -> ParsedAnswer:
    """A whole answer's content and calls (the stream parser, fed everything at once)."""
    parser = ToolCallStreamParser(new_call_id)
    return answer_from_events([*parser.feed(text), *parser.finish()])


def answer_from_events(events: list[ParseEvent]) -> ParsedAnswer:
    """The answer a list of events adds up to (all of one answer's, in order)."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, CallStart)]
    arguments = ["" for _ in starts]
    for event in events:
        if isinstance(event, ArgumentsDelta):
            arguments[event.index] += event.text
    calls = tuple(
        ParsedToolCall(start.id, start.name, args)
        for start, args in zip(starts, arguments, strict=True)
    )
    return ParsedAnswer(content if content or not calls else None, calls)


def _read_head(text: str) -> tuple[str, int]:
    """The name in the call head ``text`` starts with, and the head's length."""
    _expect(text, 0, _HEAD_PREFIX)
    start = len(_HEAD_PREFIX)
    if len(text) == start:
        raise _NeedMore
    if text[start] != '"':
        raise _NotAHead
    at = start + 1
    while True:
        if at >= len(text):
            raise _NeedMore
        char = text[at]
        if char == '"':
            break
        if char < " ":  # a raw control character ends no JSON string
            raise _NotAHead
        at += 2 if char == "\\" else 1
    try:
        name = json.loads(text[start : at + 1])
    except json.JSONDecodeError as exc:
        raise _NotAHead from exc
    _expect(text, at + 1, _HEAD_SUFFIX)
    return name, at + 1 + len(_HEAD_SUFFIX)


def _expect(text: str, at: int, expected: str) -> None:
    """``text`` from ``at`` goes on with ``expected``, or may (``_NeedMore``)."""
    got = text[at : at + len(expected)]
    if not expected.startswith(got):
        raise _NotAHead
    if len(got) < len(expected):
        raise _NeedMore


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with (shorter than it)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
