"""An ASGI wrapper that checks every successful chat and completion answer an app sends
against the openai SDK's types and OpenAI's required fields (`openai_response_schema`).

The request-path tests' ``gateway`` fixture wraps each gateway in one, so every answer any
of those tests gets, whole or streamed, is checked without the test asking; the fixture
fails the test at teardown if one did not pass (`SchemaCheckedApp.failures`). Only answers
with status 200 on ``/v1/chat/completions`` and ``/v1/completions`` are checked; errors have
their own shape (``tests/gateway/request_path/test_errors.py``).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.support.openai_response_schema import KIND_BY_PATH, check_answer, check_event_stream


class SchemaCheckedApp:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.failures: list[str] = []
        self.num_checked = 0

    def __getattr__(self, name: str) -> Any:  # the wrapped app's state, routes...
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kinds = KIND_BY_PATH.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kinds is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        status = 0
        is_stream = False
        parts: list[bytes] = []

        async def tapped(message: Message) -> None:
            nonlocal status, is_stream
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers") or [])
                is_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and status == 200:
                parts.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, tapped)
        if status == 200:
            self._check(b"".join(parts), kinds[1] if is_stream else kinds[0], is_stream)

    def _check(self, body: bytes, kind: Any, is_stream: bool) -> None:
        try:
            if is_stream:
                check_event_stream(body, kind)
            else:
                check_answer(orjson.loads(body), kind)
            self.num_checked += 1
        except Exception as exc:  # reported at the test's end, with the answer
            self.failures.append(f"{kind}: {type(exc).__name__}: {exc}"[:2000])
