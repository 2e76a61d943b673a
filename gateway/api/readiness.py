"""``GET /ready``: whether this gateway takes new requests (``/health`` is liveness only).

A gateway is ready from the end of its start-up until it is told to stop: on SIGTERM
(`gateway.launcher.draining_server`) it drains, and ``/ready`` answers 503 from then on,
so a load balancer or a Kubernetes readiness probe sends it nothing new while the requests
in flight finish. ``/health`` keeps answering 200 until the process exits.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


class Readiness:
    def __init__(self) -> None:
        self.is_draining = False

    def drain(self) -> None:
        self.is_draining = True


def readiness_route(readiness: Readiness) -> Route:
    async def ready(request: Request) -> Response:
        if readiness.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    return Route("/ready", ready, methods=["GET"])
