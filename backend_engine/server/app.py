"""The engine's HTTP app and the ``tollway engine`` entry point."""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.context import ServerContext
from backend_engine.server.errors import EXCEPTION_HANDLERS
from backend_engine.server.metrics import ServerMetrics
from backend_engine.server.request_id import RequestIdMiddleware
from backend_engine.server.request_reader import DEFAULT_MAX_BODY_BYTES
from backend_engine.server.routes import ROUTES
from backend_engine.server.token_text import TokenText
from backend_engine.step_runner import PlanRunner


def build_app(engine: AsyncEngine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """An app serving ``engine``; its lifespan starts the engine and shuts it down."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = Starlette(
        routes=ROUTES,
        middleware=[Middleware(RequestIdMiddleware)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.context = ServerContext(
        engine=engine,
        metrics=ServerMetrics(engine.stats),
        token_text=TokenText(engine.tokenizer),
        max_body_bytes=max_body_bytes,
        created=int(time.time()),
    )
    return app


def uvicorn_config(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    uds: str | None = None,
    log_level: str = "info",
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=uds,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8100,
    uds: str | None = None,
    model_name: str | None = None,
    plan_runner: PlanRunner | None = None,
) -> None:
    """Load the model and serve it on TCP ``host:port``, or on the Unix socket ``uds``
    (``plan_runner``: what computes the tokens, by default the model; see `LLMEngine`)."""
    engine = AsyncEngine(config, model_name, plan_runner)
    server = uvicorn.Server(uvicorn_config(build_app(engine), host=host, port=port, uds=uds))
    # The model, tokenizer and imports live as long as the process: keep full collections
    # from walking them (each one pauses the step loop and every stream).
    gc.collect()
    gc.freeze()
    server.run()
