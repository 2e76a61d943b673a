"""A ``tollway serve`` process told to stop (SIGTERM) drains: ``/ready`` turns 503 while it
keeps serving for ``drain_delay_s``, then it stops taking connections, lets streams in
flight finish within ``drain_grace_s``, ends those still running with an error event and
``[DONE]``, and exits 0. The engine is the stand-in (no torch). tests/faults/test_drain_timeout.py
has the rest: a non-streamed request's 503, the records against the ledger."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from gateway.defaults import default_database_url
from gateway.storage.database import Database
from gateway.storage.usage_store import list_usage
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import CONTEXT_WINDOW, TappedEngine, stand_in_engine

REPO_ROOT = Path(__file__).resolve().parents[3]
ITL_MS = 100.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(
    engine: TappedEngine,
    tmp_path: Path,
    *,
    drain_delay_s: float,
    drain_grace_s: float,
    settings: Mapping[str, object] = {},
) -> Iterator[tuple[subprocess.Popen[str], str, str, list[str]]]:
    """``tollway serve --config`` in front of ``engine``, with more ``settings`` if any:
    (process, base URL, API key, output)."""
    config = tmp_path / "tollway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data_dir": str(tmp_path / "data"),
                "drain_delay_s": drain_delay_s,
                "drain_grace_s": drain_grace_s,
                **settings,
                "models": {
                    MODEL: {"upstreams": [engine.upstream], "context_window": CONTEXT_WINDOW}
                },
            }
        )
    )
    port = _free_port()
    command = [sys.executable, "-m", "gateway.launcher.serve_cli", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )
    assert process.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")))
    reader.start()
    try:
        wait_until(
            lambda: process.poll() is not None or any('"content": "Hello!"' in x for x in lines),
            timeout_s=120,
            what="the banner",
        )
        assert process.poll() is None, "".join(lines)
        key = next(x.split("=", 1)[1].split()[0] for x in lines if "TOLLWAY_API_KEY=" in x)
        yield process, f"http://127.0.0.1:{port}", key, lines
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=5)


class Stream:
    """A streamed completion read on a thread: its words, and whether it ended with [DONE]."""

    def __init__(self, base: str, key: str, max_tokens: int) -> None:
        self.num_words = 0
        self.is_done = False
        self.is_shutting_down = False  # an error event said server_shutting_down
        self.status = 0
        self.first_word = threading.Event()
        self.ended = threading.Event()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
        headers = {"authorization": f"Bearer {key}"}
        self._thread = threading.Thread(target=self._read, args=(base, headers, body))
        self._thread.start()

    def _read(self, base: str, headers: dict[str, str], body: dict[str, object]) -> None:
        try:
            with httpx.stream(
                "POST", f"{base}/v1/completions", headers=headers, json=body, timeout=60
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    self.num_words += line.count("word")
                    if self.num_words:
                        self.first_word.set()
                    self.is_done = self.is_done or line == "data: [DONE]"
                    if '"code":"server_shutting_down"' in line:
                        self.is_shutting_down = True
        except httpx.TransportError:
            pass  # cut off
        finally:
            self.first_word.set()
            self.ended.set()

    def join(self) -> None:
        self._thread.join(timeout=60)


def usage_records(data_dir: Path) -> list[tuple[str, int]]:
    """Every usage record's (status, completion_tokens), oldest first."""
    database = Database(default_database_url(data_dir))
    try:
        with database.session() as session:
            records = list_usage(session).records
    finally:
        database.dispose()
    return [(r.status.value, r.completion_tokens) for r in records]


def _refuses_connections(base: str) -> bool:
    """No new connection is served: refused, or reset unanswered (one that reached the
    listening socket's backlog as it closed; seen on a loaded machine)."""
    try:
        httpx.get(f"{base}/health", timeout=5)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def test_sigterm_reports_not_ready_then_lets_streams_finish(tmp_path: Path) -> None:
    num_words = 100  # about 10 s of stream, from before SIGTERM to well past the delay
    with (
        stand_in_engine(num_chunks=num_words, itl_ms=ITL_MS) as engine,
        serving(engine, tmp_path, drain_delay_s=4, drain_grace_s=60) as (process, base, key, lines),
    ):
        assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
        stream = Stream(base, key, num_words)
        assert stream.first_word.wait(30)
        assert stream.status == 200
        process.send_signal(signal.SIGTERM)

        # Still serving during the delay, but not ready: load balancers stop sending.
        ready = httpx.get(f"{base}/ready")
        assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
        assert httpx.get(f"{base}/health").status_code == 200

        # Then no new connections, while the stream goes on.
        wait_until(lambda: _refuses_connections(base), timeout_s=30, what="the listener closes")
        assert not stream.ended.is_set(), "the stream ended before the listener closed"
        assert process.poll() is None

        stream.join()
        assert stream.is_done
        assert stream.num_words == num_words
        assert process.wait(timeout=30) == 0, "".join(lines)
    assert usage_records(tmp_path / "data") == [("completed", num_words)]


def test_streams_still_running_after_the_grace_period_end_with_an_error_event(
    tmp_path: Path,
) -> None:
    num_words = 300  # 30 s
    with (
        stand_in_engine(num_chunks=num_words, itl_ms=ITL_MS) as engine,
        serving(engine, tmp_path, drain_delay_s=0, drain_grace_s=1) as (process, base, key, lines),
    ):
        stream = Stream(base, key, num_words)
        assert stream.first_word.wait(30)
        assert stream.status == 200
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, "".join(lines)
        assert time.monotonic() - signalled < 8  # drain_grace_s, not a default of 10 s or more
        stream.join()
        assert stream.is_shutting_down  # the gateway's own end, not a cut connection
        assert stream.is_done
        assert stream.num_words < num_words
    # Billed for what was relayed, as for a client that leaves.
    assert usage_records(tmp_path / "data") == [("cancelled", stream.num_words)]
