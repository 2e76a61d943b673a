"""What every handler of one app shares, built once in ``build_app``."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from backend_engine.server.engine_host import EngineHost
from backend_engine.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerContext:
    host: EngineHost  # the engine (once loaded) and whether it takes requests
    metrics: ServerMetrics
    max_body_bytes: int
    created: int  # unix time the app was built, reported as the model's ``created``
    # In-flight generations by the caller's ``x-request-id`` -> the engine's request ids (one
    # per prompt), so a caller can stop one (``POST /abort_request``) and still receive its
    # answer.
    in_flight: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @staticmethod
    def of(request: Request) -> ServerContext:
        context: ServerContext = request.app.state.context
        return context
