"""``tollway serve`` applies its connection settings: a half-sent request is cut at
``header_timeout_s``, a stalled body at ``body_timeout_s`` (both OpenAI's 408), and beyond
``max_connections`` a request gets OpenAI's 503, while the gateway keeps serving the others.
A real ``tollway serve`` process in front of the stand-in engine."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.gateway.launcher.test_draining_server import ITL_MS, Stream, serving
from tests.support.polling import wait_until
from tests.support.stand_in_stack import stand_in_engine

SLACK_S = 3.0  # a busy machine's delay on top of a timeout


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_serve_bounds_slow_requests_and_connections(tmp_path: Path) -> None:
    num_words = 60  # 6 s of stream, to hold connections
    limits = {"header_timeout_s": 1, "body_timeout_s": 1, "max_connections": 3}
    with (
        stand_in_engine(num_chunks=num_words, itl_ms=ITL_MS) as engine,
        serving(engine, tmp_path, drain_delay_s=0, drain_grace_s=5, settings=limits) as (
            _,
            base,
            key,
            _,
        ),
    ):
        address = urlsplit(base)
        assert address.hostname is not None
        assert address.port is not None
        with socket.create_connection((address.hostname, address.port)) as headers_late:
            headers_late.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nauthoriz")
            started = time.monotonic()
            assert httpx.get(f"{base}/health").status_code == 200  # served meanwhile
            status, error = _error(_read_until_closed(headers_late))
            assert time.monotonic() - started < 1 + SLACK_S
            assert (status, error["code"]) == (408, "request_timeout")

        with socket.create_connection((address.hostname, address.port)) as body_late:
            body_late.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer "
                + key.encode()
                + b'\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"mo'
            )
            started = time.monotonic()
            status, error = _error(_read_until_closed(body_late))
            assert time.monotonic() - started < 1 + SLACK_S
            assert (status, error["code"]) == (408, "request_timeout")

        streams = [Stream(base, key, num_words) for _ in range(3)]
        for stream in streams:
            assert stream.first_word.wait(30)
            assert stream.status == 200
        refused = httpx.get(f"{base}/health")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert refused.headers["retry-after"] == "1"
        for stream in streams:
            stream.join()
            assert stream.is_done
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, what="under the cap")
