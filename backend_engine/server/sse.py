"""A server-sent-events response that always runs its clean-up, however the stream ends."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(Response):
    """Sends ``events`` as they come and listens for the client leaving meanwhile.

    Unlike a bare ``StreamingResponse`` it does not rely on the server's ASGI spec
    version to notice a disconnect, and it closes ``events`` and awaits
    ``on_close`` (shielded from cancellation) on every exit path.
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
            async with anyio.create_task_group() as task_group:

                async def stream() -> None:
                    await send(
                        {
                            "type": "http.response.start",
                            "status": self.status_code,
                            "headers": self.raw_headers,
                        }
                    )
                    async for chunk in self.events:
                        body = chunk.encode("utf-8")
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    task_group.cancel_scope.cancel()

                task_group.start_soon(stream)
                while (await receive())["type"] != "http.disconnect":
                    pass
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
                await self.on_close()
