"""What every handler of one app shares, built once in ``build_app``."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # In-flight generations by the caller's ``x-request-id`` -> the engine's request id,
    # so a caller can stop one (``POST /abort_request``) and still receive its answer.
    in_flight: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def of(request: Request) -> ServerContext:
        context: ServerContext = request.app.state.context
        return context
