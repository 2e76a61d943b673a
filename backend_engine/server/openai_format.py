"""OpenAI response shapes for chat and text completions, whole and as stream chunks.

Two formatters share one interface so the route code is the same for both
endpoints: ``whole`` for a non-streamed body, ``chunks`` per engine delta,
``role_chunk`` before the first delta and ``usage_chunk`` after the last.

A chat answer to a request with tools (``parses_tool_calls``) is read by
``tool_call_parser``: ``message.tool_calls`` whole, ``delta.tool_calls`` streamed (a call's first
delta has its id and name, later ones pieces of its arguments), and ``finish_reason``
``"tool_calls"`` when the answer made calls and stopped by itself. Logprobs cover every token
once, in order: streamed, each engine delta's ride on the first chunk made from it, or on a
chunk of their own (``"delta": {}``) when its text is all held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend_engine.outputs import RequestOutputDelta, TokenLogprob
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


def usage(last: RequestOutputDelta) -> JSON:
    cached = last.num_cached_tokens  # None: it never reached the cache; the wire says 0
    return {
        "prompt_tokens": last.num_prompt_tokens,
        "completion_tokens": last.num_completion_tokens,
        "total_tokens": last.num_prompt_tokens + last.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached if cached is not None else 0},
    }


def _joined(deltas: list[RequestOutputDelta]) -> tuple[str, list[TokenLogprob]]:
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
        parses_tool_calls: bool = False,
    ) -> None:
        self.ident = ident
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.parses_tool_calls = parses_tool_calls
        self._parser = ToolCallStreamParser() if parses_tool_calls else None

    def _envelope(self, obj: str, choices: list[JSON]) -> JSON:
        i = self.ident
        return {
            "id": i.id,
            "object": obj,
            "created": i.created,
            "model": i.model,
            "choices": choices,
        }

    def _logprobs(self, logprobs: list[TokenLogprob]) -> JSON | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._token_entry(lp) for lp in logprobs]}

    def _token_entry(self, lp: TokenLogprob) -> JSON:
        entry = self._alternative(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(t, p) for t, p in lp.top]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> JSON:
        token, token_bytes = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": token_bytes}

    def whole(self, deltas: list[RequestOutputDelta]) -> JSON:
        text, logprobs = _joined(deltas)
        message: JSON = {"role": "assistant", "content": text}
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
        choice = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return {**self._envelope(self.object_whole, [choice]), "usage": usage(deltas[-1])}

    def role_chunk(self) -> JSON:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def chunks(self, delta: RequestOutputDelta) -> list[JSON]:
        if self._parser is not None:
            return self._tool_call_chunks(delta, self._parser)
        out = []
        if delta.new_text or delta.new_logprobs:
            choice = {
                "index": 0,
                "delta": {"content": delta.new_text},
                "logprobs": self._logprobs(delta.new_logprobs),
                "finish_reason": None,
            }
            out.append(self._envelope(self.object_chunk, [choice]))
        if delta.finished:
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": delta.finish_reason}
            out.append(self._envelope(self.object_chunk, [last]))
        return out

    def usage_chunk(self, last: RequestOutputDelta) -> JSON:
        return {**self._envelope(self.object_chunk, []), "usage": usage(last)}

    def _tool_call_chunks(
        self, delta: RequestOutputDelta, parser: ToolCallStreamParser
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
            choice = {"index": 0, "delta": chunk_delta, "logprobs": logprobs, "finish_reason": None}
            out.append(self._envelope(self.object_chunk, [choice]))
        if delta.finished:
            finish_reason = _finish_reason(delta.finish_reason, num_calls=parser.num_calls)
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
            out.append(self._envelope(self.object_chunk, [last]))
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


class CompletionFormatter:
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, ident: ResponseIdentity, token_text: TokenText, want_logprobs: bool) -> None:
        self.ident = ident
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self._text_offset = 0

    def _envelope(self, choices: list[JSON]) -> JSON:
        i = self.ident
        return {
            "id": i.id,
            "object": self.object_whole,
            "created": i.created,
            "model": i.model,
            "choices": choices,
        }

    def _logprobs(self, logprobs: list[TokenLogprob]) -> JSON | None:
        """The legacy shape: parallel lists, ``top_logprobs`` as {token: logprob} maps."""
        if not self.want_logprobs:
            return None
        tokens, offsets = [], []
        for lp in logprobs:
            token = self.token_text(lp.token_id)[0]
            tokens.append(token)
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t)[0]: p for t, p in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _choice(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None) -> JSON:
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def whole(self, deltas: list[RequestOutputDelta]) -> JSON:
        text, logprobs = _joined(deltas)
        choice = self._choice(text, logprobs, deltas[-1].finish_reason)
        return {**self._envelope([choice]), "usage": usage(deltas[-1])}

    def role_chunk(self) -> JSON | None:
        return None

    def chunks(self, delta: RequestOutputDelta) -> list[JSON]:
        if not (delta.new_text or delta.new_logprobs or delta.finished):
            return []
        choice = self._choice(delta.new_text, delta.new_logprobs, delta.finish_reason)
        return [self._envelope([choice])]

    def usage_chunk(self, last: RequestOutputDelta) -> JSON:
        return {**self._envelope([]), "usage": usage(last)}


Formatter = ChatFormatter | CompletionFormatter
