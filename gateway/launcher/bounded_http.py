"""uvicorn's httptools protocol with the bounds it lacks: header and body read timeouts and a
cap on connections, so slow or idle sockets cannot hold a gateway's file descriptors.

uvicorn closes a keep-alive connection idle between requests (``timeout_keep_alive``) but
sets no deadline on reading a request: a client that sends a request line and then one
header byte every few seconds (slowloris), or a body that never ends, holds its socket for
ever. `BoundedHttpProtocol` adds two timers per connection::

    connect, or a later request's first byte ─header_timeout_s─► headers complete
        not in time: 408 (if a request had begun), then closed
    headers complete ─body_timeout_s─► body complete
        not in time: 408 before the app answered, else closed

Both are totals, not idle times, so trickling a byte now and then does not extend them. For
the body that costs honest clients nothing: ``max_body_bytes`` caps a body at 1 MiB by
default, which any link worth serving sends well within 30 s. A timer that fires while the
server itself has paused reading (the app not yet reading a large body, pipelined requests
queued) starts again instead: only the client's slowness counts.

The cap: with ``max_connections`` connections open (idle keep-alive ones included), or as
many requests in flight, a further request is answered 503 ``service_unavailable`` with
``Retry-After`` in OpenAI's shape and its connection closed (uvicorn's own
``limit_concurrency`` answers plain text, and refuses one request early). A connection over
the cap is accepted first, so descriptors are bounded by ``max_connections`` plus those
accepted within one ``header_timeout_s``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

import orjson
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from openai_protocol import errors as vocabulary
from policies.decision import Rejection

REQUEST_TIMEOUT = vocabulary.ErrorKind("request_timeout", 408, vocabulary.type_for(408))
RETRY_AFTER_S = 1  # a request refused over the cap: another connection frees up soon


@dataclass(frozen=True)
class ConnectionLimits:
    """The settings' ``header_timeout_s``, ``body_timeout_s`` and ``max_connections``
    (validated there)."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def raw_error_response(rejection: Rejection) -> bytes:
    """A whole HTTP/1.1 error response, written straight to a socket that has no ASGI
    request (or whose app is still waiting for its body), closing the connection."""
    body = orjson.dumps(rejection.error_body())
    reasons = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}
    reason = reasons.get(rejection.status, b"")
    head = [
        b"HTTP/1.1 %d %s" % (rejection.status, reason),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
        *(f"{name}: {value}".encode("latin-1") for name, value in rejection.headers.items()),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _timed_out(what: str, limit_s: float, setting: str) -> Rejection:
    return Rejection.of(
        REQUEST_TIMEOUT,
        f"The request's {what} did not arrive within {limit_s:g} s ({setting}); "
        "send the whole request at once.",
    )


def _unparseable(detail: str) -> Rejection:
    return Rejection.of(
        vocabulary.INVALID_REQUEST,
        "The request could not be read as HTTP/1.1 (a malformed or oversized request line or "
        f"header): {detail}",
    )


def _over_capacity(max_connections: int) -> Rejection:
    return Rejection.of(
        vocabulary.SERVICE_UNAVAILABLE,
        f"This gateway process is at its limit of {max_connections} connections "
        "(max_connections); retry shortly.",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )


class BoundedHttpProtocol(HttpToolsProtocol):
    """One connection; `protocol_with` makes the subclass that carries the limits."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.limit_concurrency = None  # uvicorn's check is off: ours answers in OpenAI's shape
        self._gateway_app = self.app
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._has_request_begun = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._has_request_begun = True
        if self._header_timer is None:  # a later request on a keep-alive connection
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_timers()
        self._has_request_begun = False
        is_over = (
            len(self.connections) > self.limits.max_connections
            or len(self.tasks) >= self.limits.max_connections
        )
        self.app = _OverCapacityApp(self.limits.max_connections) if is_over else self._gateway_app
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._on_body_timeout)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._on_header_timeout
        )

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser refuses (an oversized request line, a malformed header)
        gets OpenAI's error shape, not uvicorn's plain text."""
        self._cancel_timers()
        self.transport.write(raw_error_response(_unparseable(msg)))
        self.transport.close()

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # our slowness, not the client's
            self._arm_header_timer()
            return
        if self._has_request_begun:
            limit_s = self.limits.header_timeout_s
            rejection = _timed_out("headers", limit_s, "header_timeout_s")
            self.transport.write(raw_error_response(rejection))
        self.transport.close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        if self.flow.read_paused:
            self._body_timer = self.loop.call_later(
                self.limits.body_timeout_s, self._on_body_timeout
            )
            return
        if not cycle.response_started:
            limit_s = self.limits.body_timeout_s
            rejection = _timed_out("body", limit_s, "body_timeout_s")
            self.transport.write(raw_error_response(rejection))
        # The app waiting for the body hears a disconnect; its answer, if any, goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()


class _OverCapacityApp:
    """The ASGI app a request over the cap gets instead of the gateway."""

    def __init__(self, max_connections: int) -> None:
        self._rejection = _over_capacity(max_connections)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = orjson.dumps(self._rejection.error_body())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
            *(
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in self._rejection.headers.items()
            ),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def protocol_with(limits: ConnectionLimits) -> type[BoundedHttpProtocol]:
    """The protocol class to pass uvicorn as ``http=``: it builds one per connection."""
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,), {"limits": limits})
