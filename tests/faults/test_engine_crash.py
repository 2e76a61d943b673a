"""An engine SIGKILLed under ``tollway serve``: what clients see, what is billed, what recovers.

One real ``tollway serve`` (gateway + one engine child on a Unix socket) for the module.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.storage.models import UsageStatus
from tests.faults.processes import (
    Tollway,
    chat_body,
    read_stream,
    shared_tollway,
)
from tests.support.child_process import is_gone
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(180)

NUM_TOKENS_BEFORE_KILL = 5
LONG = 1000  # tokens asked for (the default tenant allows 1024): far more than come before the kill


@pytest.fixture
def tollway(request: pytest.FixtureRequest, demo_checkpoint: Callable[..., Path]) -> Tollway:
    return shared_tollway(request.config, demo_checkpoint(size="tiny"))


def _wait_for_a_new_engine(tollway: Tollway, old_pid: int) -> int:
    wait_until(lambda: is_gone(old_pid), 10, "the killed engine to exit")

    def is_replaced() -> bool:
        try:
            return tollway.engine_pid() != old_pid and tollway.is_engine_healthy()
        except AssertionError:  # between the old child's exit and the new one's start
            return False

    wait_until(is_replaced, 90, f"the watchdog to restart the engine\n{tollway.output()[-3000:]}")
    return tollway.engine_pid()


def _budget(tollway: Tollway) -> dict[str, int]:
    with tollway.client() as client:
        response = client.get("/v1/budget")
    assert response.status_code == 200, response.text
    return dict(response.json())


def _settled_tokens(tollway: Tollway) -> int:
    return sum(r.prompt_tokens + r.completion_tokens for r in tollway.records().values())


def _burst(tollway: Tollway, num_requests: int, *, stream: bool) -> list[httpx.Response]:
    """``num_requests`` short requests at once, each on its own connection to the gateway."""

    def one(_: int) -> httpx.Response:
        with tollway.client() as client:
            response = client.post("/v1/chat/completions", json=chat_body(4, stream=stream))
            response.read()
            return response

    with ThreadPoolExecutor(num_requests) as pool:
        return list(pool.map(one, range(num_requests)))


def test_an_engine_killed_mid_stream(tollway: Tollway) -> None:
    """One crash, before, during and after (each engine restart costs seconds): the stream
    ends with an error event and is billed what it relayed; requests meanwhile get a clean
    503; the watchdog restarts the engine and the gateway reuses no dead pooled connection."""
    # Several pooled connections from the gateway to the engine, kept alive.
    assert {r.status_code for r in _burst(tollway, 6, stream=False)} == {200}
    engine_pid = tollway.engine_pid()
    killed = threading.Event()

    def kill_after_a_few_tokens(seen: object) -> None:
        if not killed.is_set() and getattr(seen, "num_tokens", 0) >= NUM_TOKENS_BEFORE_KILL:
            os.kill(engine_pid, signal.SIGKILL)
            killed.set()

    def non_streamed() -> httpx.Response:
        with tollway.client() as client:
            return client.post("/v1/chat/completions", json=chat_body(LONG, stream=False))

    with ThreadPoolExecutor(1) as pool, tollway.client() as client:
        waiting = pool.submit(non_streamed)  # in flight too when the engine dies
        body = chat_body(LONG, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = read_stream(response, kill_after_a_few_tokens)
        whole = waiting.result(timeout=60)
    assert killed.is_set(), "the stream ended before the engine could be killed"
    wait_until(lambda: is_gone(engine_pid), 10, "the killed engine to exit")

    # While it is down (the watchdog waits 1 s, then the engine takes seconds to start):
    # a prompt, clean 503 in OpenAI's format, streamed or not.
    for response in [*_burst(tollway, 2, stream=False), *_burst(tollway, 2, stream=True)]:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "upstream_unavailable"

    # The stream: what came before the crash, one OpenAI-format error event, then [DONE].
    assert seen.status_code == 200
    assert NUM_TOKENS_BEFORE_KILL <= seen.num_tokens < LONG
    assert len(seen.errors) == 1, seen.errors
    assert seen.errors[0]["type"] == "server_error"
    assert seen.errors[0]["code"] == "upstream_error"
    assert seen.is_done
    assert seen.events_after_done == 0
    assert seen.usage is None  # the engine's usage never came
    # The non-streamed request: a clean error in OpenAI's format, never a 500.
    assert whole.status_code == 503, whole.text
    assert whole.json()["error"]["type"] == "server_error"
    assert whole.json()["error"]["code"] == "upstream_unavailable"

    # Billed: exactly the tokens the client received, and nothing for the unanswered one.
    tollway.wait_for_records({seen.request_id, whole.headers["x-request-id"]})
    records = tollway.records()
    streamed = records[seen.request_id]
    assert streamed.status is UsageStatus.UPSTREAM_ERROR
    assert streamed.completion_tokens == seen.num_tokens
    assert streamed.prompt_tokens > 0
    unanswered = records[whole.headers["x-request-id"]]
    assert unanswered.status is UsageStatus.UPSTREAM_ERROR
    assert unanswered.prompt_tokens == unanswered.completion_tokens == 0
    # The ledger settled to the records: nothing left reserved, nothing more used.
    budget = _budget(tollway)
    assert budget["reserved"] == 0
    assert budget["used"] == _settled_tokens(tollway)

    # Restarted by the watchdog; every request succeeds at once: no dead pooled connection.
    _wait_for_a_new_engine(tollway, engine_pid)
    assert "restarted" in tollway.output()
    answers = _burst(tollway, 6, stream=False)
    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert {r.json()["usage"]["completion_tokens"] for r in answers} == {4}
    streams = _burst(tollway, 6, stream=True)
    assert [r.status_code for r in streams] == [200] * 6, [r.text for r in streams]
    assert all(r.text.endswith("data: [DONE]\n\n") for r in streams)
