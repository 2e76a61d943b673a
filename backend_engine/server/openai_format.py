"""OpenAI response shapes for chat completions, whole and as stream chunks; what chat and
text completions share.

The two formatters (`ChatFormatter` here, `CompletionFormatter` in ``completion_format``)
share one interface so the route code is the same for both endpoints: ``whole`` for a
non-streamed body (one choice per index, in index order), ``chunks`` per labelled engine
delta (each chunk carries its choice's ``index``), ``opening_chunks`` before the first delta
(chat: a role chunk per choice) and ``usage_chunk`` after the last. Every answer and chunk
carries the engine's ``system_fingerprint``; chat messages carry ``refusal: null`` and chat
logprobs ``{"content": [...], "refusal": null}``, as OpenAI's schema has them.

A chat answer to a request with tools (``parses_tool_calls``) is read by
``tool_call_parser``, one parser per choice: ``message.tool_calls`` whole, ``delta.tool_calls``
streamed (a call's first delta has its id and name, later ones pieces of its arguments), and
``finish_reason`` ``"tool_calls"`` when the answer made calls and stopped by itself. Logprobs
cover every token once, in order: streamed, each engine delta's ride on the first chunk made
from it, or on a chunk of their own (``"delta": {}``) when its text is all held back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from backend_engine.outputs import RequestOutputDelta, TokenLogprob
from backend_engine.server.choice_streams import ChoiceDelta
from backend_engine.server.token_text import TokenText
from backend_engine.text.tool_call_parser import (
    CallStart,
    ContentDelta,
    ParseEvent,
    ToolCallStreamParser,
    parse_tool_calls,
)

JSON = dict[str, Any]


@dataclass(frozen=True)
class ResponseIdentity:
    id: str
    created: int
    model: str
    system_fingerprint: str

    def envelope(self, obj: str, choices: list[JSON]) -> JSON:
        """An answer's or chunk's fields around its choices."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }


def by_choice(choices: Iterable[ChoiceDelta]) -> dict[int, list[RequestOutputDelta]]:
    """Each choice's deltas, in the order they came, choices in index order."""
    grouped: dict[int, list[RequestOutputDelta]] = {}
    for choice in choices:
        grouped.setdefault(choice.index, []).append(choice.delta)
    return dict(sorted(grouped.items()))


def joined(deltas: list[RequestOutputDelta]) -> tuple[str, list[TokenLogprob]]:
    text = "".join(d.new_text for d in deltas)
    logprobs = [lp for d in deltas for lp in d.new_logprobs]
    return text, logprobs


class ChatFormatter:
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(
        self,
        ident: ResponseIdentity,
        token_text: TokenText,
        want_logprobs: bool,
        *,
        num_choices: int = 1,
        parses_tool_calls: bool = False,
    ) -> None:
        self.ident = ident
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.num_choices = num_choices
        self.parses_tool_calls = parses_tool_calls
        self._parsers: dict[int, ToolCallStreamParser] = {}  # a stream's, by choice index

    def _logprobs(self, logprobs: list[TokenLogprob]) -> JSON | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._token_entry(lp) for lp in logprobs], "refusal": None}

    def _token_entry(self, lp: TokenLogprob) -> JSON:
        entry = self._alternative(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(t, p) for t, p in lp.top]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> JSON:
        token, token_bytes = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": token_bytes}

    def whole(self, choices: list[ChoiceDelta], usage: JSON) -> JSON:
        answers = [self._whole_choice(i, deltas) for i, deltas in by_choice(choices).items()]
        return {**self.ident.envelope(self.object_whole, answers), "usage": usage}

    def _whole_choice(self, index: int, deltas: list[RequestOutputDelta]) -> JSON:
        text, logprobs = joined(deltas)
        message: JSON = {"role": "assistant", "content": text, "refusal": None}
        finish_reason: str | None = deltas[-1].finish_reason
        if self.parses_tool_calls:
            answer = parse_tool_calls(text)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in answer.tool_calls
                ]
            finish_reason = _finish_reason(finish_reason, num_calls=len(answer.tool_calls))
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def _chunk(
        self, index: int, delta: JSON, logprobs: JSON | None = None, finish_reason: Any = None
    ) -> JSON:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self.ident.envelope(self.object_chunk, [choice])

    def opening_chunks(self) -> list[JSON]:
        """One role chunk per choice, before any content."""
        return [
            self._chunk(index, {"role": "assistant", "content": ""})
            for index in range(self.num_choices)
        ]

    def chunks(self, choice: ChoiceDelta) -> list[JSON]:
        delta, index = choice.delta, choice.index
        if self.parses_tool_calls:
            parser = self._parsers.setdefault(index, ToolCallStreamParser())
            return self._tool_call_chunks(index, delta, parser)
        out = []
        if delta.new_text or delta.new_logprobs:
            content = {"content": delta.new_text}
            out.append(self._chunk(index, content, self._logprobs(delta.new_logprobs)))
        if delta.finished:
            out.append(self._chunk(index, {}, finish_reason=delta.finish_reason))
        return out

    def usage_chunk(self, usage: JSON) -> JSON:
        return {**self.ident.envelope(self.object_chunk, []), "usage": usage}

    def _tool_call_chunks(
        self, index: int, delta: RequestOutputDelta, parser: ToolCallStreamParser
    ) -> list[JSON]:
        events = parser.feed(delta.new_text)
        if delta.finished:
            events += parser.finish()
        deltas = [_event_delta(event) for event in events]
        if self.want_logprobs and delta.new_logprobs and not deltas:
            deltas.append({})
        out = []
        for n, chunk_delta in enumerate(deltas):
            logprobs = self._logprobs(delta.new_logprobs) if n == 0 else None
            out.append(self._chunk(index, chunk_delta, logprobs))
        if delta.finished:
            finish_reason = _finish_reason(delta.finish_reason, num_calls=parser.num_calls)
            out.append(self._chunk(index, {}, finish_reason=finish_reason))
        return out


def _event_delta(event: ParseEvent) -> JSON:
    """One parser event as a chat chunk's ``delta``."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        call = {
            "index": event.index,
            "id": event.id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def _finish_reason(engine_reason: str | None, *, num_calls: int) -> str | None:
    """``"tool_calls"`` for an answer that made calls and stopped by itself."""
    return "tool_calls" if num_calls and engine_reason == "stop" else engine_reason
