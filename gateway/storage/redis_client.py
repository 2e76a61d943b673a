"""A lean Redis client for the request path: commands pipelined on one redis-py connection.

redis-py's ``redis.asyncio.Redis`` spends 40-100 µs of CPU on every command (pool checkout
under a lock, retry and timeout wrappers, observability hooks), more than the gateway's own
work on a request. The request path needs little of it: two Lua scripts per request (admit,
settle) and a few plain commands. This client keeps redis-py's connection object, which
connects, authenticates and selects the database as the URL says and parses replies (with
hiredis), and drives it directly: each command is encoded by hiredis and written at once,
and one reader task hands the replies back in order (Redis answers a connection's commands
in the order it received them)::

    caller ─► pending futures (FIFO) ◄─ reader task: read_response() ◄─ redis-server
       └──── hiredis.pack_command ──► send_packed_command() ───────────► redis-server

Any number of calls share the connection, so there is no pool to run dry. A lost
connection fails every pending call with redis-py's ``ConnectionError`` and the next call
connects again; nothing is retried (a script that may have run must not run twice). A
caller cancelled while waiting leaves its future behind; its reply is read and dropped, so
the replies after it still reach their own callers. Scripts run by SHA; after ``NOSCRIPT``
(a restarted or flushed server) the script is loaded and run once more. It speaks the subset
of redis-py's client API the ledger, the admission store and the auth epochs use
(``RedisCommands``), so either client serves them.

Time limits: connecting (and authenticating) must finish within ``connect_timeout_s``, and
every call must be answered within ``timeout_s`` of being sent, else it fails with redis-py's
``TimeoutError``. Callers that arrive while a connection is being made wait for that one
attempt and share its outcome, so a dead server costs each of them one ``connect_timeout_s``
at most. Replies come back in order, so the oldest call waiting is the first to be late; one
watchdog timer per connection, set at that call's deadline and moved on to the next oldest
when it fires early, checks them all (no timer per call or per read). A late reply means a
stalled connection, unless other replies are still arriving (the event loop was busy, not
Redis): it is closed, failing every call still waiting on it (a reply that came
afterwards would otherwise answer the wrong call), and the next call connects again. A call
that timed out may still run on the server once it wakes (callers that care say so: see
``AdmissionTimedOut``). Blocking commands (``BLPOP``...) longer than ``timeout_s`` do not fit
this client, and a URL's ``socket_timeout`` is ignored: the watchdog does that job.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import hiredis
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.defaults import DEFAULT_REDIS_CONNECT_TIMEOUT_S, DEFAULT_REDIS_TIMEOUT_S

Arg = bytes | str | int | float

_LOOK_AGAIN = 3  # loop iterations a late call is given to show its reply already came


class RedisCommands(Protocol):
    """What the Redis-backed stores need of a client: redis-py's ``Redis`` or ``LeanRedis``."""

    def register_script(self, script: str) -> Any: ...

    async def execute_command(self, *args: Any) -> Any: ...


class LeanRedis:
    """``redis://``, ``rediss://`` or ``unix://`` URLs with their options, as redis-py takes
    them (credentials, ``?db=3``, TLS options). Replies are RESP2 unless ``?protocol=3``.
    ``connect_timeout_s`` bounds making a connection, ``timeout_s`` every call (see above)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = DEFAULT_REDIS_CONNECT_TIMEOUT_S,
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
    ) -> None:
        if not connect_timeout_s > 0 or not timeout_s > 0:
            raise ValueError(
                f"Redis timeouts must be > 0, got connect_timeout_s={connect_timeout_s}, "
                f"timeout_s={timeout_s}"
            )
        options: dict[str, Any] = dict(parse_url(url))
        self._connection_class: type[AbstractConnection] = options.pop(
            "connection_class", Connection
        )
        options.setdefault("protocol", 2)
        options["socket_timeout"] = None  # the watchdog's job: no timer on every read
        options.setdefault("socket_connect_timeout", connect_timeout_s)
        self._options = options
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._pipe: _Pipe | None = None
        self._connecting: asyncio.Future[_Pipe] | None = None

    def register_script(self, script: str) -> Script:
        return Script(self, script)

    async def execute_command(self, *args: Arg) -> Any:
        pipe = self._pipe
        if pipe is None or pipe.is_closed:
            pipe = await self._connect()
        command = hiredis.pack_command(args)  # type: ignore[arg-type]  # stub says a 1-tuple
        return await pipe.call(command)

    async def aclose(self) -> None:
        """Close the connection; calls in flight fail, later calls connect again."""
        attempt = self._connecting
        if attempt is not None and not attempt.done():  # its connection is closed below
            await asyncio.gather(attempt, return_exceptions=True)  # within connect_timeout_s
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            await pipe.close(RedisConnectionError("the Redis client was closed"))

    async def _connect(self) -> _Pipe:
        """The attempt under way, or a new one: one connect, however many callers wait."""
        attempt = self._connecting
        if attempt is None or attempt.done():
            attempt = self._connecting = asyncio.ensure_future(self._open())
            attempt.add_done_callback(_retrieve)
        return await asyncio.shield(attempt)  # a caller cancelled leaves it to the others

    async def _open(self) -> _Pipe:
        connection = self._connection_class(**self._options)
        try:
            await asyncio.wait_for(connection.connect(), self._connect_timeout_s)
        except BaseException as error:
            await connection.disconnect(nowait=True)
            # asyncio's is a TimeoutError of its own before Python 3.11
            if isinstance(error, TimeoutError | asyncio.TimeoutError):
                raise RedisTimeoutError(
                    f"connecting to Redis took longer than {self._connect_timeout_s} s"
                ) from None
            raise
        self._pipe = _Pipe(connection, self._timeout_s)
        return self._pipe


def _retrieve(attempt: asyncio.Future[_Pipe]) -> None:
    """Mark a failed connect as seen: every caller waiting on it may have been cancelled."""
    if not attempt.cancelled():
        attempt.exception()


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``), loaded again if the server lost it."""

    def __init__(self, client: LeanRedis, text: str) -> None:
        self._client = client
        self._text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        try:
            return await self._client.execute_command(*command)
        except NoScriptError:
            await self._client.execute_command("SCRIPT", "LOAD", self._text)
            return await self._client.execute_command(*command)


class _Pipe:
    """One connection, its calls awaiting replies in the order they were sent (each with its
    deadline), the task that reads the replies and the watchdog that enforces the deadlines.
    Closed for good on the first failure."""

    def __init__(self, connection: AbstractConnection, timeout_s: float) -> None:
        self._connection = connection
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._deadlines: deque[float] = deque()  # loop time; one per pending future
        self._watchdog: asyncio.Handle | None = None
        self._num_replies = 0
        self._disconnecting: asyncio.Task[None] | None = None
        self.is_closed = False
        self._reader = self._loop.create_task(self._read_replies())

    async def call(self, command: bytes) -> Any:
        loop = self._loop
        future = loop.create_future()
        deadline = loop.time() + self._timeout_s
        self._pending.append(future)
        self._deadlines.append(deadline)
        if self._watchdog is None:
            self._watchdog = loop.call_at(deadline, self._watch)
        try:  # written before the first suspension, so in the order of the futures
            await self._connection.send_packed_command(command, check_health=False)
        except BaseException as error:  # redis-py has dropped the connection
            future.cancel()
            await self.close(error)
            raise
        return await future

    async def close(self, error: BaseException) -> None:
        """Fail every pending call with ``error`` (a ``ConnectionError`` unless it is a
        ``TimeoutError``) and drop the connection."""
        self._fail(error)
        await self._connection.disconnect(nowait=True)

    def _fail(self, error: BaseException) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if not isinstance(error, RedisConnectionError | RedisTimeoutError):
            error = RedisConnectionError(f"the connection to Redis was lost: {error!r}")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)
        self._deadlines.clear()
        if self._reader is not asyncio.current_task():
            self._reader.cancel()

    def _watch(self) -> None:
        """The watchdog: close the connection if its oldest call is late, else wait for that
        call's deadline."""
        self._watchdog = None
        if self.is_closed or not self._deadlines:
            return
        deadline = self._deadlines[0]
        if self._loop.time() < deadline:
            self._watchdog = self._loop.call_at(deadline, self._watch)
            return
        self._watchdog = self._loop.call_soon(self._confirm_late, self._num_replies, _LOOK_AGAIN)

    def _confirm_late(self, num_replies: int, num_looks: int) -> None:
        """A deadline passed: close the connection unless replies are still coming in. A
        reply already received is handed to its caller a loop iteration or two after it
        arrives, so a busy event loop (a burst of requests) can find a deadline passed with
        the answer waiting in the socket: look again for a few iterations before blaming
        Redis."""
        self._watchdog = None
        if self.is_closed or not self._deadlines:
            return
        if self._num_replies != num_replies:  # Redis answers: the loop was only behind
            self._watch()
        elif num_looks > 1:
            self._watchdog = self._loop.call_soon(self._confirm_late, num_replies, num_looks - 1)
        else:
            self._fail(RedisTimeoutError(f"Redis did not answer within {self._timeout_s} s"))
            # Abort, not close: a graceful close waits for unsent bytes that a stalled server
            # never reads, and a call still writing (drain) would wait with it, unbounded.
            writer = getattr(self._connection, "_writer", None)
            if writer is not None:
                writer.transport.abort()
            self._disconnecting = self._loop.create_task(self._connection.disconnect(nowait=True))

    async def _read_replies(self) -> None:
        read_response, pending, deadlines = (
            self._connection.read_response,
            self._pending,
            self._deadlines,
        )
        while True:
            try:
                reply = await read_response(disconnect_on_error=False)
            except ResponseError as error:  # a whole reply, an error one
                reply = error
            except asyncio.CancelledError:
                raise
            except BaseException as error:  # lost, or a reply redis-py cannot read
                await self.close(error)
                return
            if not pending:
                await self.close(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            future = pending.popleft()
            deadlines.popleft()
            self._num_replies += 1
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
