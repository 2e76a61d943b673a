"""``GET /ready``: whether this gateway takes new requests (``/health`` is liveness only).

A gateway is ready from the end of its start-up until it is told to stop: on SIGTERM
(`gateway.launcher.draining_server`) it drains, and ``/ready`` answers 503 from then on,
so a load balancer or a Kubernetes readiness probe sends it nothing new while the requests
in flight finish. ``/health`` keeps answering 200 until the process exits.

It is also not ready while its usage spill file refuses records (a full disk, a read-only
data directory, the file at its size limit): each request then needs the database to take
its record at once, or is answered 503 (`gateway.storage.usage_writer`), so traffic is better
sent elsewhere. Each ``/ready`` call while that lasts probes the file again (at most once
a second), so the gateway turns ready by itself once the disk has room.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.storage.usage_writer import UsageWriter


class Readiness:
    def __init__(self, usage_writer: UsageWriter | None = None) -> None:
        self.is_draining = False
        self._usage_writer = usage_writer

    def drain(self) -> None:
        self.is_draining = True

    def status(self) -> str:
        """``ready``, or why not: ``draining``, ``usage_records_unwritable``."""
        if self.is_draining:
            return "draining"
        if self._usage_writer is not None and not self._usage_writer.spill_is_writable():
            return "usage_records_unwritable"
        return "ready"


def readiness_route(readiness: Readiness) -> Route:
    async def ready(request: Request) -> Response:
        status = readiness.status()
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    return Route("/ready", ready, methods=["GET"])
