"""A lean Redis client for the request path: commands pipelined on one connection.

redis-py spends about 100 µs of CPU on every command (pool checkout, retry and timeout
wrappers, observability hooks), more than the gateway's own work on a request. The request
path needs little of it: two Lua scripts per request (admit, settle) and a few plain
commands. This client writes each command at once on one shared connection and hands the
replies back in order (Redis answers a connection's commands in the order it received
them), so a call costs one write and one parse::

    caller ─► pending futures (FIFO) ─► RESP2 parser ◄─ socket ◄─ redis-server
       └──── encoded command ─────────► socket ─────────────────► redis-server

A lost connection fails every pending call with redis-py's ``ConnectionError`` and the next
call connects again; nothing is retried (a script that may have run must not run twice).
A caller cancelled while waiting leaves its future behind; its reply is read and dropped.
Scripts run by SHA; after ``NOSCRIPT`` (a restarted or flushed server) the script is loaded
and run once more. It speaks the subset of redis-py's client API the ledger, the admission
store and the auth epochs use (``RedisCommands``), so either client serves them.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast

from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

Arg = bytes | str | int | float
ScriptCall = Callable[..., Awaitable[Any]]  # (keys, args) -> reply


class RedisCommands(Protocol):
    """What the Redis-backed stores need of a client: redis-py's ``Redis`` or ``RedisPipeline``."""

    def register_script(self, script: str) -> Any: ...

    async def execute_command(self, *args: Any) -> Any: ...


class RedisPipeline:
    """``redis://``, ``rediss://`` or ``unix://`` URLs, as redis-py takes them."""

    def __init__(self, url: str) -> None:
        self._params = parse_url(url)
        self._connection: _Connection | None = None
        self._connecting: asyncio.Lock | None = None

    def register_script(self, script: str) -> Script:
        return Script(self, script)

    async def execute_command(self, *args: Arg) -> Any:
        connection = self._connection
        if connection is None or connection.is_closed:
            connection = await self._connect()
        return await connection.call(encode_command(args))

    async def aclose(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def _connect(self) -> _Connection:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connect, however many callers wait for it
            connection = self._connection
            if connection is not None and not connection.is_closed:
                return connection
            loop = asyncio.get_running_loop()
            params = self._params
            try:
                if "path" in params:
                    _, protocol = await loop.create_unix_connection(_Connection, params["path"])
                else:
                    host, port = params.get("host", "localhost"), params.get("port", 6379)
                    tls = ssl.create_default_context() if _is_tls(params) else None
                    _, protocol = await loop.create_connection(_Connection, host, port, ssl=tls)
            except OSError as exc:
                raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
            if params.get("password") is not None:
                credentials = [params.get("username") or "default", params["password"]]
                await protocol.call(encode_command(["AUTH", *credentials]))
            if params.get("db"):
                await protocol.call(encode_command(["SELECT", params["db"]]))
            self._connection = protocol
            return protocol


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``), loaded again if the server lost it."""

    def __init__(self, client: RedisPipeline, text: str) -> None:
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


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._pending: deque[asyncio.Future[Any]] = deque()
        self._buffer = bytearray()
        self.is_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    async def call(self, command: bytes) -> Any:
        if self.is_closed or self._transport is None:
            raise RedisConnectionError("the connection to Redis is closed")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        self._transport.write(command)
        return await future

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        position = 0
        while True:
            try:
                parsed = parse_reply(buffer, position)
            except ValueError as exc:  # not RESP: nothing after this can be trusted
                self._fail(RedisConnectionError(f"unreadable reply from Redis: {exc}"))
                return
            if parsed is None:
                break
            reply, position = parsed
            if not self._pending:
                self._fail(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            future = self._pending.popleft()
            if future.cancelled():
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
        del buffer[:position]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the connection to Redis was lost: {exc or 'closed'}"))

    def close(self) -> None:
        self._fail(RedisConnectionError("the Redis client was closed"))

    def _fail(self, error: Exception) -> None:
        self.is_closed = True
        if self._transport is not None:
            self._transport.close()
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)


def encode_command(args: Sequence[Arg]) -> bytes:
    """A command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is str:  # the common cases first, without the isinstance chain
            data = arg.encode()
        elif type(arg) is int:
            data = b"%d" % arg
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int) and not isinstance(arg, bool):
            data = b"%d" % arg
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis")
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


def parse_reply(buffer: bytes | bytearray, position: int) -> tuple[Any, int] | None:
    """One RESP2 reply starting at ``position``: ``(reply, next position)``, or ``None`` if
    the buffer holds only part of it. Errors are returned as ``ResponseError`` values."""
    end = buffer.find(b"\r\n", position)
    if end < 0:
        return None
    kind, line, position = buffer[position], bytes(buffer[position + 1 : end]), end + 2
    if kind == 0x3A:  # ":" integer
        return int(line), position
    if kind == 0x24:  # "$" bulk string
        size = int(line)
        if size < 0:
            return None, position
        if len(buffer) < position + size + 2:
            return None
        return bytes(buffer[position : position + size]), position + size + 2
    if kind == 0x2A:  # "*" array
        count = int(line)
        if count < 0:
            return None, position
        items = []
        for _ in range(count):
            parsed = parse_reply(buffer, position)
            if parsed is None:
                return None
            item, position = parsed
            items.append(item)
        return items, position
    if kind == 0x2B:  # "+" simple string
        return line, position
    if kind == 0x2D:  # "-" error
        message = line.decode(errors="replace")
        error = NoScriptError if message.startswith("NOSCRIPT") else ResponseError
        return error(message), position
    raise ValueError(f"unknown reply type {chr(kind)!r}")


def _is_tls(params: Mapping[str, Any]) -> bool:
    connection_class = params.get("connection_class")
    return isinstance(connection_class, type) and issubclass(connection_class, SSLConnection)
