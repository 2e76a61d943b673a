"""A webhook receiver for alert tests: a real HTTP server on 127.0.0.1 (uvicorn on a thread)
that records every delivery and answers as the test scripts it.

    with webhook_receiver() as receiver:
        receiver.statuses = [500]        # the first delivery is refused, later ones taken
        receiver.delays_s = [2.0]        # ... or the first answer comes too late
        ... settings: alerts.webhook_url = receiver.url
        wait_until(lambda: len(receiver.deliveries) == 2, ...)
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support.uvicorn_thread import start_in_thread, stop_thread


@dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int  # what the receiver answered


class WebhookReceiver:
    def __init__(self) -> None:
        self.url = ""
        self.deliveries: list[Delivery] = []
        self.statuses: list[int] = []  # answers for the next deliveries, in order; then 200
        self.delays_s: list[float] = []  # waits before those answers; then none
        self.is_refusing = False  # every delivery gets a 500 while set
        self._lock = threading.Lock()

    async def receive(self, request: Request) -> Response:
        body = await request.body()
        with self._lock:
            status = self.statuses.pop(0) if self.statuses else 200
            if self.is_refusing:
                status = 500
            delay_s = self.delays_s.pop(0) if self.delays_s else 0.0
            self.deliveries.append(Delivery(dict(request.headers), body, status))
        if delay_s:
            await asyncio.sleep(delay_s)
        return Response(status_code=status)

    def event_ids(self) -> list[str]:
        return [delivery.headers["webhook-id"] for delivery in self.deliveries]


@contextmanager
def webhook_receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    app = Starlette(routes=[Route("/hook", receiver.receive, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    receiver.url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = start_in_thread(server, [sock])
    try:
        yield receiver
    finally:
        stop_thread(server, thread)
