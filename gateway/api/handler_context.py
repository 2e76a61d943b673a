"""Everything a request handler needs, built once at start-up and reached via the app state."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.trace import Tracer
from starlette.requests import Request

from gateway.accounting.settlement import Accountant
from gateway.admission.admitter import Admitter
from gateway.auth.key_cache import KeyCache
from gateway.observability.metrics import GatewayMetrics
from gateway.rollouts import LiveRollouts
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.upstream.drain_deadline import DrainDeadline
from gateway.upstream.pool import UpstreamPool


@dataclass(frozen=True)
class GatewayContext:
    settings: GatewaySettings
    database: Database
    upstreams: UpstreamPool
    keys: KeyCache
    admitter: Admitter
    accountant: Accountant
    metrics: GatewayMetrics
    tracer: Tracer
    rollouts: LiveRollouts
    # Reached by `tollway serve`'s server at the end of its drain (launcher.draining_server).
    drain_deadline: DrainDeadline = field(default_factory=DrainDeadline)

    @staticmethod
    def of(request: Request) -> GatewayContext:
        context: GatewayContext = request.app.state.gateway
        return context
