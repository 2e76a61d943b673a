"""The HTTP endpoints. Handlers gather facts, call the engine, and format; errors are raised."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend_engine.async_engine import AsyncEngine
from backend_engine.server.choice_streams import ChoiceStreams, request_ids
from backend_engine.server.completion_format import CompletionFormatter
from backend_engine.server.context import ServerContext
from backend_engine.server.engine_host import EngineState
from backend_engine.server.engine_prompts import EnginePrompt, completion_prompts, engine_prompt
from backend_engine.server.errors import invalid_request, model_not_found, to_api_error
from backend_engine.server.kv_event_stream import kv_events
from backend_engine.server.metrics import CONTENT_TYPE
from backend_engine.server.openai_format import JSON, ChatFormatter, ResponseIdentity
from backend_engine.server.output_constraints import parses_tool_calls
from backend_engine.server.request_reader import RequestMeta, read_meta, read_model
from backend_engine.server.usage_tally import UsageTally
from model_files.chat_rendering import ChatRenderingError
from openai_protocol.request_models import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ConstrainedRequest,
)
from openai_protocol.sse import DONE, EventStreamResponse, event

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"

Handler = Callable[[Request], Awaitable[Response]]
Formatter = ChatFormatter | CompletionFormatter


def _counted(endpoint: str, handler: Handler) -> Handler:
    async def counted(request: Request) -> Response:
        metrics = ServerContext.of(request).metrics
        try:
            response = await handler(request)
        except Exception as exc:
            metrics.count_request(endpoint, to_api_error(exc).status_code)
            raise
        metrics.count_request(endpoint, response.status_code)
        return response

    return counted


def _check_model(engine: AsyncEngine, model: str) -> None:
    if model != engine.model_name:
        raise model_not_found(model)


async def chat_completions(request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.host.accepting()  # a 503 while loading or draining, before anything else
    meta = read_meta(request)  # bad headers are refused before the body is read
    body = await read_model(request, ChatCompletionRequest, ctx.max_body_bytes, endpoint="chat")
    _check_model(engine, body.model)
    try:
        prompt_ids = await anyio.to_thread.run_sync(
            partial(engine.tokenizer.encode_chat, body.chat_messages(), tools=body.tool_dicts())
        )
    except ChatRenderingError as exc:
        raise invalid_request(str(exc), param=exc.param) from None
    prompt = engine_prompt(engine, body, prompt_ids, prompt_param="messages")
    ident = _identity(ctx, engine, "chatcmpl")
    formatter = ChatFormatter(
        ident,
        ctx.host.token_text,
        body.requested_logprobs() is not None,
        num_choices=body.n,
        parses_tool_calls=parses_tool_calls(body),
    )
    return await _generate(request, ctx, meta, body, [prompt], formatter, endpoint="chat")


async def completions(request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.host.accepting()
    meta = read_meta(request)
    body = await read_model(request, CompletionRequest, ctx.max_body_bytes, endpoint="completions")
    _check_model(engine, body.model)
    prompts = await completion_prompts(engine, body)
    ident = _identity(ctx, engine, "cmpl")
    want_logprobs = body.requested_logprobs() is not None
    formatter = CompletionFormatter(
        ident, ctx.host.token_text, want_logprobs, prompts, echo=body.echo
    )
    return await _generate(request, ctx, meta, body, prompts, formatter, endpoint="completions")


def _identity(ctx: ServerContext, engine: AsyncEngine, prefix: str) -> ResponseIdentity:
    return ResponseIdentity(
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=engine.model_name,
        system_fingerprint=ctx.host.system_fingerprint,
    )


async def _generate(
    request: Request,
    ctx: ServerContext,
    meta: RequestMeta,
    body: ConstrainedRequest,
    prompts: list[EnginePrompt],
    formatter: Formatter,
    *,
    endpoint: str,
) -> Response:
    """Run every prompt (each with its ``n`` choices) and answer with all their choices."""
    engine = ctx.host.accepting()
    started = time.monotonic()

    def on_first_token() -> None:
        ctx.metrics.observe_time_to_first_token(endpoint, time.monotonic() - started)

    response_id = formatter.ident.id
    engine_ids = tuple(request_ids(response_id, len(prompts)))
    caller_id: str = request.state.request_id
    ctx.host.admit(response_id)  # a drain waits for it from now on (a 503 if one has begun)
    ctx.in_flight[caller_id] = engine_ids  # from now on POST /abort_request can stop it

    def forget() -> None:
        ctx.host.release(response_id)
        if ctx.in_flight.get(caller_id) == engine_ids:  # not a later request's reuse of the id
            del ctx.in_flight[caller_id]

    try:
        streams = await ChoiceStreams.start(engine, engine_ids, prompts, meta, on_first_token)
    except BaseException:
        forget()
        raise
    if body.stream:

        async def on_close() -> None:
            forget()
            await streams.close()

        events = _events(streams, formatter, include_usage=body.include_usage)
        return EventStreamResponse(events, on_close=on_close)
    try:
        choices = await streams.collect(request.receive)
    finally:
        forget()
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(formatter.whole(choices, UsageTally.of(choices).usage()))


async def abort_request(request: Request) -> Response:
    """Stop an in-flight generation by the ``x-request-id`` it was sent with. Its own
    response still arrives, with ``finish_reason: "abort"`` and the usage of what was
    generated: how the gateway bills a non-streamed request whose client has left."""
    ctx = ServerContext.of(request)
    body = await read_model(request, AbortRequest, ctx.max_body_bytes)
    engine_request_ids = ctx.in_flight.get(body.request_id)
    engine = ctx.host.engine
    if engine_request_ids is not None and engine is not None:
        for engine_request_id in engine_request_ids:
            await engine.abort(engine_request_id)
    return JSONResponse({"aborted": engine_request_ids is not None})


async def _events(
    streams: ChoiceStreams, formatter: Formatter, *, include_usage: bool
) -> AsyncIterator[str]:
    def emit(chunk: JSON) -> str:
        return event({**chunk, "usage": None} if include_usage else chunk)

    for chunk in formatter.opening_chunks():
        yield emit(chunk)
    tally = UsageTally()
    try:
        async with aclosing(streams.__aiter__()) as choices:
            async for choice in choices:
                tally.add(choice)
                for chunk in formatter.chunks(choice):
                    yield emit(chunk)
    except Exception as exc:
        logger.exception("stream %s failed", formatter.ident.id)
        yield event(to_api_error(exc).body())
        yield DONE
        return
    if include_usage and not tally.is_empty:
        yield event(formatter.usage_chunk(tally.usage()))
    yield DONE


def _model_card(ctx: ServerContext, engine: AsyncEngine) -> JSON:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "tollway",
        "max_model_len": engine.max_model_len,
    }


async def models(request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.host.built_engine()
    return JSONResponse({"object": "list", "data": [_model_card(ctx, engine)]})


async def model(request: Request) -> Response:
    """One model's card (``GET /v1/models/{id}``); a 404 ``model_not_found`` for others."""
    ctx = ServerContext.of(request)
    engine = ctx.host.built_engine()
    _check_model(engine, request.path_params["model_id"])
    return JSONResponse(_model_card(ctx, engine))


async def health(request: Request) -> Response:
    """Liveness: the process serves HTTP (also while it loads or drains)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Readiness: 200 once the model is loaded and requests are taken, else a 503 naming
    the state (``loading``, ``draining``)."""
    state = ServerContext.of(request).host.state
    status_code = 200 if state is EngineState.READY else 503
    return JSONResponse({"status": state.value}, status_code=status_code)


async def metrics(request: Request) -> Response:
    ctx = ServerContext.of(request)
    payload = await anyio.to_thread.run_sync(ctx.metrics.render)
    return Response(payload, media_type=CONTENT_TYPE)


ROUTES = [
    Route("/v1/chat/completions", _counted("chat", chat_completions), methods=["POST"]),
    Route("/v1/completions", _counted("completions", completions), methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/kv_events", kv_events, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
