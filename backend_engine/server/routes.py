"""The HTTP endpoints. Handlers gather facts, call the engine, and format; errors are raised."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend_engine.async_engine import AsyncEngine
from backend_engine.server.context import ServerContext
from backend_engine.server.engine_host import EngineState
from backend_engine.server.errors import invalid_request, model_not_found, to_api_error
from backend_engine.server.generation import GenerationStream
from backend_engine.server.kv_event_stream import kv_events
from backend_engine.server.metrics import CONTENT_TYPE
from backend_engine.server.openai_format import (
    JSON,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    ResponseIdentity,
)
from backend_engine.server.output_constraints import parses_tool_calls
from backend_engine.server.request_reader import RequestMeta, read_meta, read_model
from backend_engine.server.sampling import completion_budget, sampling_params
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
    return await _generate(
        request, ctx, meta, body, prompt_ids, endpoint="chat", prompt_param="messages"
    )


async def completions(request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.host.accepting()
    meta = read_meta(request)
    body = await read_model(request, CompletionRequest, ctx.max_body_bytes, endpoint="completions")
    _check_model(engine, body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = await anyio.to_thread.run_sync(engine.tokenizer.encode, prompt)
    else:
        prompt_ids = [int(t) for t in prompt]
        vocab_size = engine.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_ids):
            raise invalid_request(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    return await _generate(
        request, ctx, meta, body, prompt_ids, endpoint="completions", prompt_param="prompt"
    )


async def _generate(
    request: Request,
    ctx: ServerContext,
    meta: RequestMeta,
    body: ConstrainedRequest,
    prompt_ids: list[int],
    *,
    endpoint: str,
    prompt_param: str,
) -> Response:
    engine = ctx.host.accepting()
    if not prompt_ids:
        raise invalid_request("the prompt is empty", param=prompt_param)
    max_tokens = completion_budget(
        len(prompt_ids), body.requested_max_tokens(), engine.max_model_len, prompt_param
    )
    params = sampling_params(body, max_tokens)
    is_chat = isinstance(body, ChatCompletionRequest)
    ident = ResponseIdentity(
        id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=engine.model_name,
    )
    want_logprobs = body.requested_logprobs() is not None
    token_text = ctx.host.token_text
    formatter: Formatter = (
        ChatFormatter(ident, token_text, want_logprobs, parses_tool_calls=parses_tool_calls(body))
        if is_chat
        else CompletionFormatter(ident, token_text, want_logprobs)
    )
    started = time.monotonic()

    def on_first_token() -> None:
        ctx.metrics.observe_time_to_first_token(endpoint, time.monotonic() - started)

    caller_id: str = request.state.request_id
    ctx.host.admit(ident.id)  # a drain waits for it from now on (a 503 if one has begun)
    ctx.in_flight[caller_id] = ident.id  # from now on POST /abort_request can stop it

    def forget() -> None:
        ctx.host.release(ident.id)
        if ctx.in_flight.get(caller_id) == ident.id:  # not a later request's reuse of the id
            del ctx.in_flight[caller_id]

    try:
        stream = await GenerationStream.start(
            engine, ident.id, prompt_ids, params, meta, on_first_token
        )
    except BaseException:
        forget()
        raise
    if body.stream:

        async def on_close() -> None:
            forget()
            await stream.close()

        events = _events(stream, formatter, include_usage=body.include_usage)
        return EventStreamResponse(events, on_close=on_close)
    try:
        deltas = await stream.collect(request.receive)
    finally:
        forget()
    if deltas is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(formatter.whole(deltas))


async def abort_request(request: Request) -> Response:
    """Stop an in-flight generation by the ``x-request-id`` it was sent with. Its own
    response still arrives, with ``finish_reason: "abort"`` and the usage of what was
    generated: how the gateway bills a non-streamed request whose client has left."""
    ctx = ServerContext.of(request)
    body = await read_model(request, AbortRequest, ctx.max_body_bytes)
    engine_request_id = ctx.in_flight.get(body.request_id)
    engine = ctx.host.engine
    if engine_request_id is not None and engine is not None:
        await engine.abort(engine_request_id)
    return JSONResponse({"aborted": engine_request_id is not None})


async def _events(
    stream: GenerationStream, formatter: Formatter, *, include_usage: bool
) -> AsyncIterator[str]:
    def emit(chunk: JSON) -> str:
        return event({**chunk, "usage": None} if include_usage else chunk)

    first = formatter.role_chunk()
    if first is not None:
        yield emit(first)
    last = None
    try:
        async for delta in stream:
            last = delta
            for chunk in formatter.chunks(delta):
                yield emit(chunk)
    except Exception as exc:
        logger.exception("stream %s failed", stream.request_id)
        yield event(to_api_error(exc).body())
        yield DONE
        return
    if include_usage and last is not None:
        yield event(formatter.usage_chunk(last))
    yield DONE


async def models(request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.host.built_engine()
    card = {
        "id": engine.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "tollway",
        "max_model_len": engine.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


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
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/kv_events", kv_events, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
