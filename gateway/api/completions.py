"""``/v1/chat/completions`` and ``/v1/completions``: authenticate, admit, forward, relay.

authenticate (key cache) ─401─► (no record: no tenant to charge)
     │
read + parse body ─400/413─┬─► Accountant.reject  (one "rejected" record; a key revoked
admission (policies) ─4xx──┘                       meanwhile is a 401 without one)
     │ Admission
_forward: UpstreamPool.open, then one function per kind of answer:
     ├─ none (no engine answered) ─503
     ├─ _engine_error ─4xx (the engine's refusal) / 502 (its failure)
     ├─ _json_answer (a body that is not JSON: 502)
     ├─ _streamed_answer
     ├─ _after_departure (the client left before a JSON answer) ─499
     └─ _at_drain_deadline (the gateway is stopping: its drain's deadline came first) ─503
   (none while neither the spill file nor the database takes records: 503 at once)
   each ending through the request's `RequestEnd` (`gateway.api.request_end` says what each
   records and when): one usage record, durable before the answer's last bytes, then the
   upstream call closed and the reservation settled after them.

The engine is asked for the served version's ``upstream_model`` id; the answer's ``model``
(JSON or every chunk) is the public name the request was served under (after routing aliases:
a model or a rollout, never a rollout's version), so an OpenAI client sees the name it can
send again. The version shows in the ``x-tollway-model-version`` header.

A client that leaves is charged what the engine generated for it: a stream up to the last
token relayed; a non-streamed request up to where the engine stopped (asked to by
``UpstreamPool.stop``, it answers with its usage), or its prompt alone if that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Coroutine
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.accounting.settlement import RequestInfo
from gateway.admission.outcomes import Admission, Refusal
from gateway.api.handler_context import GatewayContext
from gateway.api.request_body import parse_body, read_json, requested_model
from gateway.api.request_end import AnswerThenSettle, RequestEnd
from gateway.auth.bearer_keys import bearer_token
from gateway.completion_body import CompletionBody
from gateway.errors import (
    SHUTTING_DOWN,
    ApiError,
    error_response,
    from_engine_answer,
    invalid_api_key,
    to_rejection,
    unreadable_engine_answer,
    usage_records_unavailable,
)
from gateway.storage.models import UsageStatus
from gateway.upstream.drain_deadline import DrainCutOff, DrainDeadline
from gateway.upstream.pool import UpstreamCall
from gateway.upstream.stream_relay import UsageMeter, measure_body, relay_events
from openai_protocol.disconnect import until_client_leaves
from openai_protocol.field_rules import Endpoint
from openai_protocol.sse import EventStreamResponse

ROUTE_HEADER = "x-tollway-route"
VERSION_HEADER = "x-tollway-model-version"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"
STOP_GRACE_S = 5.0  # how long an engine asked to stop a request has to answer
CUT_OFF_STOP_WAIT_S = 1.0  # the same at the drain's deadline (within draining_server.BACKSTOP_S)
_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_OPERATIONS: dict[Endpoint, str] = {"chat": "chat", "completions": "text_completion"}


async def chat_completions(request: Request) -> Response:
    """Create a chat completion (OpenAI's API; streamed with "stream": true).
    ---
    {body: ChatCompletionBody, 200: ChatCompletion, events: ChatCompletionChunk,
     errors: [400, 403, 404, 413, 429, 502, 503]}
    """
    return await _complete(request, "chat")


async def completions(request: Request) -> Response:
    """Create a text completion (OpenAI's legacy API; streamed with "stream": true).
    ---
    {body: CompletionBody, 200: Completion, events: Completion,
     errors: [400, 403, 404, 413, 429, 502, 503]}
    """
    return await _complete(request, "completions")


async def _complete(request: Request, endpoint: Endpoint) -> Response:
    ctx = GatewayContext.of(request)
    token = bearer_token(request)
    if token is None:
        raise invalid_api_key()
    key = await ctx.keys.key(token)
    caller = key.caller
    span = ctx.tracer.start_span(
        f"{_OPERATIONS[endpoint]} gateway",
        attributes={
            "gen_ai.operation.name": _OPERATIONS[endpoint],
            "gen_ai.system": "tollway",
            "tollway.request_id": request.state.request_id,
            "tollway.tenant_id": caller.tenant_id,
        },
    )
    info = RequestInfo(
        request_id=request.state.request_id,
        endpoint=endpoint,
        caller=caller,
        requested_model="",
        is_stream=False,
        created_at=datetime.now(timezone.utc),
        span=span,
    )
    try:
        data = await read_json(request, ctx.settings.max_body_bytes)
        info = replace(info, requested_model=requested_model(data))
        body = parse_body(data, endpoint)
        info = replace(
            info, requested_model=body.model, is_stream=body.is_stream, end_user=body.user
        )
        span.set_attribute("gen_ai.request.model", body.model)
        decision = await ctx.admitter.admit(key, body, request.headers.get("x-priority"))
    except Exception as exc:
        decision = Refusal(to_rejection(exc))
        if decision.rejection.status == 401:  # revoked since it was cached: as authenticate
            span.end()
            raise
        if not isinstance(exc, ApiError):
            ctx.accountant.reject(info, decision)
            raise
    if isinstance(decision, Refusal):
        ctx.accountant.reject(info, decision)
        raise ApiError(decision.rejection)
    span.set_attribute("gen_ai.request.max_tokens", decision.max_tokens)
    if decision.reservation is not None:
        ctx.metrics.reservations_in_flight.inc()
    return await _forward(request, ctx, info, body, decision, _PATHS[endpoint])


async def _forward(
    request: Request,
    ctx: GatewayContext,
    info: RequestInfo,
    body: CompletionBody,
    admission: Admission,
    path: str,
) -> Response:
    """Send the admitted request to an engine and answer with what comes back, by kind: the
    engine's error (`_engine_error`), a stream (`_streamed_answer`) or a JSON answer
    (`_json_answer`); or nothing, the client having left first (`_after_departure`). Each
    ends the request through its `RequestEnd`."""
    end = RequestEnd(ctx.accountant, info, admission, _usage_meter(ctx, admission))
    if not ctx.accountant.takes_records():  # its answer could not be recorded: ask no engine
        refusal = usage_records_unavailable()
        end.reject(refusal.rejection)
        await end.finish()
        raise refusal
    opening = _open_upstream(ctx, info, body, admission, path)
    # Non-streamed, the call goes on if the client leaves (see _after_departure).
    answering = None if body.is_stream else asyncio.ensure_future(opening)
    model = admission.served_model
    headers = _answer_headers(admission)
    try:
        call = await ctx.drain_deadline.wait(
            opening
            if answering is None
            else until_client_leaves(request.receive, asyncio.shield(answering))
        )
    except DrainCutOff:
        return await _at_drain_deadline(ctx, end, answering, headers)
    except BaseException:
        if answering is not None:
            answering.cancel()
        await end.finish(UsageStatus.UPSTREAM_ERROR, was_answered=False)
        raise
    if call is None:  # the client left before a non-streamed answer was ready
        return await _after_departure(ctx, end, answering)
    if call.status_code >= 400:
        return await _engine_error(end, call, model, headers)
    if body.is_stream:
        return _streamed_answer(end, call, body.include_usage, model, headers, ctx.drain_deadline)
    return await _json_answer(end, call, model, headers)


async def _engine_error(
    end: RequestEnd, call: UpstreamCall, model: str, headers: dict[str, str]
) -> Response:
    """The gateway's own error for the engine's (`from_engine_answer`). A 5xx (the engine
    failed, or cannot serve) is recorded as an upstream error; a 4xx (the engine refused the
    request) as a refusal at the door, with its code. Nothing is charged either way."""
    rejection = from_engine_answer(call.status_code, call.body, model)
    if rejection.status >= 500:
        await end.record(UsageStatus.UPSTREAM_ERROR, was_answered=False)
    else:
        end.reject(rejection)
    await end.finish()
    return error_response(rejection, headers)


def _streamed_answer(
    end: RequestEnd,
    call: UpstreamCall,
    include_usage: bool,
    model: str,
    headers: dict[str, str],
    deadline: DrainDeadline,
) -> Response:
    """The engine's events relayed as they come (`relay_events` measures them): recorded
    before ``[DONE]`` is sent, or at the close if the stream stopped earlier (client gone,
    engine failed); the upstream call closed and the reservation settled when the response
    ends, however it ends. At the drain's deadline the relay ends the stream itself."""
    events = relay_events(
        call,
        end.meter,
        include_usage=include_usage,
        before_end=end.record,
        model_name=model,
        deadline=deadline,
    )
    return EventStreamResponse(
        events, on_close=functools.partial(end.finish, closing=call), headers=headers
    )


async def _json_answer(
    end: RequestEnd, call: UpstreamCall, model: str, headers: dict[str, str]
) -> Response:
    """The engine's JSON as it came (renamed if need be): recorded before it is sent,
    settled after."""
    answer = _json_object(call.body)
    if answer is None:
        await end.finish(UsageStatus.UPSTREAM_ERROR, was_answered=False)
        raise unreadable_engine_answer()
    measure_body(answer, end.meter)
    await end.record(UsageStatus.COMPLETED)
    return AnswerThenSettle(_with_model(call.body, answer, model), headers, end.finish)


async def _after_departure(
    ctx: GatewayContext, end: RequestEnd, answering: asyncio.Future[UpstreamCall] | None
) -> Response:
    """Charge a non-streamed request whose client has left for what the engine generated:
    the engine is asked to stop the request and then answers at once, with its usage. If
    it cannot (an engine without the stop endpoint, a failure) or does not answer within
    ``STOP_GRACE_S``, the upstream call is cancelled (the engine aborts) and the prompt
    alone is charged. Recorded as cancelled either way."""
    if answering is not None:
        await _stop_and_measure(ctx, end, answering, STOP_GRACE_S)
    await end.finish()
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _at_drain_deadline(
    ctx: GatewayContext,
    end: RequestEnd,
    answering: asyncio.Future[UpstreamCall] | None,
    headers: dict[str, str],
) -> Response:
    """The gateway is stopping and its drain's deadline came before the engine's answer
    (`gateway.upstream.drain_deadline`): a 503 ``server_shutting_down`` with ``Retry-After``,
    recorded as cancelled and settled first. A non-streamed request is charged what its
    engine generated, as in `_after_departure` but waiting at most ``CUT_OFF_STOP_WAIT_S``
    (uvicorn cancels what is left soon after); a stream that has not started, nothing."""
    if answering is not None:
        await _stop_and_measure(ctx, end, answering, CUT_OFF_STOP_WAIT_S)
        await end.record(UsageStatus.CANCELLED)
    else:
        await end.record(UsageStatus.CANCELLED, was_answered=False)
    await end.finish()
    return error_response(SHUTTING_DOWN, headers)


async def _stop_and_measure(
    ctx: GatewayContext, end: RequestEnd, answering: asyncio.Future[UpstreamCall], wait_s: float
) -> None:
    """Ask the engine to stop the request ``answering`` waits for, and measure the answer
    it then gives at once (its usage: what it generated), or the one that came meanwhile.
    Within ``wait_s`` or not at all: then, or if the engine cannot stop it, the call is
    cancelled (the engine aborts) and nothing is measured (the prompt alone is charged)."""
    model, request_id = end.admission.version, end.info.request_id

    async def stopped_answer() -> UpstreamCall | None:
        if answering.done() or await ctx.upstreams.stop(model, request_id):
            return await answering
        return None

    stopped = None
    with contextlib.suppress(Exception):  # the call's own failure, or the wait's timeout
        stopped = await asyncio.wait_for(stopped_answer(), wait_s)
    answering.cancel()
    await asyncio.gather(answering, return_exceptions=True)
    answer = _json_object(stopped.body) if stopped and stopped.status_code < 400 else None
    if answer is not None:
        measure_body(answer, end.meter)


def _open_upstream(
    ctx: GatewayContext,
    info: RequestInfo,
    body: CompletionBody,
    admission: Admission,
    path: str,
) -> Coroutine[Any, Any, UpstreamCall]:
    """The engine call for the served version (`UpstreamPool.open`), not started yet."""
    metrics, model, version = ctx.metrics, admission.served_model, admission.version
    headers = {
        "x-tenant-id": info.caller.tenant_id,
        "x-priority": admission.priority,
        "x-request-id": info.request_id,
    }
    return ctx.upstreams.open(
        version,
        path,
        upstream_body(body, admission, ctx.settings.models[version].upstream_id),
        headers,
        is_stream=body.is_stream,
        on_replica_error=lambda _m, _reason: metrics.child(
            metrics.upstream_errors, model, version
        ).inc(),
        prompt_token_ids=admission.prompt_token_ids,
    )


def _usage_meter(ctx: GatewayContext, admission: Admission) -> UsageMeter:
    metrics, model, version = ctx.metrics, admission.served_model, admission.version
    return UsageMeter(
        on_first_token=metrics.child(metrics.time_to_first_token, model, version).observe,
        on_next_token=metrics.child(metrics.inter_token_latency, model, version).observe,
        started_at=time.monotonic(),
        max_completion_tokens=admission.max_completion_tokens,
    )


def _answer_headers(admission: Admission) -> dict[str, str]:
    headers = dict(admission.headers)
    headers[VERSION_HEADER] = admission.version
    if admission.route is not None:
        headers[ROUTE_HEADER] = f"{admission.served_model}; reason={admission.route.reason}"
    return headers


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return answer if isinstance(answer, dict) else None


def _with_model(body: bytes, answer: dict[str, Any], model: str) -> bytes:
    """The engine's answer with ``model`` as the client's name (the bytes as they came when
    the engine already used it)."""
    if answer.get("model", model) == model:
        return body
    return orjson.dumps({**answer, "model": model})


def upstream_body(
    body: CompletionBody, admission: Admission, upstream_model: str
) -> dict[str, Any]:
    """The client's request for the engine: the engine's id for the served version
    (``upstream_model``), the admitted ``max_tokens``, and always the final usage chunk on
    streams."""
    out = {k: v for k, v in body.raw.items() if k not in ("max_completion_tokens", "tollway_hint")}
    out["model"] = upstream_model
    out["max_tokens"] = admission.max_tokens
    if body.is_stream:
        out["stream_options"] = {"include_usage": True}
    return out
