"""The floor for the gateway-overhead bench: the least a Python proxy on the gateway's stack
can do, served side by side with the gateway so "added" latency has a yardstick.

Per request it reads the body, parses the JSON to find the model, runs one Lua script in
Redis (an ``INCRBY`` on a counter, through the gateway's own ``LeanRedis`` client: the one
round trip a budget reserved before forwarding cannot avoid), forwards the body with
aiohttp over the model's unix socket, and relays the answer (chunk by chunk for streams).
No auth, no token counting, no policies, no usage record, no metrics, no Starlette:
whatever the gateway adds beyond this proxy is the price of those.

Served as the gateway is (uvicorn, one worker, uvloop + httptools): see
``bench.gateway_stack``.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from starlette.types import Message, Receive, Scope, Send

from gateway.storage.redis_client import LeanRedis

_COUNT = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
_JSON = [(b"content-type", b"application/json")]
_UPSTREAM_HEADERS = {"content-type": "application/json"}


class FloorProxy:
    """The ASGI app: ``upstreams`` maps a model to its engine's unix socket path."""

    def __init__(self, upstreams: dict[str, str], redis_url: str) -> None:
        self._upstreams = upstreams
        self._redis = LeanRedis(redis_url)
        self._count = self._redis.register_script(_COUNT)
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await _answer(send, 200, b"{}")
        else:
            await self._proxy(scope, receive, send)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        model = json.loads(body).get("model")
        session = self._sessions.get(model)
        if session is None:
            await _answer(send, 404, b'{"error": {"message": "unknown model"}}')
            return
        await self._count(keys=["floor:tokens"], args=[1])
        url = f"http://engine{scope['path']}"
        async with session.post(url, data=body, headers=_UPSTREAM_HEADERS) as upstream:
            content_type = upstream.headers.get("content-type", "application/json")
            headers = [(b"content-type", content_type.encode())]
            start = {"type": "http.response.start", "status": upstream.status, "headers": headers}
            if not content_type.startswith("text/event-stream"):
                answer = await upstream.read()
                headers.append((b"content-length", str(len(answer)).encode()))
                await send(start)
                await send({"type": "http.response.body", "body": answer})
                return
            await send(start)
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._sessions = {
                    model: aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(path=path, limit=0),
                        timeout=aiohttp.ClientTimeout(total=None),
                    )
                    for model, path in self._upstreams.items()
                }
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for session in self._sessions.values():
                    await session.close()
                await self._redis.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message: Message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(send: Send, status: int, body: bytes) -> None:
    start: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": _JSON}
    await send(start)
    await send({"type": "http.response.body", "body": body})
