"""uvicorn's server with a drain in front of its graceful shutdown, for ``tollway serve``.

What uvicorn does on SIGTERM or SIGINT by itself: it closes its listening sockets at once
(new connections are refused), closes idle keep-alive connections, lets every request in
flight (streams included) finish, for up to ``timeout_graceful_shutdown`` seconds (``None``:
for ever), then cancels what is left, runs the lifespan shutdown and exits. What it does not
do: say it is going before it goes. A load balancer or a Kubernetes Service still sends new
connections for a moment after SIGTERM (endpoints are removed asynchronously), and those
are refused.

`DrainingServer` adds that step. On SIGTERM the gateway's `Readiness` turns to draining
(``GET /ready`` answers 503, ``/health`` still 200) and the server keeps serving for
``drain_delay_s``; then uvicorn's own graceful shutdown runs, with ``drain_grace_s`` as its
timeout. A second SIGTERM, or SIGINT (Ctrl-C), skips what is left of the delay::

    SIGTERM ─► /ready 503, still serving ─drain_delay_s─► listener closed, requests in
               flight finish ─up to drain_grace_s─► the rest cancelled ─► lifespan shutdown
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from gateway.api.readiness import Readiness

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, readiness: Readiness, *, drain_delay_s: float
    ) -> None:
        super().__init__(config)
        self._readiness = readiness
        self._drain_delay_s = drain_delay_s
        self._stop_at: float | None = None  # when the delay after SIGTERM ends

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._readiness.drain()
        is_first = self._stop_at is None and not self.should_exit
        if sig == signal.SIGTERM and is_first and self._drain_delay_s > 0:
            self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
            self._stop_at = time.monotonic() + self._drain_delay_s
            logger.warning(
                "draining: /ready answers 503; serving %.1f s more before stopping",
                self._drain_delay_s,
            )
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._stop_at is not None and time.monotonic() >= self._stop_at:
            self.should_exit = True
        return await super().on_tick(counter)
