"""A uvicorn server on a daemon thread of the test process, for fixtures that serve an ASGI app
(an engine, a gateway, a stand-in) to real HTTP clients."""

from __future__ import annotations

import socket
import threading

import uvicorn

from tests.support.polling import wait_until

START_TIMEOUT_S = 120.0


def start_in_thread(
    server: uvicorn.Server, sockets: list[socket.socket] | None = None
) -> threading.Thread:
    """Run ``server`` (on ``sockets``, else as its config says) until it is serving."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()

    def has_started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        return bool(server.started)

    wait_until(has_started, START_TIMEOUT_S, "uvicorn started")
    return thread


def stop_thread(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=30)
