"""Every response carries ``x-request-id``, errors and crashes included.

The id is the gateway's own (the usage record is keyed by it, so a client cannot choose it);
handlers read it from ``request.state.request_id``. An exception that escapes the app before
the response started becomes OpenAI's 500 error here, still with the header.
"""

from __future__ import annotations

import logging
import secrets

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_response, to_rejection

logger = logging.getLogger(__name__)

HEADER = "x-request-id"


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)  # 128 random bits, as uuid4().hex without the object


class IssuedIdServerErrorMiddleware:
    """Gives every request an id of the gateway's own (a client's ``x-request-id`` is not
    used), sets it on the response, and answers an exception that escapes before the
    response started with OpenAI's 500, the id included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        has_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal has_started
            if message["type"] == "http.response.start":
                has_started = True
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if has_started:
                raise
            logger.error("request %s failed: %s", request_id, type(exc).__name__, exc_info=exc)
            response = error_response(to_rejection(exc), {HEADER: request_id})
            await response(scope, receive, send)
