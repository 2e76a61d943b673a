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

Arg = bytes | str | int | float


class RedisCommands(Protocol):
    """What the Redis-backed stores need of a client: redis-py's ``Redis`` or ``LeanRedis``."""

    def register_script(self, script: str) -> Any: ...

    async def execute_command(self, *args: Any) -> Any: ...


class LeanRedis:
    """``redis://``, ``rediss://`` or ``unix://`` URLs with their options, as redis-py takes
    them (credentials, ``?db=3``, TLS options). Replies are RESP2 unless ``?protocol=3``;
    reads wait without a time limit unless ``?socket_timeout=`` sets one."""

    def __init__(self, url: str) -> None:
        options: dict[str, Any] = dict(parse_url(url))
        self._connection_class: type[AbstractConnection] = options.pop(
            "connection_class", Connection
        )
        options.setdefault("protocol", 2)
        options.setdefault("socket_timeout", None)  # else a timer on every read
        self._options = options
        self._pipe: _Pipe | None = None
        self._connecting: asyncio.Lock | None = None

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
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            await pipe.close(RedisConnectionError("the Redis client was closed"))

    async def _connect(self) -> _Pipe:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connect, however many callers wait for it
            pipe = self._pipe
            if pipe is not None and not pipe.is_closed:
                return pipe
            connection = self._connection_class(**self._options)
            try:
                await connection.connect()
            except BaseException:
                await connection.disconnect(nowait=True)
                raise
            self._pipe = _Pipe(connection)
            return self._pipe


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
    """One connection, its calls awaiting replies in the order they were sent, and the task
    that reads the replies. Closed for good on the first failure."""

    def __init__(self, connection: AbstractConnection) -> None:
        self._connection = connection
        self._pending: deque[asyncio.Future[Any]] = deque()
        self.is_closed = False
        self._reader = asyncio.get_running_loop().create_task(self._read_replies())

    async def call(self, command: bytes) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        try:  # written before the first suspension, so in the order of the futures
            await self._connection.send_packed_command(command, check_health=False)
        except BaseException as error:  # redis-py has dropped the connection
            future.cancel()
            await self.close(error)
            raise
        return await future

    async def close(self, error: BaseException) -> None:
        """Fail every pending call with a ``ConnectionError`` and drop the connection."""
        if not self.is_closed:
            self.is_closed = True
            if not isinstance(error, RedisConnectionError):
                error = RedisConnectionError(f"the connection to Redis was lost: {error!r}")
            while self._pending:
                future = self._pending.popleft()
                if not future.done():
                    future.set_exception(error)
            if self._reader is not asyncio.current_task():
                self._reader.cancel()
        await self._connection.disconnect(nowait=True)

    async def _read_replies(self) -> None:
        read_response, pending = self._connection.read_response, self._pending
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
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
