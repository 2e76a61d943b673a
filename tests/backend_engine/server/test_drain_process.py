"""SIGTERM to a real engine process (``python -m backend_engine`` on the tiny demo
checkpoint): it drains, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backend_engine.server.response_schema import check_answer
from tests.support.polling import wait_until
from tests.support.without_engine import needs_engine

pytestmark = needs_engine

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.fixture
def start_engine(
    demo_checkpoint: Callable[..., Path], tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    processes: list[subprocess.Popen[bytes]] = []

    def start(drain_grace_s: float, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
        port = _free_port()
        command = [
            sys.executable, "-m", "backend_engine",
            "--model", str(demo_checkpoint(size="tiny")),
            "--port", str(port),
            "--served-model-name", MODEL_NAME,
            "--drain-grace-s", str(drain_grace_s),
            "--no-show-progress",
            *flags,
        ]  # fmt: skip
        log = (tmp_path / f"engine-{port}.log").open("wb")
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        processes.append(process)
        base_url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: process.poll() is not None or _status(f"{base_url}/ready") == 200,
            timeout_s=120,
            what="the engine is ready",
        )
        assert process.poll() is None, (tmp_path / f"engine-{port}.log").read_text()
        return process, base_url

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class _Stream:
    def __init__(self, base_url: str, max_tokens: int) -> None:
        self.events: list[Any] = []
        self.has_token = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url, max_tokens))
        self._thread.start()

    def _read(self, base_url: str, max_tokens: int) -> None:
        with (
            httpx.Client(base_url=base_url, timeout=120) as client,
            client.stream("POST", "/v1/chat/completions", json=_chat(max_tokens, True)) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    if data != "[DONE]":
                        check_answer(self.events[-1], is_chunk=True)
                    if len(self.events) >= 3:
                        self.has_token.set()
        self.has_token.set()

    def join(self) -> list[Any]:
        self._thread.join(timeout=120)
        return self.events


def test_sigterm_drains_the_requests_in_flight_then_exits_0(start_engine: Any) -> None:
    # The stream must outlast SIGTERM, the wait for /ready and a refused request: step by step
    # (decode runs finished 800 of the tiny model's tokens inside that on a quiet machine),
    # with nearly all of its context to go.
    process, base_url = start_engine(30.0, "--decode-run-steps", "1")
    stream = _Stream(base_url, max_tokens=1900)
    assert stream.has_token.wait(60)
    process.send_signal(signal.SIGTERM)
    wait_until(lambda: _status(f"{base_url}/ready") == 503, 10, "draining")
    ready = httpx.get(f"{base_url}/ready", timeout=5)
    assert ready.json() == {"status": "draining"}
    refused = httpx.post(f"{base_url}/v1/chat/completions", json=_chat(4, False), timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_draining"
    assert process.poll() is None  # the stream is still running
    events = stream.join()
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"]
    assert process.wait(30) == 0


def test_sigterm_aborts_what_outlives_the_grace_and_exits_0(start_engine: Any) -> None:
    # No grace: the stream has 1,899 tokens to go when SIGTERM lands a moment after its
    # first, so it outlives the grace however fast the machine (with 0.5 s, a quiet machine
    # finished all 1,900 tokens inside it).
    process, base_url = start_engine(0.0)
    stream = _Stream(base_url, max_tokens=1900)
    assert stream.has_token.wait(60)
    process.send_signal(signal.SIGTERM)
    events = stream.join()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_draining"
    assert process.wait(30) == 0
