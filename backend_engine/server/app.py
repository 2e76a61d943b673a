"""The engine's HTTP app and the ``tollway engine`` entry point.

``serve`` answers HTTP at once and loads the model in the background (`EngineHost`):
``/health`` is up from the start, ``/ready`` turns 200 once the model is loaded. The first
SIGTERM drains: new requests get a 503, those in flight finish (for up to the config's
``drain_grace_s``), then the process exits 0. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.core.step_runner import PlanRunner
from backend_engine.server.context import ServerContext
from backend_engine.server.engine_host import EngineHost
from backend_engine.server.errors import EXCEPTION_HANDLERS
from backend_engine.server.metrics import ServerMetrics
from backend_engine.server.request_id import ClientRequestIdMiddleware
from backend_engine.server.request_reader import DEFAULT_MAX_BODY_BYTES
from backend_engine.server.routes import ROUTES
from model_files.checkpoint import Checkpoint

EngineLoader = Callable[[], Awaitable[AsyncEngine]]


def build_app(
    engine: AsyncEngine | EngineLoader,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    host: EngineHost | None = None,
) -> Starlette:
    """An app serving ``engine``: a built one (ready from the start), or a coroutine function
    that builds one (the app answers meanwhile, not ready). Its lifespan starts the engine
    and shuts it down. ``host``: the engine's keeper (needed with a loader, for its drain
    grace; by default one with the built engine's ``drain_grace_s``)."""
    if host is None:
        if not isinstance(engine, AsyncEngine):
            raise ValueError("build_app needs a host to load an engine in the background")
        host = EngineHost(engine.config.drain_grace_s)
    engine_host = host

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading: asyncio.Task[None] | None = None
        if isinstance(engine, AsyncEngine):
            await engine_host.start(engine)
        else:
            loading = asyncio.get_running_loop().create_task(engine_host.load(engine))
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
            if engine_host.engine is not None:
                await engine_host.engine.shutdown()

    app = Starlette(
        routes=ROUTES,
        middleware=[Middleware(ClientRequestIdMiddleware)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.context = ServerContext(
        host=engine_host,
        metrics=ServerMetrics(
            lambda: engine_host.engine.stats() if engine_host.engine is not None else None
        ),
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


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains the engine rather than closing at once;
    the host stops the server when the drain is over (uvicorn, not having seen the signal,
    then exits with 0 rather than re-raising it)."""

    def __init__(self, config: uvicorn.Config, engine_host: EngineHost) -> None:
        super().__init__(config)
        self.engine_host = engine_host
        self._is_draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._is_draining and not self.should_exit:
            self._is_draining = self.engine_host.request_drain()
            if self._is_draining:
                return
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        self.should_exit = True


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8100,
    uds: str | None = None,
    model_name: str | None = None,
    plan_runner: PlanRunner | None = None,
) -> None:
    """Serve on TCP ``host:port``, or on the Unix socket ``uds``, while the model loads in
    the background (``plan_runner``: what computes the tokens, by default the model; see
    `LLMEngine`). Returns after a drain or a stop; raises what building the engine raised.

    The checkpoint is checked first (torch-free, all but the weights): a bad one is refused
    before the server starts, so the command's error stays one line."""
    Checkpoint(config.model).check()

    async def load() -> AsyncEngine:
        engine = await AsyncEngine.load(config, model_name, plan_runner)
        # The model, tokenizer and imports live as long as the process: keep full
        # collections from walking them (each one pauses the step loop and every stream).
        gc.collect()
        gc.freeze()
        return engine

    server: DrainingServer

    def stop_server() -> None:
        server.stop()

    engine_host = EngineHost(config.drain_grace_s, stop_server=stop_server)
    app = build_app(load, host=engine_host)
    server = DrainingServer(uvicorn_config(app, host=host, port=port, uds=uds), engine_host)
    server.run()
    if engine_host.load_error is not None:
        raise engine_host.load_error
