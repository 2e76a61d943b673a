"""ASGI middleware giving every HTTP request an id, echoed in the ``x-request-id`` header: the
client's own (the gateway sends its request id) when it is sane, else a new one."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_MAX_CHARS = 128


def _acceptable(value: str) -> bool:
    return 0 < len(value) <= _MAX_CHARS and value.isprintable() and value.isascii()


class ClientRequestIdMiddleware:
    """Keeps the client's ``x-request-id`` (when sane) or makes one; stores it in
    ``scope["state"]["request_id"]`` (``request.state.request_id``) and sets it on the
    response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER, "").strip()
        request_id = given if _acceptable(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
