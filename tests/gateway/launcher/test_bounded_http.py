"""The gateway's HTTP protocol bounds slow and idle connections: half-sent headers and stalled
or trickled bodies are cut at their timeouts while other clients are served, and requests
beyond the connection cap get OpenAI's 503. A real uvicorn server on a free port, in a thread,
in front of a small ASGI app."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.launcher.bounded_http import ConnectionLimits, protocol_with
from tests.support.polling import wait_until

SHORT = ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=100)
SLACK_S = 1.5  # a busy machine's scheduling delay on top of a timeout


class SmallApp:
    """``/ok`` answers at once, ``/hold`` once ``release`` is set, ``POST /echo`` the body's
    length once it has all arrived."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_holding = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            self.num_holding += 1
            await asyncio.to_thread(self.release.wait, 60)
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            num_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = json.dumps({"num_bytes": num_bytes}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Served:
    base: str
    port: int
    app: SmallApp


@contextmanager
def serving(limits: ConnectionLimits) -> Iterator[Served]:
    app = SmallApp()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, http=protocol_with(limits), lifespan="off", log_level="error"
    )
    sock = config.bind_socket()
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        wait_until(lambda: server.started, what="the server starts")
        yield Served(f"http://127.0.0.1:{port}", port, app)
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes: (bytes, when it closed, monotonic)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not select.select([sock], [], [], 0.05)[0]:
            continue
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data, time.monotonic()
        data += chunk
    raise AssertionError(f"the server kept the connection open for {timeout_s} s: {data!r}")


def _error(answer: bytes) -> tuple[int, dict[str, object], dict[str, str]]:
    """An HTTP answer's status, ``error`` object and headers."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), json.loads(body)["error"], headers


def test_half_sent_requests_are_closed_within_the_header_timeout_while_others_are_served() -> None:
    with serving(SHORT) as served, httpx.Client(base_url=served.base) as kept_alive:
        slow = [_connect(served.port) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /ok HTTP/1.1\r\nhost: test\r\nx-slow: ")
        started = time.monotonic()
        closed_at: dict[int, float] = {}
        num_served = 0
        while len(closed_at) < len(slow) and time.monotonic() - started < 10:
            for i, sock in enumerate(slow):  # one more header byte on each, every 0.2 s
                if i in closed_at:
                    continue
                if select.select([sock], [], [], 0)[0]:  # the 408, or the close
                    closed_at[i] = _read_until_closed(sock, 5)[1]
                    continue
                try:
                    sock.send(b"a")
                except OSError:
                    closed_at[i] = time.monotonic()
            # Meanwhile a kept-alive client is served, its connection outliving the timeout.
            assert kept_alive.get("/ok").status_code == 200
            num_served += 1
            time.sleep(0.2)
        for sock in slow:
            sock.close()
    assert len(closed_at) == len(slow), "half-sent requests were left open"
    assert max(closed_at.values()) - started < SHORT.header_timeout_s + SLACK_S
    assert num_served >= 3


def test_half_sent_headers_get_a_408_in_openai_shape() -> None:
    with serving(SHORT) as served, _connect(served.port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: test\r\ncontent-le")
        started = time.monotonic()
        answer, closed_at = _read_until_closed(sock, 10)
    assert closed_at - started < SHORT.header_timeout_s + SLACK_S
    status, error, headers = _error(answer)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"
    assert "header_timeout_s" in str(error["message"])
    assert headers["connection"] == "close"


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout() -> None:
    with serving(SHORT) as served, _connect(served.port) as sock:
        started = time.monotonic()
        answer, closed_at = _read_until_closed(sock, 10)
    assert answer == b""  # no request began: nothing to answer
    assert closed_at - started < SHORT.header_timeout_s + SLACK_S


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickled"])
def test_a_body_late_past_the_body_timeout_gets_a_408(trickle: bool) -> None:
    limits = ConnectionLimits(header_timeout_s=5.0, body_timeout_s=1.0, max_connections=100)
    with serving(limits) as served, _connect(served.port) as sock:
        in_time = httpx.post(f"{served.base}/echo", content=b"x" * 300_000)
        assert (in_time.status_code, in_time.json()) == (200, {"num_bytes": 300_000})
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n0123456789")
        started = time.monotonic()
        answer = b""
        while trickle and not select.select([sock], [], [], 0.2)[0]:
            sock.send(b"x")  # a byte every 0.2 s: the timeout is a total, not an idle time
            assert time.monotonic() - started < 10, "the trickled body was never cut"
        answer, closed_at = _read_until_closed(sock, 10)
    assert closed_at - started < limits.body_timeout_s + SLACK_S
    status, error, _ = _error(answer)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert "body_timeout_s" in str(error["message"])


def test_requests_beyond_the_connection_cap_get_a_503_in_openai_shape() -> None:
    limits = ConnectionLimits(header_timeout_s=5.0, body_timeout_s=5.0, max_connections=2)
    with serving(limits) as served:
        held = [
            threading.Thread(
                target=httpx.get, args=(f"{served.base}/hold",), kwargs={"timeout": 30}
            )
            for _ in range(limits.max_connections)
        ]
        for thread in held:
            thread.start()
        wait_until(lambda: served.app.num_holding == limits.max_connections, what="held")
        refused = httpx.get(f"{served.base}/ok")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert "max_connections" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"

        served.app.release.set()
        for thread in held:
            thread.join(timeout=30)
        wait_until(lambda: _status(served.base) == 200, what="served again under the cap")


def _status(base: str) -> int:
    return httpx.get(f"{base}/ok", timeout=10).status_code


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nhost: test\r\n\r\n",  # an oversized path
        b"GET /ok HTTP/1.1\r\nhost test\r\n\r\n",  # a header without its colon
    ],
)
def test_a_request_the_parser_refuses_gets_a_400_in_openai_shape(request_head: bytes) -> None:
    with serving(SHORT) as served, _connect(served.port) as sock:
        sock.sendall(request_head)
        answer, _ = _read_until_closed(sock, 10)
    status, error, headers = _error(answer)
    assert status == 400
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert "HTTP/1.1" in str(error["message"])
    assert headers["content-type"] == "application/json"
