"""What every handler of one app shares, built once in ``build_app``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from backend_engine.async_engine import AsyncEngine
from backend_engine.server.metrics import ServerMetrics
from backend_engine.server.token_text import TokenText


@dataclass(frozen=True)
class ServerContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    token_text: TokenText
    max_body_bytes: int
    created: int  # unix time the app was built, reported as the model's ``created``

    @staticmethod
    def of(request: Request) -> ServerContext:
        context: ServerContext = request.app.state.context
        return context
