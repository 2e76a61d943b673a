"""Relaying an engine's answer to the client, and measuring it. Nothing here enforces anything.

The gateway always asks the engine for ``stream_options.include_usage``; the relay takes the
usage from the engine's final chunk and hands that chunk on only if the client asked for it.
It also counts the tokens it relays (the entries of a chunk's ``logprobs`` when present,
else one per chunk with content or with a piece of a tool call, whose content is null),
summed over every choice of every chunk (with ``n`` > 1 or a list of prompts the choices'
chunks interleave), which is what a request is charged for when the stream stops before the
engine's usage arrives (client gone, engine failed). A choice's first chunk that echoes its
prompt (``echo`` with ``logprobs``: the prompt's tokens first, the very first with a null
logprob) counts as one token, not as the prompt's; and that count never exceeds what the
request's choices could generate (``max_completion_tokens``), so a fallback charge stays
within the reservation. Text the engine held
back (a partial UTF-8 character, a possible stop string) was not relayed and is not counted.
Each chunk's ``model`` is given the name the client knows (``model_name``) where the engine's
differs (an ``upstream_model`` id, a rollout's version). The meter keeps the last non-null
``finish_reason`` the engine sent (a stream's finish chunk, a whole answer's choice): none for
a stream the client left before its finish chunk arrived.

    engine SSE ──► relay_events ──► client
                     │ UsageMeter: usage, num_relayed_tokens, first/last token times,
                     │             finish_reason, outcome
                     ▼
                 before_end (the request path records the usage: before [DONE] is sent;
                             a record not accepted sends its 503 error event first)

A stopping gateway's drain deadline (``deadline``) ends a stream still waiting on its engine
with a ``server_shutting_down`` error event and ``[DONE]``, billed as a client that left.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from gateway.errors import MID_STREAM_ERROR, SHUTTING_DOWN_MID_STREAM, ApiError
from gateway.storage.models import MAX_FINISH_REASON_LENGTH, UsageStatus
from gateway.upstream.drain_deadline import DrainCutOff, DrainDeadline
from gateway.upstream.pool import UpstreamCall
from openai_protocol.sse import DONE, event

_NULL_USAGE_LAST = ',"usage":null}'  # how our engine ends every chunk but the last


@dataclass
class UsageMeter:
    """What one response carried. ``status`` is final once ``is_finished``."""

    on_first_token: Callable[[float], None] | None = None
    on_next_token: Callable[[float], None] | None = None
    clock: Callable[[], float] = time.monotonic
    started_at: float = field(default_factory=time.monotonic)
    usage: dict[str, Any] | None = None
    num_relayed_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    status: UsageStatus = UsageStatus.CANCELLED
    is_finished: bool = False
    max_completion_tokens: int | None = None  # every choice's max_tokens: a count's ceiling

    def finish(self, status: UsageStatus) -> None:
        if not self.is_finished:
            self.status = status
            self.is_finished = True

    def observe_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.usage = usage

    def observe_chunk(self, chunk: dict[str, Any]) -> None:
        num_tokens = 0
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            num_tokens += _tokens_in(choice)
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = _storable_finish_reason(reason)
        if num_tokens == 0:
            return
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            if self.on_first_token is not None:
                self.on_first_token(now - self.started_at)
        elif self.last_token_at is not None and self.on_next_token is not None:
            self.on_next_token(now - self.last_token_at)
        self.last_token_at = now
        self.num_relayed_tokens += num_tokens

    def tokens(self, counted_prompt_tokens: int) -> tuple[int, int, int]:
        """``(prompt_tokens, cached_tokens, completion_tokens)`` to charge: the engine's usage
        when it arrived, else the gateway's prompt count and the tokens relayed."""
        usage = self.usage or {}
        prompt = _int(usage.get("prompt_tokens"), counted_prompt_tokens)
        relayed = self.num_relayed_tokens
        if self.max_completion_tokens is not None:
            relayed = min(relayed, self.max_completion_tokens)
        completion = _int(usage.get("completion_tokens"), relayed)
        details = usage.get("prompt_tokens_details") or {}
        cached = min(prompt, _int(details.get("cached_tokens"), 0))
        return prompt, cached, completion

    @property
    def ttft_ms(self) -> int | None:
        if self.first_token_at is None:
            return None
        return round((self.first_token_at - self.started_at) * 1000)


async def relay_events(
    call: UpstreamCall,
    meter: UsageMeter,
    *,
    include_usage: bool,
    before_end: Callable[[], Awaitable[None]] | None = None,
    model_name: str | None = None,
    deadline: DrainDeadline | None = None,
) -> AsyncIterator[str]:
    """The client's SSE stream, one string per batch of upstream events (events that arrived
    together are written together: one send, not one per event). Ends with ``[DONE]``; a
    broken upstream ends it with an error event first. ``before_end`` runs once the meter is
    finished, before the batch with ``[DONE]`` is yielded (a client that leaves earlier never
    reaches it). ``model_name``: the ``model`` every chunk carries to the client (None: the
    engine's). ``deadline``: the drain's (`gateway.upstream.drain_deadline`); reached while
    the stream waits on the engine, it ends the stream with a ``server_shutting_down`` error
    event and ``[DONE]``, the meter finished as cancelled (what was relayed is charged). The
    caller closes ``call`` when the response ends, however it ends."""
    if call.events is None:
        raise ValueError("relay_events needs a streaming upstream call")
    events = call.events
    status, error = UsageStatus.UPSTREAM_ERROR, MID_STREAM_ERROR  # unless cut off
    try:
        while (batch := await _next_batch(events, deadline)) is not None:
            out, is_broken = [], False
            for payload in batch:
                if payload == "[DONE]":
                    meter.finish(UsageStatus.COMPLETED)
                    if before_end is not None:
                        try:
                            await before_end()
                        except ApiError as refusal:  # not recorded: the answer must not end
                            out.append(event(refusal.rejection.error_body()))
                    out.append(DONE)
                    yield "".join(out)
                    return
                chunk = _parse(payload)
                if chunk is None or "error" in chunk:
                    is_broken = True
                    break
                relayed = _relayed(payload, chunk, meter, include_usage, model_name)
                if relayed is not None:
                    out.append(relayed)
            if out:
                yield "".join(out)
            if is_broken:
                break
    except httpx.HTTPError:
        pass
    except DrainCutOff:  # charged as a client that left: what was relayed
        status, error = UsageStatus.CANCELLED, SHUTTING_DOWN_MID_STREAM
    meter.finish(status)
    if before_end is not None:
        try:
            await before_end()
        except ApiError as refusal:  # not recorded: say so rather than the cause
            error = refusal.rejection
    yield event(error.error_body()) + DONE


async def _next_batch(
    events: AsyncIterator[list[str]], deadline: DrainDeadline | None
) -> list[str] | None:
    """The engine's next batch of events (None after the last); `DrainCutOff` if the drain's
    deadline comes first."""
    try:
        if deadline is None:
            return await anext(events)
        return await deadline.wait(anext(events))
    except StopAsyncIteration:
        return None


def _relayed(
    payload: str,
    chunk: dict[str, Any],
    meter: UsageMeter,
    include_usage: bool,
    model_name: str | None = None,
) -> str | None:
    """Measure one chunk; the event to send the client for it (None: nothing)."""
    usage = chunk.get("usage")
    if usage is not None:
        meter.observe_usage(usage)
    meter.observe_chunk(chunk)
    if model_name is not None and chunk.get("model", model_name) != model_name:
        chunk["model"] = model_name  # the client's name for it, not the engine's
        if not include_usage and "usage" in chunk:
            if usage is not None and not chunk.get("choices"):
                return None
            del chunk["usage"]
        return event(chunk)
    if include_usage or "usage" not in chunk:
        return f"data: {payload}\n\n"  # nothing to take out: pass it on as is
    # The client did not ask for usage: drop the usage-only chunk and the key.
    if usage is not None and not chunk.get("choices"):
        return None
    if usage is None and payload.endswith(_NULL_USAGE_LAST):
        # The key is the object's last member (a parsed object cannot end any other way
        # with these characters): cut it out instead of encoding the chunk again.
        return f"data: {payload[: -len(_NULL_USAGE_LAST)]}}}\n\n"
    del chunk["usage"]
    return event(chunk)


def measure_body(body: dict[str, Any], meter: UsageMeter) -> None:
    """A whole (non-streamed) answer: its usage, its finish reason, and its completion as
    relayed tokens."""
    meter.observe_usage(body.get("usage"))
    meter.observe_chunk(body)


def _parse(payload: str) -> dict[str, Any] | None:
    try:
        chunk = orjson.loads(payload)  # 3-4x the standard library's speed: once per event
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _storable_finish_reason(reason: Any) -> str | None:
    """``reason`` as the usage record keeps it: a string of 1 to MAX_FINISH_REASON_LENGTH
    printable ASCII characters, as OpenAI's and our engine's all are. Anything else (an
    upstream that is not ours may send anything) is recorded as None rather than cut short:
    a truncated reason would be one the engine never sent."""
    if (
        isinstance(reason, str)
        and 0 < len(reason) <= MAX_FINISH_REASON_LENGTH
        and reason.isascii()
        and reason.isprintable()
    ):
        return reason
    return None


def _tokens_in(choice: dict[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("content") or logprobs.get("tokens")
        if isinstance(entries, list) and entries:
            return 1 if _echoes_the_prompt(logprobs) else len(entries)
    said = choice.get("delta") or choice.get("message") or {}
    if said.get("tool_calls"):
        return 1
    content = said.get("content")
    if content is None:
        content = choice.get("text")
    return 1 if content else 0


def _echoes_the_prompt(logprobs: dict[str, Any]) -> bool:
    """A completion chunk whose logprobs start with its prompt's (``echo``): the first has
    nothing before it, so its logprob is null; a generated token's never is."""
    token_logprobs = logprobs.get("token_logprobs")
    return isinstance(token_logprobs, list) and bool(token_logprobs) and token_logprobs[0] is None


def _int(value: Any, default: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )
