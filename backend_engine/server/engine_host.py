"""The engine behind one server, through its life: loading, ready, draining.

::

    loading ──built──▶ ready ──drain()──▶ draining ──idle or grace over──▶ (server exits)
       └──────────────── drain() ─────────────▲

The server answers HTTP in every state: ``/health`` always, ``/ready`` with the state, and
generation only when ready (`accepting`, else a 503 a gateway retries elsewhere). Every
generation admitted is tracked until its response ends, so a drain knows when the last one
is done. Everything here runs on the server's event loop, except `request_drain`, which a
signal handler may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable

from backend_engine.async_engine import AsyncEngine
from backend_engine.server.errors import engine_draining, engine_not_ready
from backend_engine.server.fingerprint import engine_fingerprint
from backend_engine.server.token_text import TokenText

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 5.0  # after the grace: how long aborted requests get to send their error


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class EngineHost:
    def __init__(self, drain_grace_s: float, stop_server: Callable[[], None] | None = None) -> None:
        """``stop_server``: called when the server should exit: a drain is over, or the
        engine could not be built (``load_error`` says why)."""
        self.drain_grace_s = drain_grace_s
        self.stop_server = stop_server
        self.state = EngineState.LOADING
        self._engine: AsyncEngine | None = None
        self._token_text: TokenText | None = None
        self._system_fingerprint: str | None = None
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.load_error: BaseException | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The server's event loop, once its lifespan has begun."""
        return self._loop

    @property
    def engine(self) -> AsyncEngine | None:
        """The engine once built (also while draining), else None."""
        return self._engine

    def built_engine(self) -> AsyncEngine:
        """The engine once built; a 503 ``engine_not_ready`` while it loads."""
        if self._engine is None:
            raise engine_not_ready()
        return self._engine

    def accepting(self) -> AsyncEngine:
        """The engine, if it takes new requests now; else the 503 saying why not."""
        if self.state is EngineState.DRAINING:
            raise engine_draining()
        return self.built_engine()

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            raise engine_not_ready()
        return self._token_text

    @property
    def system_fingerprint(self) -> str:
        """The engine's build and weights, as every answer reports them (`fingerprint`)."""
        if self._system_fingerprint is None:
            raise engine_not_ready()
        return self._system_fingerprint

    async def start(self, engine: AsyncEngine) -> None:
        """Take a built engine and start serving it (unless a drain began meanwhile)."""
        self._loop = asyncio.get_running_loop()
        await engine.start()
        self._engine = engine
        self._token_text = TokenText(engine.tokenizer)
        self._system_fingerprint = engine_fingerprint(engine)
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
            logger.info("engine ready: serving %s", engine.model_name)

    async def load(self, build: Callable[[], Awaitable[AsyncEngine]]) -> None:
        """Build the engine in the background and start it; a failure is kept in
        ``load_error`` and ends the server (``stop_server``)."""
        self._loop = asyncio.get_running_loop()
        try:
            engine = await build()
        except Exception as exc:
            logger.error("the engine could not be built: %s", exc)
            self.load_error = exc
            self._finish()
            return
        await self.start(engine)

    def admit(self, request_id: str) -> AsyncEngine:
        """Count a generation as in flight until `release`; a 503 unless ready."""
        engine = self.accepting()
        self._in_flight.add(request_id)
        self._idle.clear()
        return engine

    def release(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        if not self._in_flight:
            self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def request_drain(self) -> bool:
        """Begin a drain from any thread or a signal handler (a no-op once one began);
        False when the server's loop is not running (nothing to drain)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(self.begin_drain)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def begin_drain(self) -> None:
        """Stop taking requests now; let those in flight finish within the grace period."""
        if self._drain_task is None:
            self.state = EngineState.DRAINING
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def wait_drained(self) -> None:
        if self._drain_task is not None:
            await self._drain_task

    async def _drain(self) -> None:
        logger.info(
            "draining: %d requests in flight, %.0f s to finish",
            self.num_in_flight,
            self.drain_grace_s,
        )
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_grace_s)
        except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
            logger.warning("drain grace over: aborting %d requests", self.num_in_flight)
            if self._engine is not None:
                await self._engine.shutdown()  # they end with engine_draining
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ABORT_WAIT_S)
        self._finish()

    def _finish(self) -> None:
        if self._engine is not None:
            self._engine.kv_events.close()  # event streams end, so the server can close
        if self.stop_server is not None:
            self.stop_server()
