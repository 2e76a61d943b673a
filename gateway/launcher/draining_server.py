"""uvicorn's server with a drain in front of its graceful shutdown and a deadline at its
end, for ``tollway serve``.

What uvicorn does on SIGTERM or SIGINT by itself: it closes its listening sockets at once
(new connections are refused), closes idle keep-alive connections, lets every request in
flight (streams included) finish, for up to ``timeout_graceful_shutdown`` seconds (``None``:
for ever), then cancels what is left, runs the lifespan shutdown and exits. What it does not
do: say it is going before it goes. A load balancer or a Kubernetes Service still sends new
connections for a moment after SIGTERM (endpoints are removed asynchronously), and those
are refused.

And what it does at its timeout is cancel each request's task: a request still waiting on
its engine gets a plain-text 500 (not OpenAI's error, no request id) and a record of no
tokens, however many its engine generated.

`DrainingServer` adds a step before and one at the end. On SIGTERM the gateway's
`Readiness` turns to draining (``GET /ready`` answers 503, ``/health`` still 200) and the
server keeps serving for ``drain_delay_s``; then uvicorn's own graceful shutdown runs. At
``drain_grace_s`` after it began, the server reaches the handlers' `DrainDeadline`
(`gateway.upstream.drain_deadline`): the requests still waiting on an engine end themselves
(a 503 ``server_shutting_down``, or a stream's error event and ``[DONE]``), recorded and
settled with what their engines produced. uvicorn's timeout (`uvicorn_timeout_s`) is
``BACKSTOP_S`` later, for what could not end in time. A second SIGTERM, or SIGINT (Ctrl-C),
skips what is left of the delay::

    SIGTERM ─► /ready 503, still serving ─drain_delay_s─► listener closed, requests in
      flight finish ─up to drain_grace_s─► the drain's deadline: the rest end with a 503
      or an error event, billed ─up to BACKSTOP_S─► what is left cancelled ─► lifespan
      shutdown
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from gateway.api.readiness import Readiness
from gateway.upstream.drain_deadline import DrainDeadline

logger = logging.getLogger(__name__)

# From the drain's deadline to uvicorn's own timeout: time for a request cut off to stop its
# engine request (`gateway.api.completions.CUT_OFF_STOP_WAIT_S`), record, settle and answer.
BACKSTOP_S = 3.0


def uvicorn_timeout_s(drain_grace_s: float) -> float:
    """uvicorn's ``timeout_graceful_shutdown`` for a server whose deadline is at
    ``drain_grace_s``."""
    return drain_grace_s + BACKSTOP_S


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        readiness: Readiness,
        deadline: DrainDeadline,
        *,
        drain_delay_s: float,
        drain_grace_s: float,
    ) -> None:
        timeout = config.timeout_graceful_shutdown
        if timeout is None or timeout < uvicorn_timeout_s(drain_grace_s):
            raise ValueError(
                f"uvicorn's timeout_graceful_shutdown ({timeout}) must be at least "
                f"uvicorn_timeout_s(drain_grace_s) = {uvicorn_timeout_s(drain_grace_s)}"
            )
        super().__init__(config)
        self._readiness = readiness
        self._deadline = deadline
        self._drain_delay_s = drain_delay_s
        self._drain_grace_s = drain_grace_s
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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, with the drain's deadline at ``drain_grace_s``."""
        timer = asyncio.get_running_loop().call_later(self._drain_grace_s, self._cut_off)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut_off(self) -> None:
        logger.warning(
            "draining: %.1f s passed; ending the requests still in flight", self._drain_grace_s
        )
        self._deadline.reach()
