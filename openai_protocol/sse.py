"""A server-sent-events response that always runs its clean-up, however the stream ends."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from openai_protocol.disconnect import run_to_end, until_client_leaves

DONE = "data: [DONE]\n\n"


def event(payload: Mapping[str, Any]) -> str:
    """One SSE event of compact JSON (orjson, several times the standard library's speed:
    the engine sends one per token; the standard library for what orjson refuses)."""
    try:
        text = orjson.dumps(payload).decode()
    except TypeError:  # e.g. an integer past 64 bits
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStreamResponse(Response):
    """Sends ``events`` as they come and listens for the client leaving meanwhile.

    Unlike a bare ``StreamingResponse`` it does not rely on the server's ASGI spec
    version to notice a disconnect, and it closes ``events`` and awaits ``on_close`` on
    every exit path: the stream's end, the client leaving (which stops the stream where it
    is, not an error), an error, and the task being cancelled (the clean-up then runs to
    its end before the cancellation goes on).

    The events are sent from the request's own task (see :mod:`.disconnect`).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_client_leaves(receive, self._send_events(send))
        except BaseException:
            await run_to_end(self._close())
            raise
        await self._close()

    async def _send_events(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        await self.on_close()
